"""A plugin written as a third party would: it imports only specloop's public kernel API and
replaces the scheduler and the KV-cache policy by name.

``serial`` runs one request at a time, its whole prompt in one step, without drafts or
preemption. ``stack`` hands out the most recently freed block first and caches nothing. Both are
written from scratch against :mod:`specloop.kernel.protocols`, which is all a component needs.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from specloop.kernel import (CachedRequestData, EngineConfig, EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput,
                             NewRequestData, Request, RequestStatus, SchedulerOutput, SchedulerStats, hookimpl)
from specloop.kernel.outputs import DraftTokenIds
from specloop.kernel.protocols import KVCacheManager


class SerialScheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.current: Request | None = None
        self.finished: set[str] = set()
        self.step_id = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        done = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request is self.current:
                self.current = None
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            done.append(request)
        return done

    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        new, running, num = [], [], {}
        if self.current is None and self.waiting:
            request = self.waiting[0]
            if self.kv_cache.allocate_slots(request, request.num_tokens) is not None:
                self.waiting.popleft()
                self.current = request
                request.status = RequestStatus.RUNNING
                new.append(NewRequestData(request.request_id, list(request.prompt_token_ids), [],
                                          request.sampling_params,
                                          self.kv_cache.get_block_ids(request.request_id), 0))
                num[request.request_id] = request.num_tokens
        elif self.current is not None:
            request = self.current
            blocks = self.kv_cache.allocate_slots(request, 1)
            assert blocks is not None, "a lone request always fits"
            running.append(CachedRequestData(request.request_id, request.all_token_ids[request.num_tokens_sent:],
                                             blocks, request.num_computed_tokens))
            num[request.request_id] = 1
        if self.current is not None and num:
            self.current.num_tokens_sent = self.current.num_tokens
            self.current.num_computed_tokens += num[self.current.request_id]
        plan = SchedulerOutput(self.step_id, new, [], running, num, sum(num.values()),
                               finished_req_ids=frozenset(self.finished))
        self.finished = set()
        return plan

    def update_from_output(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs = []
        for rid, sampled in zip(result.req_ids, result.sampled_token_ids):
            request = self.current
            if request is None or request.request_id != rid or not sampled:
                continue
            token = sampled[0]
            request.append_output_token_ids(token)
            params = request.sampling_params
            if not params.ignore_eos and token in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
            elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
                request.status = RequestStatus.FINISHED_LENGTH
            outputs.append(EngineCoreOutput(rid, [token], finish_reason=request.finish_reason))
            if request.is_finished:
                self.kv_cache.cache_blocks(request, request.num_computed_tokens)
                self.current = None
                self._release(request)
        return EngineCoreOutputs(outputs, self.make_stats())

    def _release(self, request: Request) -> None:
        self.kv_cache.free(request)
        self.finished.add(request.request_id)
        del self.requests[request.request_id]

    def update_draft_token_ids(self, drafts: DraftTokenIds) -> None:
        pass  # no speculation here: proposals are ignored

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=int(self.current is not None), num_waiting_reqs=len(self.waiting),
                              kv_cache_usage=self.kv_cache.usage)


class StackKVCache:
    """Block 0 is left unused like the built-in pool's null block; freed blocks are reused first."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, 0, -1))
        self.tables: dict[str, list[int]] = {}
        self.num_allocations = 0

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        table = self.tables.get(request.request_id, [])
        needed = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        n = max(-(-needed // self.block_size) - len(table), 0)
        if n > len(self.free_ids):
            return None
        new = [self.free_ids.pop() for _ in range(n)]
        self.tables[request.request_id] = table + new
        self.num_allocations += 1
        return new

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        pass

    def free(self, request: Request) -> None:
        self.free_ids.extend(self.tables.pop(request.request_id, []))

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self.tables.get(request_id, []))

    @property
    def usage(self) -> float:
        return 1 - len(self.free_ids) / (self.num_blocks - 1)

    def reset_prefix_cache(self) -> bool:
        return True

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        return 0, 0


@hookimpl
def specloop_register_schedulers(register) -> None:
    register("serial", SerialScheduler)


@hookimpl
def specloop_register_kv_cache_policies(register) -> None:
    register("stack", StackKVCache)
