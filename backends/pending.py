"""What a step leaves pending: outputs whose tokens are still on their way to the host
(asynchronous scheduling), and device timestamps for a timeline.

Two kinds of step are read a step late. A plain decode step (:func:`provisional`) samples one token
a request, which the device writes into the next step's inputs itself. A uniform greedy
verification whose next proposal was launched from the device (:func:`read_later`) samples an
unknown number: the device holds each request's next token and drafts, and the count of drafts it
rejected, so the engine plans the next step as if every draft were accepted; the device pulls that
step's requests back by the rejected count while preparing its inputs, and the runner does the same
to its host-side layout once it reads the outcome (:func:`rebase`)."""

from __future__ import annotations

import time
from typing import Callable

import torch

from specloop.kernel.outputs import ModelRunnerOutput

from .batch import InputBatch
from .parts import BatchBuilder
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


def read_later(requests: dict[str, CachedRequestState], builder: BatchBuilder, batch: InputBatch, result: SampleResult,
               lagging: dict[str, int | None], span: Callable[[], tuple[float, float]] | None,
               after_read: Callable[[list[list[int]]], None]) -> PendingOutput:
    """A verification read a step late (module docstring). Until it is read each request's tokens
    end in one placeholder per row the step computed (the device holds them all: ``builder``'s
    ``mark_on_device``); reading replaces them with the tokens it accepted, records in ``lagging``
    the drafts each request rejected, and calls ``after_read`` with the tokens."""
    waiting = []
    for i, (_, count) in enumerate(batch.sample_rows):
        state = requests[batch.req_ids[i]]
        base = len(state.token_ids)
        state.token_ids.extend([PLACEHOLDER] * count)
        builder.mark_on_device(state.req_id, base + count)
        waiting.append((i, state, base, count))
    req_ids = list(batch.req_ids)

    def wait() -> ModelRunnerOutput:
        sampled = result.wait()
        for i, state, base, count in waiting:
            tokens = sampled[i]
            lagging[state.req_id] = count - len(tokens)
            if requests.get(state.req_id) is state:  # not finished or preempted meanwhile
                if len(state.token_ids) != base + count:
                    raise RuntimeError(f"request {state.req_id!r}: tokens appended past an unread verification")
                state.token_ids[base:] = tokens
                builder.mark_on_device(state.req_id, base + len(tokens))
        after_read(sampled)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 device_span=span() if span is not None else None)

    return PendingOutput(wait)


def rebase(batch: InputBatch, requests: dict[str, CachedRequestState], lagging: dict[str, int | None]) -> None:
    """Once the last verification read late has been read: its requests' rows in ``batch`` (planned
    before, as if they accepted every draft) start where the drafts they accepted end, as the
    device already pulled them back."""
    lay = batch.layout
    for i in batch.lagged:
        state = requests[lay.req_ids[i]]
        back = lagging[state.req_id]
        lay.starts[i] -= back
        lay.seq_lens[i] -= back
        state.num_computed_tokens = lay.starts[i]
