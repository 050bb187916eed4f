"""The flow-tracing plugin: request milestones in order across a preemption, step lines with their
timings, a hook wrapper that times the other plugins, and nothing at all on the step path when off."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from specloop.kernel.config import EngineConfig
from specloop.kernel.engine_core import EngineCore
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.plugins import PluginManager
from specloop.kernel.request import Request
from specloop.kernel.sampling_params import SamplingParams
from specloop.plugins.tracing import TRACE_ENV, FlowTracer, get_tracer

STEP_HOOKS = ("specloop_step_scheduled", "specloop_step_finished", "specloop_request_added",
              "specloop_request_preempted", "specloop_request_finished")


@pytest.fixture(autouse=True)
def no_trace_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACE_ENV, raising=False)


def make_core(plugins: list[Any] = (), **overrides: Any) -> EngineCore:
    """Five usable blocks of 4 tokens: two requests growing to 14 tokens each cannot both fit."""
    kwargs: dict[str, Any] = dict(model_runner="scripted", block_size=4, num_kv_blocks=6, max_model_len=16,
                                  plugin_options={"tracing": True})
    kwargs.update(overrides)
    config = EngineConfig(**kwargs)
    return EngineCore(config, PluginManager(plugins, disable=config.disable_plugins, load_entrypoints=False))


def run_two(core: EngineCore) -> int:
    """A, then B (admitted last, so the FCFS victim), each 4 prompt tokens and 10 output tokens."""
    core.add_requests([Request("A", [1, 2, 3, 4], SamplingParams(max_tokens=10)),
                       Request("B", [5, 6, 7, 8], SamplingParams(max_tokens=10))])
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        core.post_step()
        steps += 1
    return steps


def flows(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.specloop_flow for r in caplog.records if r.name == "specloop.trace"]


def test_milestones_in_order_for_a_preempted_and_resumed_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specloop.trace")
    core = make_core()
    assert isinstance(get_tracer(core), FlowTracer)
    steps = run_two(core)
    records = flows(caplog)
    by_req: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        if rec["flow"] == "request":
            by_req.setdefault(rec["req"], []).append(rec)
    events = {rid: [rec["event"] for rec in recs] for rid, recs in by_req.items()}
    assert events == {"A": ["added", "scheduled", "first_token", "finished"],
                      "B": ["added", "scheduled", "first_token", "preempted", "resumed", "finished"]}

    b = {rec["event"]: rec for rec in by_req["B"]}
    assert b["scheduled"]["step"] == b["first_token"]["step"] == 1  # a 4-token prompt fits one step
    assert b["scheduled"]["cached_tokens"] == 0 and b["scheduled"]["tokens"] == 4
    assert 1 < b["preempted"]["step"] < b["resumed"]["step"]
    assert b["preempted"]["times"] == 1 and 0 < b["preempted"]["output_tokens"] < 10
    # Resuming recomputes exactly what the prefix cache no longer holds of prompt + output so far.
    assert b["resumed"]["cached_tokens"] + b["resumed"]["tokens"] == 4 + b["preempted"]["output_tokens"]
    assert b["finished"] | {"e2e_ms": 0} == {"flow": "request", "req": "B", "event": "finished", "reason": "length",
                                            "stop_reason": None, "output_tokens": 10, "preemptions": 1,
                                            "e2e_ms": 0}
    a_finished = by_req["A"][-1]
    assert a_finished["reason"] == "length" and a_finished["preemptions"] == 0
    # B waits for A to finish: no admission while the cache is short.
    assert records.index(a_finished) < records.index(b["resumed"])

    lines = [rec for rec in records if rec["flow"] == "step"]
    assert [rec["step"] for rec in lines] == list(range(1, steps + 1))
    for rec in lines:
        assert rec["total_ms"] >= max(rec["schedule_ms"], rec["execute_ms"], rec["update_ms"]) >= 0
        assert rec["hooks_ms"] >= 0 and rec["gap_ms"] >= 0
    by_step = {rec["step"]: rec for rec in lines}
    assert by_step[b["preempted"]["step"]]["preempted"] == 1 and by_step[b["resumed"]["step"]]["resumed"] == 1
    assert by_step[1] | {k: 0 for k in ("gap_ms", "schedule_ms", "execute_ms", "update_ms", "hooks_ms",
                                        "total_ms")} == {
        "flow": "step", "step": 1, "reqs": 2, "tokens": 8, "prompt_tokens": 8, "new": 2, "resumed": 0,
        "preempted": 0, "finished": 0, "running": 2, "waiting": 0, "kv_usage": 0.4, "gap_ms": 0,
        "schedule_ms": 0, "execute_ms": 0, "update_ms": 0, "hooks_ms": 0, "total_ms": 0}
    assert caplog.records[0].getMessage() == "flow=request req=A event=added prompt_tokens=4 max_tokens=10 priority=0"
    assert not get_tracer(core).flows  # nothing kept for finished requests


def test_off_by_default_with_no_hook_on_the_step_path(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specloop.trace")
    core = make_core(plugin_options={})
    assert get_tracer(core) is None
    for name in STEP_HOOKS:
        owners = [impl.plugin_name for impl in getattr(core.plugins.pm.hook, name).get_hookimpls()]
        assert not any("tracing" in owner for owner in owners), (name, owners)
    run_two(core)
    assert flows(caplog) == []


def test_switched_by_env_and_options(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specloop.trace")
    monkeypatch.setenv(TRACE_ENV, "1")
    assert get_tracer(make_core(plugin_options={})) is not None
    assert get_tracer(make_core(plugin_options={"tracing": False})) is None  # the config wins
    assert get_tracer(make_core(plugin_options={}, disable_plugins=("specloop.plugins.tracing",))) is None
    monkeypatch.setenv(TRACE_ENV, "0")
    assert get_tracer(make_core(plugin_options={})) is None
    with pytest.raises(ValueError, match="tracing"):
        make_core(plugin_options={"tracing": "yes"})

    caplog.clear()
    run_two(make_core(plugin_options={"tracing": {"steps": False}}))
    records = flows(caplog)
    assert records and all(rec["flow"] == "request" for rec in records)


class SlowObserver:
    """Another plugin's step hook, taking at least 20 ms."""

    @hookimpl
    def specloop_step_finished(self) -> None:
        time.sleep(0.02)


