"""The scheduler's view of one request: its state machine and token counters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING_FOR_GRAMMAR = -1  # held by the structured-output manager until its grammar compiles
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """What the API reports; values are OpenAI's ``finish_reason`` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence inside the engine.

    The frontend builds it (id, prompt, params, EOS ids, arrival, priority, cache salt); after
    ``add_request`` only the scheduler and its KV-cache policy mutate it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The engine's EOS ids, resolved once when the engine is built; the scheduler stops on them and
    # the runner holds them back while min_tokens is not reached.
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value = served first (vLLM's convention)
    cache_salt: str | None = None

    # --- set by the scheduler ---
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + committed output
    spec_token_ids: list[int] = field(default_factory=list)  # unverified drafts for the next step
    # Tokens scheduled to be sampled by steps not committed yet (asynchronous scheduling plans the
    # next step first); the next step computes them on the device without the host knowing them.
    num_output_placeholders: int = 0
    num_computed_tokens: int = 0  # positions whose KV the target has written and may rely on
    num_cached_tokens: int = -1  # prefix-cache hit length at first admission (-1: not yet looked up)
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # How many of ``all_token_ids`` the model runner already holds; the next plan sends the rest.
    num_tokens_sent: int = 0
    # Speculative decoding counters, accumulated by update_from_output.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # --- set by the KV-cache policy ---
    block_hashes: list[int] = field(default_factory=list)
    # --- timestamps (monotonic), set by the scheduler ---
    scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def max_tokens(self) -> int:
        mt = self.sampling_params.max_tokens
        return mt if mt is not None else 1 << 62

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
