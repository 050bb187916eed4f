"""A step timeline you can open: Chrome trace-event JSON for Perfetto (ui.perfetto.dev) or
chrome://tracing.

A built-in plugin like any other, off by default. ``SPECLOOP_TRACE_FILE=/tmp/trace.json`` (or
``plugin_options["timeline"] = {"path": ...}``) turns it on for every engine built afterwards. The
file holds, in microseconds of ``time.perf_counter()``:

* process "engine", track "host": each step's ``schedule``, ``execute`` and ``update`` spans (with
  asynchronous scheduling ``execute`` covers launching the next plan and waiting for this one);
* process "engine", track "device": each step's forward and sampling on the GPU, from CUDA events
  the GPU runner records when asked to (``plugin_options["gpu"]["device_timeline"]``, which this
  plugin sets), so host and device overlap can be read side by side;
* process "requests", one track per request: ``queued`` (arrival to first scheduled), ``prefill``
  (to its first token) and ``decode`` (to its end), and an instant event per preemption.

A ``{pid}`` in the path becomes the process id, so that the engines of several processes (a
server's engine process beside an in-process run) write files of their own. Events are appended as
they happen (the JSON array is closed at shutdown; trace viewers also read an unclosed one), so a
server's timeline can be opened while it runs.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

from specloop.plugins.options import options_of
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from specloop.kernel.request import Request

PLUGIN_NAME = "timeline"
TRACE_FILE_ENV = "SPECLOOP_TRACE_FILE"
ENGINE_PID, REQUESTS_PID = 1, 2
HOST_TID, DEVICE_TID = 1, 2


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


class Timeline:
    """One engine's trace file."""

    def __init__(self, path: str) -> None:
        self.path = path = path.replace("{pid}", str(os.getpid()))  # one file per process
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._first = True
        self._tids: dict[str, int] = {}
        self._arrival: dict[str, float] = {}  # request id -> perf_counter() of its arrival
        self._started: dict[str, tuple[str, float]] = {}  # request id -> (phase, start)
        self._write({"ph": "M", "name": "process_name", "pid": ENGINE_PID, "args": {"name": "engine"}})
        self._write({"ph": "M", "name": "process_name", "pid": REQUESTS_PID, "args": {"name": "requests"}})
        for tid, name in ((HOST_TID, "host"), (DEVICE_TID, "device")):
            self._write({"ph": "M", "name": "thread_name", "pid": ENGINE_PID, "tid": tid, "args": {"name": name}})

    def _write(self, event: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(("" if self._first else ",\n") + json.dumps(event))
        self._first = False

    def span(self, name: str, pid: int, tid: int, start: float, end: float, **args: Any) -> None:
        self._write({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": _us(start),
                     "dur": _us(max(end - start, 0.0)), "args": args})

    # --- requests ----------------------------------------------------------------------------------

    def _tid(self, req_id: str) -> int:
        if req_id not in self._tids:
            self._tids[req_id] = len(self._tids) + 1
            self._write({"ph": "M", "name": "thread_name", "pid": REQUESTS_PID, "tid": self._tids[req_id],
                         "args": {"name": req_id}})
        return self._tids[req_id]

    def _phase(self, req_id: str, phase: str | None, now: float) -> None:
        """End the request's current phase at ``now`` and start ``phase`` (None: it ended)."""
        if req_id in self._started:
            name, start = self._started.pop(req_id)
            self.span(name, REQUESTS_PID, self._tid(req_id), start, now)
        if phase is not None:
            self._started[req_id] = (phase, now)

    @hookimpl
    def specloop_request_added(self, requests: list[Request]) -> None:
        now_perf, now_mono = time.perf_counter(), time.monotonic()
        for r in requests:
            arrival = now_perf - (now_mono - r.arrival_time)
            self._arrival[r.request_id] = arrival
            self._tid(r.request_id)
            self._started[r.request_id] = ("queued", arrival)

    @hookimpl
    def specloop_step_scheduled(self, plan: SchedulerOutput) -> None:
        now = time.perf_counter()
        for new in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
            if self._started.get(new.req_id, ("",))[0] in ("queued", "preempted"):
                self._phase(new.req_id, "prefill", now)

    @hookimpl
    def specloop_request_preempted(self, requests: list[Request]) -> None:
        now = time.perf_counter()
        for r in requests:
            self._phase(r.request_id, "preempted", now)
            self._write({"ph": "i", "s": "t", "name": "preempted", "pid": REQUESTS_PID,
                         "tid": self._tid(r.request_id), "ts": _us(now)})

    @hookimpl
    def specloop_request_finished(self, requests: list[Request]) -> None:
        now = time.perf_counter()
        for r in requests:
            self._phase(r.request_id, None, now)
            self._arrival.pop(r.request_id, None)

    # --- steps -------------------------------------------------------------------------------------

    @hookimpl
    def specloop_step_finished(self, plan: SchedulerOutput, result: ModelRunnerOutput, outputs: EngineCoreOutputs,
                               timings: dict[str, float]) -> None:
        end = time.perf_counter()
        update_start = end - timings["update"]
        execute_start = update_start - timings["execute"]
        step_start = execute_start - timings["schedule"]
        step = {"step": plan.step_id, "reqs": plan.num_reqs, "tokens": plan.total_num_scheduled_tokens}
        self.span("schedule", ENGINE_PID, HOST_TID, step_start, execute_start, **step)
        self.span("execute", ENGINE_PID, HOST_TID, execute_start, update_start, **step)
        self.span("update", ENGINE_PID, HOST_TID, update_start, end, **step)
        if result.device_span is not None:
            self.span("forward+sample", ENGINE_PID, DEVICE_TID, *result.device_span, **step)
        for out in outputs.outputs:
            if out.new_token_ids and self._started.get(out.req_id, ("",))[0] == "prefill":
                self._phase(out.req_id, "decode", end)

    @hookimpl
    def specloop_shutdown(self) -> None:
        if self._file is not None:
            self._file.write("\n]\n")
            self._file.close()
            self._file = None


def timeline_path(config: Any) -> str | None:
    options = options_of(config, PLUGIN_NAME, ("path",))
    if options.get("path"):
        return str(options["path"])
    return os.environ.get(TRACE_FILE_ENV) or None


@hookimpl
def specloop_configure(config: Any) -> None:
    if timeline_path(config) is not None:
        gpu = config.plugin_options.setdefault("gpu", {})
        gpu.setdefault("device_timeline", True)


@hookimpl
def specloop_startup(engine: Any) -> None:
    path = timeline_path(engine.config)
    if path is not None:
        engine.plugins.pm.register(Timeline(path), name=f"{PLUGIN_NAME}-{id(engine):x}")
