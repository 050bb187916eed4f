"""What a step leaves pending: outputs whose tokens are still on their way to the host
(asynchronous scheduling), and device timestamps for a timeline."""

from __future__ import annotations

import time
from typing import Callable

import torch

from specloop.kernel.outputs import ModelRunnerOutput

from .batch import InputBatch
from .requests import PLACEHOLDER, CachedRequestState
from .sampling_stage import SampleResult


class DeviceClock:
    """Device timestamps on the host's clock: CUDA events measured from one anchor event whose host
    time is known (recorded on an idle device)."""

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record()
        self.anchor.synchronize()
        self.anchor_time = time.perf_counter()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def time_of(self, event: torch.cuda.Event) -> float:
        event.synchronize()
        return self.anchor_time + self.anchor.elapsed_time(event) / 1e3


class PendingOutput:
    """A step's output whose tokens may still be on their way to the host; ``result()`` waits for
    them once and returns the same :class:`ModelRunnerOutput` on every call. ``overlaps``: whether
    the engine may plan the next step before committing this one (not after a step with drafts)."""

    def __init__(self, wait: Callable[[], ModelRunnerOutput], overlaps: bool = True) -> None:
        self._wait: Callable[[], ModelRunnerOutput] | None = wait
        self._output: ModelRunnerOutput | None = None
        self.overlaps = overlaps

    def result(self) -> ModelRunnerOutput:
        if self._wait is not None:
            wait, self._wait = self._wait, None
            self._output = wait()
        assert self._output is not None
        return self._output


def provisional(requests: dict[str, CachedRequestState], batch: InputBatch, result: SampleResult,
                span: Callable[[], tuple[float, float]] | None) -> PendingOutput:
    """A deferred step's output: one placeholder token per request that sampled, filled in
    ``requests`` when the tokens reach the host."""
    waiting = []
    for i, (_, count) in enumerate(batch.sample_rows):
        if count:
            state = requests[batch.req_ids[i]]
            state.token_ids.append(PLACEHOLDER)
            waiting.append((i, state, len(state.token_ids) - 1))
    req_ids = list(batch.req_ids)

    def wait() -> ModelRunnerOutput:
        sampled = result.wait()
        for i, state, position in waiting:
            if requests.get(state.req_id) is state:  # not finished or preempted meanwhile
                state.token_ids[position] = sampled[i][0]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 device_span=span() if span is not None else None)

    return PendingOutput(wait)
