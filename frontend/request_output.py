"""What the offline and async APIs return, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the sampled token plus the top-k alternatives).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.time()``) and speculative-decoding counters of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request.

    In cumulative mode ``text``/``token_ids``/``logprobs`` hold everything so far; in delta mode
    (``AsyncEngine.generate(..., delta=True)``) only what is new since the previous yield.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    extra: dict = field(default_factory=dict)
