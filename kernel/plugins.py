"""The plugin manager: one per engine, built-ins registered exactly like third-party plugins.

The kernel names no built-in. specloop's own plugins are announced the way any package announces
one: as entry points in group ``specloop`` of the ``specloop`` distribution (its ``pyproject.toml``),
each named after its module so ``--disable-plugin specloop.plugins.scheduler`` blocks it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import pluggy

from . import hookspecs

if TYPE_CHECKING:
    from .config import EngineConfig
    from .outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
    from .request import Request

ENTRY_POINT_GROUP = "specloop"
BUILTIN_DISTRIBUTION = "specloop"
DISABLE_ENV = "SPECLOOP_DISABLE_PLUGINS"

COMPONENT_KINDS = ("schedulers", "kv_cache_policies", "attention_backends", "model_runners", "models",
                   "proposers", "speculation_policies", "structured_output_backends", "tool_parsers", "routes")


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
    """Typed call sites of the event hooks, so callers pass keywords and get checking.

    Each method is named after its hookspec without the ``specloop_`` prefix and takes exactly the
    hookspec's parameters (a meta-test in ``tests/test_hookspecs.py`` holds them together).
    """

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._h = pm.hook

    def configure(self, config: EngineConfig) -> None:
        self._h.specloop_configure(config=config)

    def startup(self, engine: Any) -> None:
        self._h.specloop_startup(engine=engine)

    def shutdown(self, engine: Any) -> None:
        self._h.specloop_shutdown(engine=engine)

    def request_added(self, requests: list[Request]) -> None:
        self._h.specloop_request_added(requests=requests)

    def request_preempted(self, requests: list[Request], step_id: int) -> None:
        self._h.specloop_request_preempted(requests=requests, step_id=step_id)

    def request_finished(self, requests: list[Request]) -> None:
        self._h.specloop_request_finished(requests=requests)

    def step_scheduled(self, plan: SchedulerOutput) -> None:
        self._h.specloop_step_scheduled(plan=plan)

    def step_finished(self, plan: SchedulerOutput, result: ModelRunnerOutput, outputs: EngineCoreOutputs,
                      timings: dict[str, float]) -> None:
        self._h.specloop_step_finished(plan=plan, result=result, outputs=outputs, timings=timings)

    def drafts_verified(self, step_id: int, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                        accepted_per_position: list[int]) -> None:
        self._h.specloop_drafts_verified(step_id=step_id, num_drafts=num_drafts, num_draft_tokens=num_draft_tokens,
                                         num_accepted_tokens=num_accepted_tokens, accepted_per_position=accepted_per_position)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _builtin_entry_points() -> list[importlib.metadata.EntryPoint]:
    try:
        dist = importlib.metadata.distribution(BUILTIN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"specloop's built-in plugins are entry points of the installed "
                           f"{BUILTIN_DISTRIBUTION!r} distribution, which is not installed in this "
                           "environment; install the package (e.g. `pip install -e .`)") from None
    # By name, whatever order the build backend wrote them in: the registration order decides the
    # order of hook calls and of each registry's names, so it must not depend on the backend.
    return sorted((ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def builtin_plugin_names() -> tuple[str, ...]:
    """The built-in plugins (module names), in the order they are registered."""
    return tuple(ep.name for ep in _builtin_entry_points())


def _is_builtin(ep: importlib.metadata.EntryPoint) -> bool:
    return ep.dist is not None and _normalized(ep.dist.name) == BUILTIN_DISTRIBUTION


class PluginManager:
    """Loads plugins and exposes one :class:`Registry` per component kind plus :class:`Hooks`.

    The built-ins (the ``specloop`` distribution's own entry points) are always loaded first,
    unless blocked.

    :param plugins: extra plugin objects (modules or instances) registered after the others,
        e.g. by a test.
    :param disable: plugin names to block (built-in module names, entry-point names, or the names
        given in ``plugins``); ``SPECLOOP_DISABLE_PLUGINS`` (comma-separated) adds to it.
    :param load_entrypoints: also load third-party plugins announced under the ``specloop``
        entry-point group (False: built-ins and ``plugins`` only).
    """

    def __init__(self, plugins: Iterable[Any] = (), *, disable: Iterable[str] = (),
                 load_entrypoints: bool = True) -> None:
        self.pm = pluggy.PluginManager("specloop")
        self.pm.add_hookspecs(hookspecs)
        blocked = set(disable) | {p for p in os.environ.get(DISABLE_ENV, "").split(",") if p}
        for name in blocked:
            self.pm.set_blocked(name)
        self._sources: dict[str, str] = {}
        for ep in _builtin_entry_points():
            if not self.pm.is_blocked(ep.name):
                self.pm.register(ep.load(), name=ep.name)
                self._sources[ep.name] = BUILTIN_DISTRIBUTION
        if load_entrypoints:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if _is_builtin(ep) or self.pm.is_blocked(ep.name) or self.pm.get_plugin(ep.name) is not None:
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
        self.schedulers: Registry = self._collect("schedulers")
        self.kv_cache_policies: Registry = self._collect("kv_cache_policies")
        self.attention_backends: Registry = self._collect("attention_backends")
        self.model_runners: Registry = self._collect("model_runners")
        self.models: Registry = self._collect("models")
        self.proposers: Registry = self._collect("proposers")
        self.speculation_policies: Registry = self._collect("speculation_policies")
        self.structured_output_backends: Registry = self._collect("structured_output_backends")
        self.tool_parsers: Registry = self._collect("tool_parsers")
        self.routes: Registry = self._collect("routes")
        self.registries: dict[str, Registry] = {kind: getattr(self, kind) for kind in COMPONENT_KINDS}

    def _collect(self, kind: str) -> Registry:
        registry = Registry(kind)
        caller = getattr(self.pm.hook, f"specloop_register_{kind}")
        for impl in reversed(caller.get_hookimpls()):  # pluggy's call order: the last registered first
            source = f"{impl.plugin_name} ({self._sources.get(impl.plugin_name, '?')})"

            def register(name: str, factory: Any, _source: str = source) -> None:
                registry.register(name, factory, source=_source)

            impl.function(**({'register': register} if 'register' in impl.argnames else {}))
        return registry

    def unregister(self, plugin: Any) -> None:
        self.pm.unregister(plugin)

    def list_components(self) -> dict[str, list[Entry]]:
        return {kind: reg.entries() for kind, reg in self.registries.items()}
