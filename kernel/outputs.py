"""The typed messages that cross component boundaries once per step.

``SchedulerOutput`` is the immutable plan (scheduler -> model runner), ``ModelRunnerOutput`` the
result of executing it (model runner -> scheduler), ``DraftTokenIds`` the proposals handed back in
``post_step``, and ``EngineCoreOutputs`` what the engine emits to the frontend. Each plan pairs with
exactly one result (invariant 3).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .request import FinishReason
from .sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has not seen (first admission) or must rebuild (resumed after
    preemption). Set by the scheduler from the ``Request``."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # committed so far (non-empty only when resumed)
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # first position computed this step (prefix-cache hits are skipped)
    eos_token_ids: tuple[int, ...] = ()  # the request's EOS ids (min_tokens masks them)


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """A request the runner already holds. Set by the scheduler."""

    req_id: str
    new_token_ids: list[int]  # committed tokens the runner has not seen yet
    new_block_ids: list[int]  # blocks appended to the block table this step
    num_computed_tokens: int  # first position computed this step


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan. Built by the scheduler, read by the runner, never mutated.

    The tokens computed for request ``r`` this step are positions
    ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens[r])`` of
    ``all_token_ids + scheduled_spec_decode_tokens[r]``.
    """

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_resumed_reqs: list[NewRequestData]
    scheduled_running_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Drafts verified this step (a suffix of the scheduled tokens), per request.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests finished or aborted since the last plan: the runner drops their state.
    finished_req_ids: frozenset[str] = frozenset()
    # Requests preempted since the last plan: the runner drops their state too.
    preempted_req_ids: frozenset[str] = frozenset()
    # Draft slots reserved past the scheduled tokens for the next step's proposals.
    num_lookahead_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's and the top-k alternatives'."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of token_id under the distribution the logprobs come from
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class ModelRunnerOutput:
    """The result of executing one plan. Set by the model runner.

    ``sampled_token_ids[i]`` is empty for a request whose prefill is still partial this step, one
    token for a plain decode, and up to K+1 tokens (accepted drafts + the target's token) when drafts
    were verified.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request: one entry per sampled token (None when logprobs were not asked for).
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Per request with prompt_logprobs: entries for the prompt positions computed this step.
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # Per request: how many drafts the rejection sampler saw and accepted this step.
    num_draft_tokens: list[int] | None = None
    num_accepted_tokens: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.req_ids) != len(self.sampled_token_ids):
            raise ValueError("req_ids and sampled_token_ids must have the same length")


@dataclass(slots=True)
class DraftTokenIds:
    """Next-step proposals, taken from the runner in ``post_step`` and written to
    ``request.spec_token_ids`` by the scheduler."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request gained in one step. Set by the scheduler's ``update_from_output``."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # drafted tokens verified this step
    num_accepted_tokens: int = 0  # of which accepted
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot taken after each step. Set by the scheduler."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use
    prefix_cache_queries: int = 0  # tokens looked up since the last snapshot
    prefix_cache_hits: int = 0  # tokens found since the last snapshot
    num_preemptions: int = 0  # since the last snapshot
    num_prompt_tokens: int = 0  # scheduled prompt tokens this step
    num_generation_tokens: int = 0  # committed output tokens this step
    # Speculative decoding, this step.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineCoreOutputs:
    """Everything one step produced."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = field(default_factory=time.monotonic)
