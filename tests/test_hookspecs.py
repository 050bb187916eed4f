"""Meta-tests: every hookspec is documented in its docstring and in docs/hooks.md with its exact
signature, its typed call site in ``Hooks`` matches it, and one engine run fires every one of them."""

from __future__ import annotations

import inspect
import re
from collections import defaultdict
from pathlib import Path

import pytest

from specloop.kernel import EngineConfig, EngineCore, PluginManager, Request, RequestStatus, SamplingParams, hookimpl
from specloop.kernel import hookspecs
from specloop.kernel.plugins import Hooks

DOCS = Path(__file__).parent.parent / "docs" / "hooks.md"
SPECS = {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
         if name.startswith("specloop_")}


def signature_text(name: str, fn) -> str:
    sig = inspect.signature(fn)  # annotations stay strings (postponed evaluation)
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"{name}({params}) -> {sig.return_annotation}"


def test_hookspecs_are_found():
    assert len(SPECS) >= 15 and "specloop_register_schedulers" in SPECS


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_hookspec_has_a_full_docstring(name):
    fn = SPECS[name]
    doc = inspect.getdoc(fn) or ""
    assert "Fires" in doc, f"{name}: say when it fires"
    for param in inspect.signature(fn).parameters:
        assert f":param {param}:" in doc, f"{name}: document :param {param}:"
    if fn.specloop_spec.get("firstresult"):
        assert "stops at the first non-None result" in doc


def test_docs_list_every_hook_with_its_exact_signature():
    documented = dict(re.findall(r"^### `((specloop_\w+)\(.*\) -> .*)`$", DOCS.read_text(), re.M))
    documented = {name: text for text, name in documented.items()}
    assert set(documented) == set(SPECS), f"missing: {set(SPECS) - set(documented)}, " \
                                          f"stale: {set(documented) - set(SPECS)}"
    for name, fn in SPECS.items():
        assert documented[name] == signature_text(name, fn)


EVENT_SPECS = {name: fn for name, fn in SPECS.items() if not name.startswith("specloop_register_")}
WRAPPERS = {name: fn for name, fn in inspect.getmembers(Hooks, inspect.isfunction) if not name.startswith("_")}


def parameters(fn, skip_self: bool = False) -> list[tuple[str, str]]:
    params = list(inspect.signature(fn).parameters.values())[1 if skip_self else 0:]
    return [(p.name, str(p.annotation)) for p in params]


def test_every_event_hook_has_one_typed_call_site_with_its_exact_parameters():
    for spec_name, spec in EVENT_SPECS.items():
        wrapper = WRAPPERS.get(spec_name.removeprefix("specloop_"))
        assert wrapper is not None, f"Hooks has no method for {spec_name}"
        assert parameters(wrapper, skip_self=True) == parameters(spec), f"Hooks.{wrapper.__name__} != {spec_name}"
        assert inspect.signature(wrapper).return_annotation == inspect.signature(spec).return_annotation


def test_every_call_site_calls_its_own_hookspec_with_every_argument_by_keyword():
    assert len(WRAPPERS) == len(EVENT_SPECS)
    for name, wrapper in WRAPPERS.items():
        source = inspect.getsource(wrapper)
        called = re.findall(r"self\._h\.(\w+)\(", source)
        assert called == [f"specloop_{name}"] and called[0] in EVENT_SPECS, f"Hooks.{name} calls {called}"
        call = source[source.index(called[0]):]
        for param, _ in parameters(wrapper, skip_self=True):
            assert re.search(rf"\b{param}={param}\b", call), f"Hooks.{name} does not pass {param}={param}"


