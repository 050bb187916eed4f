"""Building an engine for the frontends: config, model path, tokenizer, core, input processor."""

from __future__ import annotations

import os
from typing import Any

from specloop.kernel.config import EngineConfig
from specloop.kernel.engine_core import EngineCore
from specloop.kernel.plugins import PluginManager

from .input_processor import InputProcessor
from .model_path import resolve_model
from .tokenizer import Tokenizer, read_generation_eos_ids


def make_config(model: str | None, engine_args: dict[str, Any]) -> EngineConfig:
    """``EngineConfig`` from vLLM-style keyword arguments, with a clear error for unknown ones."""
    known = set(EngineConfig.field_names())
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; known: {', '.join(sorted(known))}")
    if "model" in engine_args:
        raise TypeError("pass the model once, as the first argument")
    return EngineConfig(model=model, **engine_args)


def _runner_requires_model(config: EngineConfig, plugins: PluginManager) -> bool:
    name = config.model_runner
    if name and name in plugins.model_runners:
        return bool(getattr(plugins.model_runners.get(name), "requires_model", True))
    return True


class LoadedEngine:
    """What both frontends need: the core, the tokenizer (None without one), the input processor."""

    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None) -> None:
        if config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs several engines behind a router: use `specloop serve "
                             "--data-parallel-size N` or frontend.data_parallel.DataParallelEngine")
        plugins = plugins or PluginManager(disable=config.disable_plugins)
        if config.model is not None or _runner_requires_model(config, plugins):
            config.model = resolve_model(config.model)
        self.tokenizer: Tokenizer | None = None
        tokenizer_dir = config.tokenizer or config.model
        if not config.skip_tokenizer_init and tokenizer_dir is not None:
            self.tokenizer = Tokenizer(resolve_tokenizer(tokenizer_dir), model_dir=config.model)
        self.core = EngineCore(config, plugins)
        self.config = config
        self.vocab_size: int = self.core.runner.vocab_size
        eos = list(self.tokenizer.eos_token_ids if self.tokenizer is not None else read_generation_eos_ids(config.model))
        for tid in getattr(self.core.runner, "eos_token_ids", None) or ():
            if tid not in eos:
                eos.append(tid)
        self.eos_token_ids = tuple(eos)
        self.processor = InputProcessor(config, self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.model_name = model_name(config)


def resolve_tokenizer(path: str) -> str:
    expanded = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(expanded):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    return expanded


def model_name(config: EngineConfig) -> str:
    """The model directory's basename (what the API reports), or the runner's name without a model."""
    if config.model:
        return os.path.basename(os.path.normpath(config.model))
    return config.model_runner or "specloop"
