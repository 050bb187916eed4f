"""The built-in schedulers: one token-debt scheduler with two queue policies.

Every step pays down each request's debt ``num_tokens_with_spec - num_computed_tokens`` within the
token budget, running requests first, then waiting ones. There are no prefill/decode phases: a
prompt, a prompt chunk, a prefix-cache hit, a decode and a draft verification are all debts of
different sizes. ``fcfs`` serves waiting requests in arrival order and preempts the most recently
admitted; ``priority`` orders by ``(priority, arrival_time)`` and preempts the lowest priority.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Iterable

from specloop.kernel.config import EngineConfig
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.outputs import (CachedRequestData, DraftTokenIds, EngineCoreOutput, EngineCoreOutputs,
                                     ModelRunnerOutput, NewRequestData, SchedulerOutput, SchedulerStats)
from specloop.kernel.protocols import KVCacheManager
from specloop.kernel.request import Request, RequestStatus


class FCFSScheduler:
    """Implements :class:`specloop.kernel.protocols.Scheduler`. Subclasses change the queue policy
    by overriding ``enqueue``, ``requeue_preempted``, ``peek_waiting`` (the next request to admit)
    and ``select_victim`` (the running request to preempt)."""

    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager) -> None:
        if config.max_model_len is None or config.max_num_batched_tokens is None:
            raise ValueError("the scheduler needs a resolved config (call EngineConfig.resolve first)")
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.chunked_prefill = config.enable_chunked_prefill
        # Without chunking a prompt must go in whole, so the per-request cap would only starve it.
        self.long_prefill_threshold = config.long_prefill_token_threshold if config.enable_chunked_prefill else 0
        self.num_lookahead_tokens = config.num_lookahead_tokens
        # One sequence of max_model_len must fit alone, or a lone request could be preempted forever.
        needed = -(-config.max_model_len // kv_cache.block_size)
        if needed > kv_cache.num_blocks - 1:
            raise ValueError(f"the KV cache ({kv_cache.num_blocks - 1} usable blocks of {kv_cache.block_size} "
                             f"tokens) cannot hold one max_model_len={config.max_model_len} sequence "
                             f"({needed} blocks); lower max_model_len or give the cache more blocks")

        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.waiting: deque[Request] | list[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.step_id = 0
        # Ids the runner must drop, reported in the next plan.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        # Requests of each plan not yet committed, so late output finds the object it was made for,
        # and the placeholders the plan counted for each.
        self._in_flight: dict[int, dict[str, tuple[Request, int]]] = {}
        self._prompt_tokens: dict[int, int] = {}
        self._num_preemptions = 0

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def requeue_preempted(self, request: Request) -> None:
        self.waiting.appendleft(request)  # type: ignore[union-attr]

    def peek_waiting(self) -> Request:
        return self.waiting[0]

    def select_victim(self) -> Request:
        return self.running[-1]

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if request.num_tokens > self.max_model_len:
            raise ValueError(f"request {rid!r}: the prompt has {request.num_tokens} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.enqueue(request)

    def finish_requests(self, request_ids: Iterable[str] | str, status: RequestStatus) -> list[Request]:
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        admitted: list[Request] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            lookahead = self._lookahead(request, num_new)
            while (blocks := self.kv_cache.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)) is None:
                victim = self.select_victim()
                index = self.running.index(victim)
                if victim.request_id in num_scheduled:  # scheduled earlier this step: take it back
                    budget += num_scheduled.pop(victim.request_id)
                    del new_block_ids[victim.request_id]
                    scheduled_running.remove(victim)
                self.running.pop(index)
                self._preempt(victim)
                preempted = True
                if index < i:
                    i -= 1
                if victim is request:
                    break
            if blocks is None:
                continue  # the request itself was preempted; running[i] is now the next one
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = blocks
            scheduled_running.append(request)
            budget -= num_new
            i += 1

        # Admitting while preempting would only churn: the blocks just freed go to the preempted.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.peek_waiting()
            hit_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if self.chunked_prefill:
                if 0 < self.long_prefill_threshold < num_new:
                    num_new = self.long_prefill_threshold
                num_new = min(num_new, budget)
            elif num_new > budget:
                break  # the whole prompt waits for a step with room for it
            lookahead = self.num_lookahead_tokens if num_hit + num_new >= request.num_tokens else 0
            if self.kv_cache.allocate_slots(request, num_new, num_hit, hit_blocks, lookahead) is None:
                break
            self.waiting.remove(request)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            admitted.append(request)
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        return self._build_plan(num_scheduled, new_block_ids, scheduled_running, admitted)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """This step's share of a running request's debt. Tokens a launched step will sample
        (placeholders) count as known: the next step computes them on the device."""
        pending = request.num_output_placeholders
        if pending and (request.num_output_tokens + pending >= request.max_tokens
                        or request.num_tokens + pending >= self.max_model_len):
            return 0  # the launched step already samples its last token
        num_new = request.num_tokens + pending - request.num_computed_tokens
        if num_new == 1 and request.spec_token_ids:
            # Drafts only ride on a decode (never inside a prefill chunk), and only as many as can
            # be committed without passing max_model_len.
            num_new += min(len(request.spec_token_ids), max(self.max_model_len - 1 - request.num_tokens - pending, 0))
        if 0 < self.long_prefill_threshold < num_new:
            num_new = self.long_prefill_threshold
        return min(num_new, budget)

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Draft slots are only needed when this step samples, i.e. reaches the last known token."""
        reaches_end = request.num_computed_tokens + num_new >= request.num_tokens + request.num_output_placeholders
        return self.num_lookahead_tokens if reaches_end else 0

    def _build_plan(self, num_scheduled: dict[str, int], new_block_ids: dict[str, list[int]],
                    scheduled_running: list[Request], admitted: list[Request]) -> SchedulerOutput:
        running_data, spec_tokens = [], {}
        for request in scheduled_running:
            rid = request.request_id
            num_spec = (request.num_computed_tokens + num_scheduled[rid] - request.num_tokens
                        - request.num_output_placeholders)
            if num_spec > 0:
                spec_tokens[rid] = request.spec_token_ids[:num_spec]
            running_data.append(CachedRequestData(rid, request.all_token_ids[request.num_tokens_sent:],
                                                  new_block_ids[rid], request.num_computed_tokens))
            request.num_tokens_sent = request.num_tokens
        new_data, resumed_data = [], []
        for request in admitted:
            data = NewRequestData(request.request_id, list(request.prompt_token_ids),
                                  list(request.output_token_ids), request.sampling_params,
                                  self.kv_cache.get_block_ids(request.request_id), request.num_computed_tokens,
                                  tuple(request.eos_token_ids))
            (resumed_data if request.status == RequestStatus.PREEMPTED else new_data).append(data)
            request.status = RequestStatus.RUNNING
            request.num_tokens_sent = request.num_tokens

        now = time.monotonic()
        num_prompt_tokens = 0
        samples: dict[str, tuple[Request, int]] = {}
        for request in (*scheduled_running, *admitted):
            rid = request.request_id
            n = num_scheduled[rid]
            start = request.num_computed_tokens
            num_prompt_tokens += max(min(start + n, request.num_prompt_tokens) - start, 0)
            # Reaching the end of the known tokens, the step samples one, and one more per draft it
            # verifies: until they are committed they are placeholders the next plan may already
            # build on, as if every draft were accepted (the runner pulls it back by the rest).
            sampling = start + n >= request.num_tokens + request.num_output_placeholders
            placeholders = sampling * (1 + len(spec_tokens.get(rid, ())))
            request.num_output_placeholders += placeholders
            samples[rid] = (request, placeholders)
            # Optimistic: every planned position counts as computed, drafts included, so the plan
            # alone says what the runner will hold after this step; update_from_output rolls back
            # the drafts the target rejects.
            request.num_computed_tokens = start + n
            request.spec_token_ids = []
            if request.scheduled_time is None:
                request.scheduled_time = now

        plan = SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=new_data,
            scheduled_resumed_reqs=resumed_data,
            scheduled_running_reqs=running_data,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=frozenset(self.finished_req_ids),
            preempted_req_ids=frozenset(self.preempted_req_ids),
        )
        self.finished_req_ids.clear()
        self.preempted_req_ids.clear()
        if num_scheduled:
            self._in_flight[self.step_id] = samples
            self._prompt_tokens[self.step_id] = num_prompt_tokens
        return plan

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the blocks, start over from the prefix cache."""
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.preempted_req_ids.add(request.request_id)
        self.requeue_preempted(request)

    def update_from_output(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        scheduled = self._in_flight.pop(plan.step_id, {})
        stats = SchedulerStats(num_prompt_tokens=self._prompt_tokens.pop(plan.step_id, 0))
        outputs = []
        # Hoisted out of the loop over requests (it runs for every request of every step).
        spec_tokens = plan.scheduled_spec_decode_tokens
        logprobs_all, prompt_logprobs_all = result.logprobs, result.prompt_logprobs
        cache_blocks, running = self.kv_cache.cache_blocks, RequestStatus.RUNNING
        num_generated = 0
        for i, (rid, sampled) in enumerate(zip(result.req_ids, result.sampled_token_ids, strict=True)):
            request, placeholders = scheduled.get(rid, (None, 0))
            if request is None or request.status != running:
                continue  # aborted (or preempted) while the step ran: drop its output (invariant 9)
            request.num_output_placeholders -= placeholders
            num_draft = len(spec_tokens[rid]) if spec_tokens and rid in spec_tokens else 0
            num_accepted = 0
            if num_draft:
                # The runner returns the accepted drafts followed by the target's own token.
                num_accepted = max(len(sampled) - 1, 0)
                request.num_computed_tokens -= num_draft - num_accepted
                request.num_draft_tokens += num_draft
                request.num_accepted_tokens += num_accepted
                stats.spec_decoding.observe(num_draft, num_accepted)
            cache_blocks(request, request.num_computed_tokens)
            kept = self._append_and_check_stop(request, sampled) if sampled else []
            num_generated += len(kept)
            prompt_logprobs = prompt_logprobs_all.get(rid) if prompt_logprobs_all else None
            if kept and request.first_token_time is None:
                request.first_token_time = time.monotonic()
            finished = request.status.finished
            if kept or finished or prompt_logprobs:
                logprobs = logprobs_all[i] if logprobs_all is not None else None
                outputs.append(EngineCoreOutput(
                    req_id=rid, new_token_ids=kept,
                    new_logprobs=logprobs[:len(kept)] if logprobs is not None else None,
                    new_prompt_logprobs=prompt_logprobs, finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason, num_cached_tokens=max(request.num_cached_tokens, 0),
                    num_draft_tokens=num_draft, num_accepted_tokens=num_accepted))
            if finished:
                self.running.remove(request)
                self._release(request)
        stats.num_generation_tokens = num_generated
        self._fill_stats(stats)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats)

    def _append_and_check_stop(self, request: Request, sampled: list[int]) -> list[int]:
        """Commit sampled tokens one by one; a stop truncates exactly there, dropping the rest.

        A stop: EOS (unless ``ignore_eos``) or a stop token id, both held back until ``min_tokens``
        outputs, or the length limits (``max_tokens``, ``max_model_len``), which ``min_tokens``
        never holds back. (Inline, without the request's properties: it runs for every token.)"""
        params = request.sampling_params
        output, all_ids = request.output_token_ids, request.all_token_ids
        max_tokens = params.max_tokens if params.max_tokens is not None else 1 << 62
        eos = () if params.ignore_eos else request.eos_token_ids
        stop_ids = params.stop_token_ids
        for n, token in enumerate(sampled, 1):
            output.append(token)
            all_ids.append(token)
            num_output = len(output)
            if num_output >= params.min_tokens:
                if token in eos:
                    request.status = RequestStatus.FINISHED_STOPPED
                    return sampled[:n]
                if stop_ids and token in stop_ids:
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = token
                    return sampled[:n]
            if num_output >= max_tokens or len(all_ids) >= self.max_model_len:
                request.status = RequestStatus.FINISHED_LENGTH
                return sampled[:n]
        return list(sampled)

    def _release(self, request: Request) -> None:
        self.kv_cache.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def update_draft_token_ids(self, drafts: DraftTokenIds) -> None:
        for rid, token_ids in zip(drafts.req_ids, drafts.draft_token_ids):
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            # Still inside its prefill: there is no verified last token for drafts to extend.
            in_prefill = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens > 1
            request.spec_token_ids = [] if in_prefill else list(token_ids)

    def make_stats(self) -> SchedulerStats:
        stats = SchedulerStats()
        self._fill_stats(stats)
        return stats

    def _fill_stats(self, stats: SchedulerStats) -> None:
        stats.num_running_reqs = len(self.running)
        stats.num_waiting_reqs = len(self.waiting)
        stats.kv_cache_usage = self.kv_cache.usage
        stats.prefix_cache_queries, stats.prefix_cache_hits = self.kv_cache.take_prefix_cache_stats()
        stats.num_preemptions, self._num_preemptions = self._num_preemptions, 0


class PriorityScheduler(FCFSScheduler):
    """Waiting requests ordered by ``(priority, arrival_time)`` (lower first); the victim is the
    running request with the lowest priority, the latest arrival among equals, the latest admitted
    among those."""

    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager) -> None:
        super().__init__(config, kv_cache)
        self.waiting = []

    @staticmethod
    def _key(request: Request) -> tuple[int, float]:
        return request.priority, request.arrival_time

    def enqueue(self, request: Request) -> None:
        bisect.insort_right(self.waiting, request, key=self._key)  # type: ignore[arg-type]

    def requeue_preempted(self, request: Request) -> None:
        self.enqueue(request)

    def select_victim(self) -> Request:
        # Among equals (the n completions of one request share priority and arrival) the one
        # admitted last: preempting the one furthest along had equals preempt each other forever.
        return max(reversed(self.running), key=self._key)


@hookimpl
def specloop_register_schedulers(register) -> None:
    register("fcfs", FCFSScheduler)
    register("priority", PriorityScheduler)