class Recorder:
    """Implements every hook and records what it was given."""

    def __init__(self) -> None:
        self.calls: dict[str, list[dict]] = defaultdict(list)

    @hookimpl
    def specloop_register_schedulers(self, register):
        self.calls["specloop_register_schedulers"].append({"register": register})

    @hookimpl
    def specloop_register_kv_cache_policies(self, register):
        self.calls["specloop_register_kv_cache_policies"].append({"register": register})

    @hookimpl
    def specloop_register_attention_backends(self, register):
        self.calls["specloop_register_attention_backends"].append({"register": register})

    @hookimpl
    def specloop_register_model_runners(self, register):
        self.calls["specloop_register_model_runners"].append({"register": register})

    @hookimpl
    def specloop_register_models(self, register):
        self.calls["specloop_register_models"].append({"register": register})

    @hookimpl
    def specloop_register_proposers(self, register):
        self.calls["specloop_register_proposers"].append({"register": register})

    @hookimpl
    def specloop_register_speculation_policies(self, register):
        self.calls["specloop_register_speculation_policies"].append({"register": register})

    @hookimpl
    def specloop_register_structured_output_backends(self, register):
        self.calls["specloop_register_structured_output_backends"].append({"register": register})

    @hookimpl
    def specloop_register_tool_parsers(self, register):
        self.calls["specloop_register_tool_parsers"].append({"register": register})

    @hookimpl
    def specloop_register_routes(self, register):
        self.calls["specloop_register_routes"].append({"register": register})

    @hookimpl
    def specloop_configure(self, config):
        config.max_num_seqs = 5  # configure runs before the components: the scheduler must see this
        self.calls["specloop_configure"].append({"config": config})

    @hookimpl
    def specloop_startup(self, engine):
        self.calls["specloop_startup"].append({"engine": engine})

    @hookimpl
    def specloop_shutdown(self, engine):
        self.calls["specloop_shutdown"].append({"engine": engine})

    @hookimpl
    def specloop_request_added(self, requests):
        self.calls["specloop_request_added"].append({"ids": [r.request_id for r in requests]})

    @hookimpl
    def specloop_request_preempted(self, requests, step_id):
        self.calls["specloop_request_preempted"].append(
            {"statuses": {r.status for r in requests}, "computed": {r.num_computed_tokens for r in requests},
             "step_id": step_id})

    @hookimpl
    def specloop_request_finished(self, requests):
        self.calls["specloop_request_finished"].append({"finished": [(r.request_id, r.status) for r in requests]})

    @hookimpl
    def specloop_step_scheduled(self, plan):
        self.calls["specloop_step_scheduled"].append({"plan": plan})

    @hookimpl
    def specloop_step_finished(self, plan, result, outputs, timings):
        self.calls["specloop_step_finished"].append({"plan": plan, "result": result, "outputs": outputs,
                                                     "timings": timings})

    @hookimpl
    def specloop_drafts_verified(self, step_id, num_drafts, num_draft_tokens, num_accepted_tokens,
                                 accepted_per_position):
        self.calls["specloop_drafts_verified"].append(
            {"step_id": step_id, "num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens,
             "num_accepted_tokens": num_accepted_tokens, "per_pos": accepted_per_position})


def test_every_hook_fires_with_sensible_arguments():
    recorder = Recorder()
    pm = PluginManager([recorder], load_entrypoints=False)
    config = EngineConfig(model_runner="scripted", block_size=4, num_kv_blocks=17, max_model_len=64,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                          plugin_options={"scripted": {"draft_accuracy": 0.6}})
    core = EngineCore(config, plugins=pm)
    requests = [Request(f"r{i}", list(range(7 * i + 1, 7 * i + 6 + 3 * i)), SamplingParams(max_tokens=30))
                for i in range(6)]
    core.add_requests(requests)
    core.add_requests([Request("doomed", [1, 2, 3], SamplingParams())])
    core.abort_requests(["doomed", "unknown"])
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        core.post_step()
        steps += 1
    core.shutdown()
    calls = recorder.calls

    assert set(calls) == set(SPECS), f"never fired: {set(SPECS) - set(calls)}"
    for name in SPECS:
        if name.startswith("specloop_register_"):
            assert len(calls[name]) == 1 and callable(calls[name][0]["register"])
    assert [len(calls[n]) for n in ("specloop_configure", "specloop_startup", "specloop_shutdown")] == [1, 1, 1]
    assert calls["specloop_startup"][0]["engine"] is core and core.scheduler.max_num_seqs == 5
    assert calls["specloop_request_added"] == [{"ids": [r.request_id for r in requests]}, {"ids": ["doomed"]}]
    finished = [f for call in calls["specloop_request_finished"] for f in call["finished"]]
    assert finished[0] == ("doomed", RequestStatus.FINISHED_ABORTED)
    assert sorted(rid for rid, _ in finished[1:]) == sorted(r.request_id for r in requests)
    assert all(status == RequestStatus.FINISHED_LENGTH for _, status in finished[1:])
    for call in calls["specloop_request_preempted"]:
        assert call["statuses"] == {RequestStatus.PREEMPTED} and call["computed"] == {0}
    assert len(calls["specloop_step_scheduled"]) == len(calls["specloop_step_finished"]) == steps
    for call in calls["specloop_step_finished"]:
        assert call["result"].req_ids == list(call["plan"].num_scheduled_tokens)
        assert set(call["timings"]) == {"schedule", "execute", "update", "total"}
    verified = calls["specloop_drafts_verified"]
    by_step = {c["plan"].step_id: c["outputs"].scheduler_stats for c in calls["specloop_step_finished"]}
    for call in verified:
        stats = by_step[call["step_id"]]
        assert (call["num_drafts"], call["num_draft_tokens"], call["num_accepted_tokens"]) == \
               (stats.spec_decoding.num_drafts, stats.spec_decoding.num_draft_tokens,
                stats.spec_decoding.num_accepted_tokens)
        assert sum(call["per_pos"]) == call["num_accepted_tokens"] and len(call["per_pos"]) == 2
        assert call["per_pos"][0] >= call["per_pos"][1]
