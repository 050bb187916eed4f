"""A hand-driven stand-in for the scheduler: the test decides what every step computes, and this
builds the matching ``SchedulerOutput`` (blocks, new/cached/resumed request data, drafts) and
commits each result the way the scheduler's ``update_from_output`` does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specloop.kernel.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from specloop.kernel.sampling_params import SamplingParams


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_sent: int = 0  # tokens the runner holds
    new_blocks: list[int] = field(default_factory=list)
    status: str = "new"  # new | running | preempted

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)


class Plans:
    def __init__(self, runner: Any, block_size: int, num_blocks: int) -> None:
        self.runner = runner
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.reqs: dict[str, Req] = {}
        self.step_id = 0
        self._preempted: set[str] = set()
        self._finished: set[str] = set()

    def add(self, rid: str, prompt: list[int], params: SamplingParams | None = None,
            share_prefix_of: str | None = None, num_cached_blocks: int = 0) -> Req:
        """A new request; with ``share_prefix_of`` its first ``num_cached_blocks`` blocks are that
        request's (a prefix-cache hit: their positions are not recomputed)."""
        req = Req(prompt, params or SamplingParams(temperature=0.0, max_tokens=100))
        if share_prefix_of is not None:
            req.blocks = self.reqs[share_prefix_of].blocks[:num_cached_blocks]
            req.num_computed = num_cached_blocks * self.block_size
        self.reqs[rid] = req
        return req

    def preempt(self, rid: str) -> None:
        req = self.reqs[rid]
        self.free.extend(req.blocks)
        req.blocks, req.num_computed, req.status = [], 0, "preempted"
        self._preempted.add(rid)

    def finish(self, rid: str) -> None:
        self._finished.add(rid)
        del self.reqs[rid]

    def plan(self, counts: dict[str, int], spec: dict[str, list[int]] | None = None) -> SchedulerOutput:
        spec = spec or {}
        new, resumed, running = [], [], []
        for rid, n in counts.items():
            req = self.reqs[rid]
            need = -(-(req.num_computed + n) // self.block_size) - len(req.blocks)
            added = [self.free.pop(0) for _ in range(max(need, 0))]
            req.blocks = req.blocks + added
            if req.status in ("new", "preempted"):
                data = NewRequestData(rid, list(req.prompt), req.tokens[len(req.prompt):], req.params,
                                      list(req.blocks), req.num_computed)
                (resumed if req.status == "preempted" else new).append(data)
                req.status = "running"
            else:
                running.append(CachedRequestData(rid, req.tokens[req.num_sent:], added, req.num_computed))
            req.num_sent = len(req.tokens)
        self.step_id += 1
        plan = SchedulerOutput(self.step_id, new, resumed, running, dict(counts), sum(counts.values()),
                               scheduled_spec_decode_tokens={r: list(d) for r, d in spec.items()},
                               finished_req_ids=frozenset(self._finished),
                               preempted_req_ids=frozenset(self._preempted))
        self._finished, self._preempted = set(), set()
        return plan

    def commit(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> None:
        for rid, sampled in zip(result.req_ids, result.sampled_token_ids):
            req = self.reqs[rid]
            drafts = plan.scheduled_spec_decode_tokens.get(rid, [])
            rejected = len(drafts) - (len(sampled) - 1) if sampled and drafts else 0
            req.num_computed += plan.num_scheduled_tokens[rid] - rejected
            req.tokens.extend(sampled)

    def run(self, counts: dict[str, int], spec: dict[str, list[int]] | None = None,
            ) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        plan = self.plan(counts, spec)
        self.runner.execute_model(plan)
        result = self.runner.sample_tokens()
        self.commit(plan, result)
        return plan, result
