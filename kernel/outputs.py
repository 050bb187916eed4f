"""The typed messages that cross component boundaries once per step.

``SchedulerOutput`` is the immutable plan (scheduler -> model runner), ``ModelRunnerOutput`` the result of executing
it (model runner -> scheduler), ``DraftTokenIds`` the proposals handed back in ``post_step``, and
``EngineCoreOutputs`` what the engine emits to the frontend. Each plan pairs with exactly one result (invariant 3).
"""

from __future__ import annotations

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

    The tokens computed for request ``r`` this step are positions ``[num_computed_tokens, num_computed_tokens +
    num_scheduled_tokens[r])`` of ``all_token_ids + scheduled_spec_decode_tokens[r]``."""

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
    were verified; the scheduler counts the accepted drafts from that and the plan.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request: one entry per sampled token (None when logprobs were not asked for).
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Per request with prompt_logprobs: entries for the prompt positions computed this step.
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # When the runner timed its device work (a timeline asked for it): (start, end) of this step's
    # forward and sampling on the device, in time.perf_counter() seconds.
    device_span: tuple[float, float] | None = None

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
class SpecDecodingStats:
    """Speculative-decoding acceptance over some span of steps: one step (the scheduler's
    ``SchedulerStats.spec_decoding``), a logging window or an engine's lifetime (the metrics plugin,
    the frontend's ``get_metrics()``). Every counter of acceptance in specloop is one of these."""

    num_drafts: int = 0  # verifications: requests whose drafts a step verified
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of which accepted
    # [i]: verifications whose draft at position i was accepted (as long as the longest draft seen).
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's drafts were verified; the first ``num_accepted_tokens`` were accepted."""
        self.add(1, num_draft_tokens, num_accepted_tokens,
                 [1] * num_accepted_tokens + [0] * (num_draft_tokens - num_accepted_tokens))

    def add(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
            accepted_per_position: list[int]) -> None:
        self.num_drafts += num_drafts
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.accepted_per_position
        per_pos.extend([0] * (len(accepted_per_position) - len(per_pos)))
        for i, n in enumerate(accepted_per_position):
            per_pos[i] += n

    def merge(self, other: SpecDecodingStats) -> None:
        self.add(other.num_drafts, other.num_draft_tokens, other.num_accepted_tokens, other.accepted_per_position)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens one verification commits on average: the accepted drafts plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of verifications whose draft ``i`` was accepted."""
        return [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else []

    def format(self) -> str:
        per_pos = ", ".join(f"{a:.2f}" for a in self.per_position_acceptance)
        return (f"Speculative decoding: mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"acceptance rate {100 * self.acceptance_rate:.1f}% ({self.num_accepted_tokens}/"
                f"{self.num_draft_tokens} draft tokens, {self.num_drafts} drafts), "
                f"per-position acceptance {per_pos}")


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
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # drafts verified this step


@dataclass(slots=True)
class EngineCoreOutputs:
    """Everything one step produced."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
