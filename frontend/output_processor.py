"""From the core's ``EngineCoreOutput``s back to client semantics: incremental text, stop strings,
logprobs with decoded tokens, metrics, and the aggregation of ``n`` child requests into one
``RequestOutput``. Also the engine-wide counters behind ``get_metrics()``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

from specloop.kernel.outputs import EngineCoreOutput, SchedulerStats, SpecDecodingStats, TokenLogprobs
from specloop.kernel.request import FinishReason, Request
from specloop.kernel.sampling_params import SamplingParams

from .detokenizer import IncrementalDetokenizer, NullDetokenizer
from .request_output import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from .stop_strings import StopStrings
from .tokenizer import Tokenizer


def _wall_time(monotonic_t: float | None) -> float | None:
    # The core stamps time.monotonic(); the API reports time.time() like vLLM.
    return None if monotonic_t is None else time.time() - (time.monotonic() - monotonic_t)


class CompletionTracker:
    """One completion (one core request) of a parent request.

    :param stops: the automaton over the request's stop strings, shared by its completions.
    """

    def __init__(self, index: int, request: Request, tokenizer: Tokenizer | None,
                 stops: StopStrings | None = None) -> None:
        self.index = index
        self.request = request
        self.params: SamplingParams = request.sampling_params
        self.tokenizer = tokenizer
        self.detokenizer: IncrementalDetokenizer | NullDetokenizer = (
            IncrementalDetokenizer(tokenizer, request.prompt_token_ids, self.params, stops) if tokenizer is not None
            else NullDetokenizer())
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if self.params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if self.params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # What the previous delta-mode yield already carried.
        self._sent_tokens = 0
        self._sent_finished = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, out: EngineCoreOutput) -> bool:
        """Fold one step's output in. Returns True when a stop string ended the completion here while
        the core still runs it (the caller aborts it in the core)."""
        if self.finished:
            return False  # late output after a stop string: dropped
        new = out.new_token_ids
        stop_terminated = out.finish_reason == FinishReason.STOP and not isinstance(out.stop_reason, str)
        consumed = self.detokenizer.update(new, stop_terminated)
        if consumed is not None:
            new = new[:consumed]
        self.token_ids.extend(new)
        if self.logprobs is not None and out.new_logprobs:
            for entry in out.new_logprobs[:len(new)]:
                self.logprobs.append(logprob_dict(entry, self.tokenizer))
                self.cumulative_logprob = (self.cumulative_logprob or 0.0) + entry.logprob
        if consumed is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP.value, self.detokenizer.stop_reason
            self.detokenizer.finish()
            return not out.finished
        if out.finished:
            self.detokenizer.finish()
            self.finish_reason = FinishReason(out.finish_reason).value
            self.stop_reason = out.stop_reason
            if self.detokenizer.stop_reason is not None:  # matched in the text held back until the end
                self.finish_reason, self.stop_reason = FinishReason.STOP.value, self.detokenizer.stop_reason
        return False

    def to_output(self, delta: bool) -> CompletionOutput | None:
        """The completion so far (cumulative) or what is new since the last call (delta; None if
        nothing is)."""
        if not delta:
            return CompletionOutput(self.index, self.detokenizer.text, list(self.token_ids), self.cumulative_logprob,
                                    list(self.logprobs) if self.logprobs is not None else None,
                                    self.finish_reason, self.stop_reason)
        text = self.detokenizer.take_delta()
        start = self._sent_tokens
        if not text and start == len(self.token_ids) and (self._sent_finished or not self.finished):
            return None
        self._sent_tokens = len(self.token_ids)
        self._sent_finished = self.finished
        return CompletionOutput(self.index, text, self.token_ids[start:], self.cumulative_logprob,
                                self.logprobs[start:] if self.logprobs is not None else None,
                                self.finish_reason, self.stop_reason)


def logprob_dict(entry: TokenLogprobs, tokenizer: Tokenizer | None) -> dict[int, Logprob]:
    """vLLM's per-position form: the chosen token first, then the top-k alternatives."""
    def text(tid: int) -> str | None:
        return tokenizer.token_text(tid) if tokenizer is not None else None

    out = {entry.token_id: Logprob(entry.logprob, entry.rank, text(entry.token_id))}
    for rank, (tid, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
        if tid not in out:
            out[tid] = Logprob(lp, rank, text(tid))
    return out


class RequestTracker:
    """A request as the caller sees it: its ``n`` completions, prompt logprobs and metrics.

    :param requests: the core requests of this parent, in completion order (one when ``n == 1``).
    """

    def __init__(self, request_id: str, prompt: str | None, requests: list[Request],
                 tokenizer: Tokenizer | None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = requests[0].prompt_token_ids
        self.requests = requests
        stop = requests[0].sampling_params.stop
        stops = StopStrings(stop) if stop and tokenizer is not None else None
        self.completions = {r.request_id: CompletionTracker(i, r, tokenizer, stops) for i, r in enumerate(requests)}
        self.tokenizer = tokenizer
        wants_prompt_logprobs = requests[0].sampling_params.prompt_logprobs is not None
        self.prompt_logprobs: PromptLogprobs | None = [] if wants_prompt_logprobs else None
        self._sent_prompt_logprobs = 0
        self.metrics = RequestMetrics(arrival_time=_wall_time(requests[0].arrival_time) or time.time())
        self.num_cached_tokens = 0
        self.error: str | None = None

    @property
    def child_ids(self) -> list[str]:
        return list(self.completions)

    @property
    def finished(self) -> bool:
        completions = self.completions
        if len(completions) == 1:  # n = 1: no generator for every output of every step
            return next(iter(completions.values())).finish_reason is not None
        return all(c.finished for c in completions.values())

    def unfinished_ids(self) -> list[str]:
        return [rid for rid, c in self.completions.items() if not c.finished]

    def process(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Fold outputs (of any of this request's completions) in. Returns the core request ids a
        stop string ended, which the caller must abort in the core."""
        to_abort = []
        now = time.time()
        for out in outputs:
            completion = self.completions.get(out.req_id)
            if completion is None or completion.finished:
                continue
            if out.error is not None:
                self.error = out.error
            if out.new_prompt_logprobs and self.prompt_logprobs is not None and completion.index == 0:
                self.prompt_logprobs.extend(None if e is None else logprob_dict(e, self.tokenizer)
                                            for e in out.new_prompt_logprobs)
            if completion.index == 0:
                self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
            self.metrics.spec_num_draft_tokens += out.num_draft_tokens
            self.metrics.spec_num_accepted_tokens += out.num_accepted_tokens
            if out.new_token_ids:
                if self.metrics.first_token_time is None:
                    self.metrics.first_token_time = now
                self.metrics.last_token_time = now
            if completion.process(out):
                to_abort.append(out.req_id)
        if self.metrics.first_scheduled_time is None:
            scheduled = [r.scheduled_time for r in self.requests if r.scheduled_time is not None]
            if scheduled:
                self.metrics.first_scheduled_time = _wall_time(min(scheduled))
        self.metrics.num_cached_tokens = self.num_cached_tokens
        if self.finished and self.metrics.finished_time is None:
            self.metrics.finished_time = now
        return to_abort

    def abort(self) -> None:
        """Mark every unfinished completion aborted (the caller aborts them in the core)."""
        for c in self.completions.values():
            if not c.finished:
                c.detokenizer.finish()
                c.finish_reason = FinishReason.ABORT.value

    def output(self) -> RequestOutput:
        """Everything so far: every completion, all prompt logprobs."""
        return self._request_output([c.to_output(delta=False) for c in self.completions.values()],
                                    self.prompt_logprobs)

    def delta_output(self) -> RequestOutput | None:
        """What is new since the previous call: only completions with something new, and only prompt
        logprobs not sent before (None when there are none). None when nothing is new."""
        outputs = [c for c in (c.to_output(delta=True) for c in self.completions.values()) if c is not None]
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs[self._sent_prompt_logprobs:] or None
            self._sent_prompt_logprobs = len(self.prompt_logprobs)
        if not outputs and not prompt_logprobs:
            return None
        return self._request_output(outputs, prompt_logprobs)

    def _request_output(self, outputs: list[CompletionOutput | None], prompt_logprobs: PromptLogprobs | None
                        ) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [o for o in outputs if o is not None], finished=self.finished,
                             prompt_logprobs=prompt_logprobs, metrics=self.metrics,
                             num_cached_tokens=self.num_cached_tokens, error=self.error)


@dataclass(slots=True)
class EngineStats:
    """Engine-wide counters. Scheduler fields come from each step's ``SchedulerStats``; request
    counts from the frontend as requests are added and finish."""

    num_requests_added: int = 0
    num_requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_cache_usage: float = 0.0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    num_steps: int = 0

    def record_step(self, stats: SchedulerStats | None) -> None:
        if stats is None:
            return
        self.num_steps += 1
        self.num_prompt_tokens += stats.num_prompt_tokens
        self.num_generation_tokens += stats.num_generation_tokens
        self.num_preemptions += stats.num_preemptions
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.kv_cache_usage = stats.kv_cache_usage
        self.num_running_reqs = stats.num_running_reqs
        self.num_waiting_reqs = stats.num_waiting_reqs
        self.spec_decoding.merge(stats.spec_decoding)

    def record_finished(self, state: RequestTracker) -> None:
        for c in state.completions.values():
            reason = c.finish_reason or FinishReason.ABORT.value
            self.num_requests_finished[reason] = self.num_requests_finished.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        """What ``get_metrics()`` returns: every counter by name, speculative decoding under ``spec_*``."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "spec_decoding"}
        d["num_requests_finished"] = dict(self.num_requests_finished)
        d["prefix_cache_hit_rate"] = self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        spec = self.spec_decoding
        d["spec_num_drafts"] = spec.num_drafts
        d["spec_num_draft_tokens"] = spec.num_draft_tokens
        d["spec_num_accepted_tokens"] = spec.num_accepted_tokens
        d["spec_num_accepted_tokens_per_pos"] = list(spec.accepted_per_position)
        d["spec_acceptance_rate"] = spec.acceptance_rate
        d["spec_mean_acceptance_length"] = spec.mean_acceptance_length
        return d
