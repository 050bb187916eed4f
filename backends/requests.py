"""The model runner's copy of each request, kept in step with the scheduler's plans.

The scheduler owns a request's truth (``specloop.kernel.request.Request``); the runner keeps only
what it needs to build inputs and sample, created from a plan's ``NewRequestData`` (first admission,
or resumption after preemption) and updated from ``CachedRequestData`` (what changed since the last
step).

The one thing the runner adds itself is a *provisional tail*: the tokens it sampled that the
scheduler has not committed yet. With asynchronous scheduling the next step is planned and launched
before the previous one's tokens are committed, so the runner must already know (or, on the device,
hold) the token it sampled there. A provisional token whose value has not reached the host yet is
``PLACEHOLDER``. The plan's committed tokens always confirm the tail (the scheduler commits exactly
what was sampled, or finishes the request).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from specloop.kernel.outputs import SchedulerOutput
from specloop.kernel.sampling_params import SamplingParams
from specloop.sampling.sampler import seed_to_int64

PLACEHOLDER = -1  # a provisional token whose value is still on the device


@dataclass(slots=True)
class CachedRequestState:
    """One request as the runner holds it."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + committed output + the provisional tail
    num_committed: int  # how many of token_ids the scheduler has committed
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # first position computed in the current step
    seed: int  # effective sampling seed, as int64 bits
    eos_token_ids: tuple[int, ...] = ()  # the request's EOS ids (min_tokens bans them)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    def commit(self, new_token_ids: list[int]) -> None:
        """The scheduler committed ``new_token_ids``: they confirm the head of the provisional tail."""
        c, n = self.num_committed, len(new_token_ids)
        tail = self.token_ids[c:c + n]
        if any(t != u and t != PLACEHOLDER for t, u in zip(tail, new_token_ids)):
            raise RuntimeError(f"request {self.req_id!r}: committed tokens {new_token_ids} differ from the "
                               f"ones sampled {tail}")
        self.token_ids[c:c + n] = new_token_ids
        self.num_committed = c + n


@dataclass(slots=True)
class PlanChanges:
    """What :func:`apply_plan` changed, for the runner's parts that mirror request state."""

    removed: frozenset[str]  # finished or preempted: their state is gone
    finished: frozenset[str]
    added: list[CachedRequestState]  # new or resumed
    updated: list[CachedRequestState]  # running, after appending the plan's tokens and blocks


def derived_seed(engine_seed: int, req_id: str) -> int:
    """The seed of a request that set none: stable across processes (unlike ``hash()``) and across
    preemption, so an engine seed makes unseeded requests reproducible too."""
    return (engine_seed << 32) ^ zlib.crc32(req_id.encode())


def apply_plan(requests: dict[str, CachedRequestState], plan: SchedulerOutput, engine_seed: int) -> PlanChanges:
    """Bring ``requests`` up to date with ``plan``."""
    removed = plan.finished_req_ids | plan.preempted_req_ids
    for rid in removed:
        requests.pop(rid, None)
    added = []
    for new in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
        params = new.sampling_params
        token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            token_ids=token_ids,
            num_committed=len(token_ids),
            sampling_params=params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            # Any int a client sends (or the derived one) fits int64 tensors from here on.
            seed=seed_to_int64(params.seed if params.seed is not None else derived_seed(engine_seed, new.req_id)),
            eos_token_ids=tuple(new.eos_token_ids),
        )
        requests[new.req_id] = state
        added.append(state)
    updated = []
    for cached in plan.scheduled_running_reqs:
        state = requests[cached.req_id]
        state.commit(cached.new_token_ids)
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens
        updated.append(state)
    return PlanChanges(frozenset(removed), frozenset(plan.finished_req_ids), added, updated)
