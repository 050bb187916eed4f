"""The plugin manager: one per engine, built-ins registered exactly like third-party plugins."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pluggy

from . import hookspecs

ENTRY_POINT_GROUP = "specloop"
DISABLE_ENV = "SPECLOOP_DISABLE_PLUGINS"

# Built-in plugins, registered in this order before entry-point plugins. Each is a module with
# ``@hookimpl`` functions; none is special-cased anywhere else.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "specloop.backends.scripted",
    "specloop.backends.plugin",
    "specloop.models.plugin",
    "specloop.plugins.kv_cache",
    "specloop.plugins.scheduler",
    "specloop.plugins.spec_metrics",
    "specloop.plugins.tracing",
    "specloop.proposers.plugin",
    "specloop.server.routes",
)

COMPONENT_KINDS = ("schedulers", "kv_cache_policies", "attention_backends", "model_runners", "models",
                   "proposers", "routes")


class UnknownComponentError(ValueError):
    """A component name that no plugin registered."""


@dataclass(slots=True)
class Entry:
    name: str
    factory: Callable[..., Any] | str  # a callable, or "module:attr" imported on first use
    source: str  # the plugin (and distribution) that registered it

    def load(self) -> Callable[..., Any]:
        if isinstance(self.factory, str):
            module, _, attr = self.factory.partition(":")
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            self.factory = obj
        return self.factory


class Registry:
    """Named factories of one component kind, filled by a ``specloop_register_*`` hook."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, factory: Callable[..., Any] | str, *, source: str = "?") -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind}: a component name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind}: {name!r} is registered twice "
                             f"(by {self._entries[name].source} and by {source})")
        self._entries[name] = Entry(name, factory, source)

    def get(self, name: str) -> Callable[..., Any]:
        try:
            return self._entries[name].load()
        except KeyError:
            choices = ", ".join(sorted(self._entries)) or "none"
            kind = self.kind.removesuffix("ies") + "y" if self.kind.endswith("ies") else self.kind.removesuffix("s")
            raise UnknownComponentError(f"unknown {kind.replace('_', ' ')} {name!r}; "
                                        f"registered: {choices}") from None

    def create(self, name: str, **kwargs: Any) -> Any:
        return self.get(name)(**kwargs)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())


class Hooks:
    """Typed wrappers around the event hooks, so callers pass keywords and get checking."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._h = pm.hook

    def configure(self, config: Any) -> None:
        self._h.specloop_configure(config=config)

    def startup(self, engine: Any) -> None:
        self._h.specloop_startup(engine=engine)

    def shutdown(self, engine: Any) -> None:
        self._h.specloop_shutdown(engine=engine)

    def request_added(self, requests: list[Any]) -> None:
        self._h.specloop_request_added(requests=requests)

    def request_preempted(self, requests: list[Any], step_id: int) -> None:
        self._h.specloop_request_preempted(requests=requests, step_id=step_id)

    def request_finished(self, requests: list[Any]) -> None:
        self._h.specloop_request_finished(requests=requests)

    def step_scheduled(self, plan: Any) -> None:
        self._h.specloop_step_scheduled(plan=plan)

    def step_finished(self, plan: Any, result: Any, outputs: Any, timings: dict[str, float]) -> None:
        self._h.specloop_step_finished(plan=plan, result=result, outputs=outputs, timings=timings)

    def drafts_verified(self, step_id: int, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                        accepted_per_position: list[int]) -> None:
        self._h.specloop_drafts_verified(step_id=step_id, num_drafts=num_drafts,
                                         num_draft_tokens=num_draft_tokens,
                                         num_accepted_tokens=num_accepted_tokens,
                                         accepted_per_position=accepted_per_position)


class PluginManager:
    """Loads plugins and exposes one :class:`Registry` per component kind plus :class:`Hooks`.

    :param plugins: extra plugin objects (modules or instances) registered after the built-ins,
        e.g. by a test.
    :param disable: plugin names to block (built-in module names, entry-point names, or the names
        given in ``plugins``); ``SPECLOOP_DISABLE_PLUGINS`` (comma-separated) adds to it.
    :param load_entrypoints: also load plugins announced under the ``specloop`` entry-point group.
    """

    def __init__(self, plugins: Iterable[Any] = (), *, disable: Iterable[str] = (),
                 load_entrypoints: bool = True) -> None:
        self.pm = pluggy.PluginManager("specloop")
        self.pm.add_hookspecs(hookspecs)
        blocked = set(disable) | {p for p in os.environ.get(DISABLE_ENV, "").split(",") if p}
        for name in blocked:
            self.pm.set_blocked(name)
        self._sources: dict[str, str] = {}
        for module_name in DEFAULT_PLUGINS:
            if not self.pm.is_blocked(module_name):
                self.pm.register(importlib.import_module(module_name), name=module_name)
                self._sources[module_name] = "specloop"
        if load_entrypoints:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if self.pm.is_blocked(ep.name) or self.pm.get_plugin(ep.name) is not None:
                    continue
                self.pm.register(ep.load(), name=ep.name)
                self._sources[ep.name] = ep.dist.name if ep.dist else ep.value
        for plugin in plugins:
            name = getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{id(plugin):x}"
            if not self.pm.is_blocked(name):
                self.pm.register(plugin, name=name)
                self._sources[name] = "<local>"
        # A misspelt hook implementation fails here rather than being silently ignored.
        self.pm.check_pending()
        self.hooks = Hooks(self.pm)
        self.registries = {kind: self._collect(kind) for kind in COMPONENT_KINDS}

    def _collect(self, kind: str) -> Registry:
        registry = Registry(kind)
        caller = getattr(self.pm.hook, f"specloop_register_{kind}")
        for impl in reversed(caller.get_hookimpls()):  # registration order
            source = f"{impl.plugin_name} ({self._sources.get(impl.plugin_name, '?')})"

            def register(name: str, factory: Any, _source: str = source) -> None:
                registry.register(name, factory, source=_source)

            impl.function(**({'register': register} if 'register' in impl.argnames else {}))
        return registry

    def __getattr__(self, kind: str) -> Registry:
        # ``pm.schedulers``, ``pm.models``, ...
        try:
            return self.__dict__["registries"][kind]
        except KeyError:
            raise AttributeError(kind) from None

    def unregister(self, plugin: Any) -> None:
        self.pm.unregister(plugin)

    def list_components(self) -> dict[str, list[Entry]]:
        return {kind: reg.entries() for kind, reg in self.registries.items()}
