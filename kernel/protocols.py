"""The small interfaces the engine calls components through (directly, not through pluggy)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .outputs import (DraftTokenIds, EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput,
                          SchedulerStats)
    from .request import Request, RequestStatus


@runtime_checkable
class KVCacheManager(Protocol):
    """Paged KV bookkeeping for the scheduler: which physical blocks each request owns."""

    block_size: int
    num_blocks: int

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks: (block ids, number of tokens). Never the whole
        prompt: the last prompt token is always recomputed (invariant 7)."""

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) more positions. Returns the newly added
        block ids, or None, changing no state, when they do not fit."""

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks among its first ``num_computed_tokens`` positions in
        the prefix cache; called at the commit point, so drafts are never published."""

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first, so tails are evicted first)."""

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while blocks are in use."""

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(tokens looked up, tokens found) in the prefix cache since the last call."""


@runtime_checkable
class Scheduler(Protocol):
    """Decides each step's plan and commits each step's result."""

    def add_request(self, request: Request) -> None: ...

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests by id; unknown ids are ignored. Returns the ones finished."""

    def schedule(self) -> SchedulerOutput: ...

    def update_from_output(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """The commit point: append accepted tokens, roll back rejected drafts, check stops, free
        finished requests."""

    def update_draft_token_ids(self, drafts: DraftTokenIds) -> None:
        """Store next-step proposals in ``request.spec_token_ids``."""

    def has_unfinished_requests(self) -> bool: ...

    def make_stats(self) -> SchedulerStats: ...


class PendingOutput(Protocol):
    """A step's result that may still be on its way (asynchronous scheduling); ``overlaps`` False:
    commit it before planning the next step (a step with drafts)."""

    overlaps: bool

    def result(self) -> ModelRunnerOutput:
        """Wait for it (once); later calls return the same output."""


@runtime_checkable
class ModelRunner(Protocol):
    """Executes plans on a device: input packing, forward, sampling, proposing."""

    vocab_size: int
    model_max_len: int | None  # the model's max_position_embeddings, if it has one
    async_scheduling: bool  # resolved by ``initialize``: plan the next step before committing this one

    def initialize(self) -> int:
        """Allocate the KV cache and buffers once the config is resolved; returns ``num_kv_blocks``."""

    def execute_model(self, plan: SchedulerOutput) -> None:
        """Update resident request state from the plan and run the forward pass."""

    def sample_tokens(self, grammar: Any = None) -> ModelRunnerOutput | PendingOutput:
        """Sample (or rejection-sample drafts) for the last executed plan, then propose drafts;
        ``grammar`` (the structured-output manager's bitmask, or None) masks its structured rows."""

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed by the last ``sample_tokens``, once."""

    def shutdown(self) -> None: ...


@runtime_checkable
class StructuredOutputManager(Protocol):
    """Grammars of structured-output requests (``sampling/grammar.py`` says when each is called)."""

    def add_request(self, request: Request) -> None: ...
    def take_ready(self, wait: bool) -> tuple[list[Request], list[EngineCoreOutput]]: ...
    def grammar_bitmask(self, plan: SchedulerOutput) -> Any: ...
    def commit(self, outputs: EngineCoreOutputs) -> dict[str, str] | None: ...  # refused: id -> error
    def remove(self, request_ids: Iterable[str]) -> list[Request]: ...
    def has_pending(self) -> bool: ...
    def has_active(self) -> bool: ...
