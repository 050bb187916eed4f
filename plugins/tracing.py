"""Flow tracing: each request's lifecycle milestones and each step's timings, as log lines.

A built-in plugin like any other, off by default. ``SPECLOOP_FLOW_TRACE=1`` (or
``plugin_options["tracing"] = True``, or a dict of options) turns it on: when an engine starts, one
:class:`FlowTracer` is registered into that engine's plugin manager and logs, to the
``specloop.trace`` logger at INFO, one ``logfmt`` line per milestone and per step::

    flow=request req=r7 event=added prompt_tokens=812 max_tokens=128 priority=0
    flow=request req=r7 event=scheduled step=41 queued_ms=3.2 cached_tokens=512 tokens=300
    flow=request req=r7 event=first_token step=43 ttft_ms=21.9
    flow=request req=r7 event=preempted step=60 output_tokens=17 times=1
    flow=request req=r7 event=resumed step=75 after_ms=40.1 cached_tokens=816 tokens=13
    flow=request req=r7 event=finished reason=length stop_reason=None output_tokens=128 preemptions=1 e2e_ms=410.2
    flow=step step=43 reqs=6 tokens=311 prompt_tokens=300 new=1 resumed=0 preempted=0 finished=0 running=6 waiting=2 kv_usage=0.41 gap_ms=0.3 schedule_ms=0.2 execute_ms=6.8 update_ms=0.1 hooks_ms=0.05 total_ms=7.1

Each record also carries its fields as ``record.specloop_flow`` (a dict) for programs. Times are
``time.monotonic()`` spans from the request's arrival (its ``Request.arrival_time``); ``ttft_ms``
is the core's view (the token committed), before detokenization and HTTP. Step spans come from
``specloop_step_finished``'s ``timings``; ``hooks_ms`` is what every other plugin's
``specloop_step_finished`` took (measured by a hook wrapper), ``gap_ms`` the time between the end
of the previous step and the start of this one (post_step, output dispatch, input draining).

Disabled, the module implements ``specloop_startup`` only: steps run no tracing code at all.
``plugin_options["tracing"] = {"steps": False}`` keeps the request milestones and drops the step
lines.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from specloop.plugins.options import options_of
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.outputs import EngineCoreOutputs, SchedulerOutput
from specloop.kernel.request import Request

logger = logging.getLogger("specloop.trace")

PLUGIN_NAME = "tracing"
TRACE_ENV = "SPECLOOP_FLOW_TRACE"


def tracing_options(config: Any) -> dict[str, Any] | None:
    """The tracer's options for an engine config, or None when tracing is off. The config's
    ``plugin_options["tracing"]`` wins over ``SPECLOOP_FLOW_TRACE``."""
    value = config.plugin_options.get(PLUGIN_NAME)
    if value is None:
        value = os.environ.get(TRACE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
    if isinstance(value, bool):
        return {} if value else None
    if isinstance(value, dict):
        options_of(config, PLUGIN_NAME, ("enabled", "steps"))
        return value if value.get("enabled", True) else None
    raise ValueError(f"plugin_options['{PLUGIN_NAME}'] must be a bool or a dict of options, got {value!r}")


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _logfmt(value: Any) -> str:
    text = str(value)
    # Quoted (JSON escapes) when a stop string or an id would otherwise break the key=value split.
    if isinstance(value, str) and (not text or any(c in text for c in ' ="\\') or not text.isprintable()):
        return json.dumps(text, ensure_ascii=False)
    return text


@dataclass(slots=True)
class _Flow:
    """What the tracer remembers about one live request. Set by :class:`FlowTracer`."""

    request: Request
    scheduled: bool = False
    first_token: bool = False
    preempted_at: float | None = None  # time.monotonic() of the last preemption


class FlowTracer:
    """One engine's tracer.

    :param steps: also log one line per step.
    """

    def __init__(self, steps: bool = True) -> None:
        self.steps = steps
        self.flows: dict[str, _Flow] = {}
        self._step_id = 0  # the step being run (set when it is scheduled)
        self._last_step_end: float | None = None

    @staticmethod
    def emit(flow: str, **fields: Any) -> None:
        text = " ".join(f"{k}={_logfmt(v)}" for k, v in fields.items())
        logger.info("flow=%s %s", flow, text, extra={"specloop_flow": {"flow": flow, **fields}})

    # --- request milestones (once per request batch) -------------------------------------------

    @hookimpl
    def specloop_request_added(self, requests: list[Request]) -> None:
        for r in requests:
            self.flows[r.request_id] = _Flow(r)
            self.emit("request", req=r.request_id, event="added", prompt_tokens=r.num_prompt_tokens,
                      max_tokens=r.sampling_params.max_tokens, priority=r.priority)

    @hookimpl
    def specloop_step_scheduled(self, plan: SchedulerOutput) -> None:
        self._step_id = plan.step_id
        now = time.monotonic()
        for new in plan.scheduled_new_reqs:
            flow = self.flows.get(new.req_id)
            if flow is None or flow.scheduled:
                continue
            flow.scheduled = True
            self.emit("request", req=new.req_id, event="scheduled", step=plan.step_id,
                      queued_ms=_ms(now - flow.request.arrival_time), cached_tokens=new.num_computed_tokens,
                      tokens=plan.num_scheduled_tokens[new.req_id])
        for resumed in plan.scheduled_resumed_reqs:
            flow = self.flows.get(resumed.req_id)
            if flow is None:
                continue
            after = now - flow.preempted_at if flow.preempted_at is not None else 0.0
            self.emit("request", req=resumed.req_id, event="resumed", step=plan.step_id, after_ms=_ms(after),
                      cached_tokens=resumed.num_computed_tokens, tokens=plan.num_scheduled_tokens[resumed.req_id])

    @hookimpl
    def specloop_request_preempted(self, requests: list[Request], step_id: int) -> None:
        now = time.monotonic()
        for r in requests:
            flow = self.flows.get(r.request_id)
            if flow is not None:
                flow.preempted_at = now
            self.emit("request", req=r.request_id, event="preempted", step=step_id,
                      output_tokens=r.num_output_tokens, times=r.num_preemptions)

    @hookimpl
    def specloop_request_finished(self, requests: list[Request]) -> None:
        now = time.monotonic()
        for r in requests:
            flow = self.flows.pop(r.request_id, None)
            if flow is not None and not flow.first_token and r.num_output_tokens:
                self._first_token(flow)  # its first token also ended it, in this step
            reason = r.finish_reason.value if r.finish_reason is not None else r.status.name.lower()
            self.emit("request", req=r.request_id, event="finished", reason=reason, stop_reason=r.stop_reason,
                      output_tokens=r.num_output_tokens, preemptions=r.num_preemptions,
                      e2e_ms=_ms(now - r.arrival_time))

    # --- steps ---------------------------------------------------------------------------------

    @hookimpl(wrapper=True)
    def specloop_step_finished(self, plan: SchedulerOutput, outputs: EngineCoreOutputs,
                               timings: dict[str, float]) -> Any:
        entry = time.perf_counter()
        self._first_tokens(outputs)
        start = time.perf_counter()
        try:
            return (yield)  # every other plugin's specloop_step_finished
        finally:
            end = time.perf_counter()
            if self.steps:
                self._step_line(plan, outputs, timings, hooks=end - start, step_start=entry - timings["total"])
            self._last_step_end = end

    def _first_tokens(self, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            flow = self.flows.get(out.req_id)
            if flow is not None and not flow.first_token and out.new_token_ids:
                self._first_token(flow)

    def _first_token(self, flow: _Flow) -> None:
        flow.first_token = True
        r = flow.request
        ttft = (r.first_token_time or time.monotonic()) - r.arrival_time
        self.emit("request", req=r.request_id, event="first_token", step=self._step_id, ttft_ms=_ms(ttft))

    def _step_line(self, plan: SchedulerOutput, outputs: EngineCoreOutputs, timings: dict[str, float], *,
                   hooks: float, step_start: float) -> None:
        stats = outputs.scheduler_stats
        gap = step_start - self._last_step_end if self._last_step_end is not None else 0.0
        self.emit("step", step=plan.step_id, reqs=plan.num_reqs, tokens=plan.total_num_scheduled_tokens,
                  prompt_tokens=stats.num_prompt_tokens if stats else 0, new=len(plan.scheduled_new_reqs),
                  resumed=len(plan.scheduled_resumed_reqs), preempted=len(plan.preempted_req_ids),
                  finished=sum(o.finished for o in outputs.outputs),
                  running=stats.num_running_reqs if stats else 0, waiting=stats.num_waiting_reqs if stats else 0,
                  kv_usage=round(stats.kv_cache_usage, 4) if stats else 0.0, gap_ms=_ms(max(gap, 0.0)),
                  schedule_ms=_ms(timings["schedule"]), execute_ms=_ms(timings["execute"]),
                  update_ms=_ms(timings["update"]), hooks_ms=_ms(hooks), total_ms=_ms(timings["total"]))


def get_tracer(engine: Any) -> FlowTracer | None:
    """The tracer registered for ``engine`` (an ``EngineCore``), if tracing is on."""
    return engine.plugins.pm.get_plugin(f"{PLUGIN_NAME}-{id(engine):x}")


@hookimpl
def specloop_startup(engine: Any) -> None:
    options = tracing_options(engine.config)
    if options is None:
        return
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)  # asked for explicitly: do not let a WARNING root hide it
    if not logger.hasHandlers():
        logger.addHandler(logging.StreamHandler())
    engine.plugins.pm.register(FlowTracer(steps=bool(options.get("steps", True))),
                               name=f"{PLUGIN_NAME}-{id(engine):x}")
