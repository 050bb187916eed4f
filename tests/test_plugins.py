"""The plugin manager: built-ins as plugins, registries, entry points, disabling, check_pending, and
components replaced from outside the package."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pluggy
import pytest

from specloop.kernel import (EngineConfig, EngineCore, PluginManager, Registry, Request, SamplingParams,
                             UnknownComponentError, hookimpl)
from specloop.kernel.plugins import DISABLE_ENV, builtin_plugin_names
from specloop.kernel.protocols import KVCacheManager, Scheduler
from specloop.plugins.kv_cache import PagedKVCache
from specloop.plugins.scheduler import FCFSScheduler, PriorityScheduler

TESTS = Path(__file__).parent


@pytest.fixture
def outside(monkeypatch):
    """Make ``plugins_outside`` importable, as if pip-installed, without announcing it."""
    monkeypatch.syspath_prepend(str(TESTS))
    import plugins_outside.plugin
    return plugins_outside.plugin


@pytest.fixture
def installed(tmp_path, monkeypatch, outside):
    """Install ``plugins_outside`` as a distribution announcing an entry point in group ``specloop``."""
    dist = tmp_path / "specloop_outside-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: specloop-outside\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[specloop]\noutside = plugins_outside.plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return outside


def run(config: EngineConfig, pm: PluginManager | None = None) -> tuple[EngineCore, dict[str, list[int]]]:
    core = EngineCore(config, plugins=pm or PluginManager(disable=config.disable_plugins))
    core.add_requests([Request(f"r{i}", list(range(3 * i + 1, 3 * i + 9)), SamplingParams(max_tokens=6))
                       for i in range(4)])
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        core.post_step()
    return core, tokens


def test_builtins_are_registered_like_any_plugin():
    pm = PluginManager(load_entrypoints=False)
    for name in ("specloop.plugins.scheduler", "specloop.plugins.kv_cache", "specloop.backends.scripted"):
        assert name in builtin_plugin_names() and pm.pm.get_plugin(name) is sys.modules[name]
    assert {"fcfs", "priority"} <= set(pm.schedulers.names())
    assert {"lru", "none"} <= set(pm.kv_cache_policies.names())
    assert pm.schedulers.get("fcfs") is FCFSScheduler and pm.schedulers.get("priority") is PriorityScheduler
    (entry,) = [e for e in pm.schedulers.entries() if e.name == "fcfs"]
    assert entry.source == "specloop.plugins.scheduler (specloop)"


def test_builtins_come_from_the_distributions_own_entry_points():
    names = builtin_plugin_names()
    assert list(names) == sorted(names)
    assert {"specloop.backends.scripted", "specloop.plugins.tracing", "specloop.server.plugin"} <= set(names)
    # Only the built-ins are loaded without third-party entry points, each under its module name.
    pm = PluginManager(load_entrypoints=False)
    assert [name for name, _ in pm.pm.list_name_plugin()] == list(names)
    assert {"completions", "health", "metrics"} <= set(pm.routes.names())


def test_building_a_plugin_manager_imports_neither_torch_nor_starlette():
    code = ("import sys; from specloop.kernel import PluginManager; pm = PluginManager(); "
            "assert pm.model_runners.names() and pm.routes.names(); "
            "print(sorted(m for m in ('torch', 'starlette') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_registries_are_typed_attributes():
    pm = PluginManager(load_entrypoints=False)
    for kind, registry in pm.registries.items():
        assert isinstance(registry, Registry) and registry.kind == kind and vars(pm)[kind] is registry
    with pytest.raises(AttributeError):
        pm.no_such_kind  # noqa: B018


def test_built_components_satisfy_the_protocols():
    core, _ = run(EngineConfig(model_runner="scripted", scheduler="priority", max_model_len=64))
    assert isinstance(core.scheduler, Scheduler) and isinstance(core.scheduler, PriorityScheduler)
    assert isinstance(core.kv_cache, KVCacheManager) and isinstance(core.kv_cache, PagedKVCache)


def test_unknown_component_lists_the_choices():
    pm = PluginManager(load_entrypoints=False)
    with pytest.raises(UnknownComponentError, match=r"unknown scheduler 'nope'; registered: .*fcfs, priority"):
        pm.schedulers.get("nope")
    with pytest.raises(ValueError, match="unknown kv cache policy 'nope'; registered: .*lru, none"):
        EngineCore(EngineConfig(model_runner="scripted", kv_cache_policy="nope", max_model_len=64), plugins=pm)


def test_registry_rejects_duplicates_and_loads_lazily():
    registry = Registry("schedulers")
    registry.register("x", "specloop.plugins.scheduler:PriorityScheduler", source="a")
    assert registry.get("x") is PriorityScheduler
    with pytest.raises(ValueError, match="'x' is registered twice .by a and by b"):
        registry.register("x", FCFSScheduler, source="b")
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register("", FCFSScheduler)

    class Clash:
        @hookimpl
        def specloop_register_schedulers(self, register):
            register("fcfs", FCFSScheduler)

    with pytest.raises(ValueError, match="'fcfs' is registered twice"):
        PluginManager([Clash()], load_entrypoints=False)


def test_disable_a_plugin_by_name(monkeypatch):
    pm = PluginManager(disable=["specloop.plugins.scheduler"], load_entrypoints=False)
    assert pm.schedulers.names() == [] and "lru" in pm.kv_cache_policies
    monkeypatch.setenv(DISABLE_ENV, "specloop.plugins.kv_cache,unrelated")
    pm = PluginManager(load_entrypoints=False)
    assert "lru" not in pm.kv_cache_policies and "fcfs" in pm.schedulers
    with pytest.raises(UnknownComponentError, match="registered: none"):
        EngineCore(EngineConfig(model_runner="scripted", max_model_len=64))


def test_misspelt_hook_fails_loudly():
    class Typo:
        @hookimpl
        def specloop_register_schedulerz(self, register):
            register("typo", FCFSScheduler)

    with pytest.raises(pluggy.PluginValidationError, match="specloop_register_schedulerz"):
        PluginManager([Typo()], load_entrypoints=False)


def test_one_plugin_manager_per_engine():
    class Extra:
        @hookimpl
        def specloop_register_schedulers(self, register):
            register("extra", FCFSScheduler)

    with_extra = PluginManager([Extra()], load_entrypoints=False)
    plain = PluginManager(load_entrypoints=False)
    assert "extra" in with_extra.schedulers and "extra" not in plain.schedulers


def test_outside_plugin_replaces_scheduler_and_kv_policy_through_config(outside):
    base = dict(model_runner="scripted", max_model_len=64, block_size=4, num_kv_blocks=40)
    _, expected = run(EngineConfig(**base))
    pm = PluginManager([outside], load_entrypoints=False)
    for scheduler, policy in (("serial", "lru"), ("fcfs", "stack"), ("serial", "stack")):
        core, tokens = run(EngineConfig(**base, scheduler=scheduler, kv_cache_policy=policy), pm)
        assert tokens == expected
        assert type(core.scheduler).__module__ == ("plugins_outside.plugin" if scheduler == "serial"
                                                   else "specloop.plugins.scheduler")
        assert type(core.kv_cache).__module__ == ("plugins_outside.plugin" if policy == "stack"
                                                  else "specloop.plugins.kv_cache")
        assert core.kv_cache.usage == 0.0
    # serial really ran one request at a time
    core, _ = run(EngineConfig(**base, scheduler="serial"), pm)
    assert core.scheduler.step_id >= 4 * 6


def test_entry_point_plugin_is_discovered_and_can_be_disabled(installed, monkeypatch):
    pm = PluginManager()
    assert "serial" in pm.schedulers and "stack" in pm.kv_cache_policies
    (entry,) = [e for e in pm.schedulers.entries() if e.name == "serial"]
    assert entry.source == "outside (specloop-outside)"
    core, tokens = run(EngineConfig(model_runner="scripted", max_model_len=64, scheduler="serial",
                                    kv_cache_policy="stack"))
    assert type(core.scheduler).__name__ == "SerialScheduler" and len(tokens) == 4
    assert core.kv_cache.num_allocations > 0
    assert "serial" not in PluginManager(disable=["outside"]).schedulers
    with pytest.raises(UnknownComponentError, match="unknown scheduler 'serial'"):
        EngineCore(EngineConfig(model_runner="scripted", max_model_len=64, scheduler="serial",
                                disable_plugins="outside"))
    monkeypatch.setenv(DISABLE_ENV, "outside")
    assert "serial" not in PluginManager().schedulers


def test_readme_plugin_example_works():
    readme = (TESTS.parent / "README.md").read_text()
    section = readme.split("## Writing a plugin", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("my_package_plugin")
    exec(compile(code, "README.md", "exec"), module.__dict__)
    pm = PluginManager([module], load_entrypoints=False)
    core = EngineCore(EngineConfig(model_runner="scripted", max_model_len=64, scheduler="shortest_first",
                                   max_num_seqs=1), plugins=pm)
    core.add_requests([Request("long", list(range(1, 30)), SamplingParams(max_tokens=2)),
                       Request("short", [5, 6], SamplingParams(max_tokens=2))])
    plan = core.scheduler.schedule()
    assert list(plan.num_scheduled_tokens) == ["short"]
