"""``EngineConfig.plugin_options``: one entry per plugin or component, named after it, each a dict
of that one's options. A key is refused, naming it, when no registered component or plugin has
that name (:func:`check_namespaces`), and an option when its owner does not know it
(:func:`options_of`): nothing given there is silently ignored."""

from __future__ import annotations

from typing import Any, Iterable


def options_of(config: Any, name: str, known: Iterable[str]) -> dict[str, Any]:
    """``config.plugin_options[name]`` (``{}`` when absent), which must be a dict of ``known`` keys."""
    options = config.plugin_options.get(name, {})
    if not isinstance(options, dict):
        raise ValueError(f"plugin_options[{name!r}] must be a dict of options, got {options!r}")
    known = tuple(known)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"plugin_options[{name!r}] has unknown option(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(known)}")
    return options


def check_namespaces(config: Any, plugins: Any) -> None:
    """Each key of ``config.plugin_options`` names a component some registry holds, or a plugin
    (the last dotted part of its registered name: ``tracing`` for ``specloop.plugins.tracing``)."""
    known = {e.name for entries in plugins.list_components().values() for e in entries}
    known |= {name.rsplit(".", 1)[-1] for name, plugin in plugins.pm.list_name_plugin() if plugin is not None}
    unknown = sorted(set(config.plugin_options) - known)
    if unknown:
        raise ValueError(f"plugin_options has key(s) {', '.join(map(repr, unknown))} that name no registered "
                         "component or plugin (`specloop plugins` lists them)")
