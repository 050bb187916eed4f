"""The engine args as command-line flags: one ``--flag`` per :class:`EngineConfig` field, spelled as
vLLM spells them, shared by ``specloop generate`` and ``specloop serve``."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from specloop.kernel.config import EngineConfig

# Fields with a flag of their own (or none): the model is positional, the rest are structured.
_SKIP = {"model", "plugin_options", "speculative_config", "disable_plugins"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add an ``engine`` argument group to ``parser``."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = str(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        if "bool" in hint:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif "int" in hint and "float" not in hint:
            group.add_argument(flag, type=int, default=default)
        elif "float" in hint:
            group.add_argument(flag, type=float, default=default)
        else:
            group.add_argument(flag, type=str, default=default)
    group.add_argument("--speculative-config", type=str, default=None,
                       help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    group.add_argument("--disable-plugin", action="append", default=[], dest="disable_plugins",
                       help="block a plugin by name (repeatable)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine args present on ``args`` as ``EngineConfig`` keyword arguments."""
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name not in _SKIP and hasattr(args, f.name)}
    kwargs["speculative_config"] = getattr(args, "speculative_config", None)
    kwargs["disable_plugins"] = tuple(getattr(args, "disable_plugins", ()) or ())
    return kwargs