def test_the_wrapper_times_the_other_plugins(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specloop.trace")
    run_two(make_core([SlowObserver()]))
    lines = [rec for rec in flows(caplog) if rec["flow"] == "step"]
    assert lines and all(rec["hooks_ms"] >= 20 for rec in lines)
    # The engine's own spans end before the events fire: a slow plugin shows up here only.
    assert all(rec["total_ms"] < rec["hooks_ms"] for rec in lines)


def test_one_token_and_aborted_requests(caplog: pytest.LogCaptureFixture) -> None:
    """A first token that also ends the request is still logged, before the finish; a request
    aborted while waiting is added and finished, never scheduled. Ids with spaces stay one field."""
    caplog.set_level(logging.INFO, logger="specloop.trace")
    core = make_core(max_num_seqs=1)
    core.add_requests([Request("short one", [1, 2, 3], SamplingParams(max_tokens=1)),
                       Request("gone", [4, 5, 6], SamplingParams(max_tokens=5))])
    core.step()
    core.abort_requests(["gone"])
    assert not core.has_unfinished_requests()
    events = [(rec["req"], rec["event"], rec.get("reason")) for rec in flows(caplog) if rec["flow"] == "request"]
    assert events == [("short one", "added", None), ("gone", "added", None), ("short one", "scheduled", None),
                      ("short one", "first_token", None), ("short one", "finished", "length"),
                      ("gone", "finished", "abort")]
    assert caplog.records[0].getMessage().startswith('flow=request req="short one" event=added ')
