"""Per-request generation parameters, with vLLM's field names and validation."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to generate for one request. Set by the caller; read by the sampler and the scheduler.

    Every invalid value raises ``ValueError`` naming the field, so the HTTP layer can turn it into
    a 400 with ``param`` set.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: Any = None  # a specloop.sampling.structured_outputs.StructuredOutputsParams
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    # Set by the frontend from bad_words: each word's token ids (with and without a leading space).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bad_words = _as_list(self.bad_words, "bad_words")
        self.stop = [self.stop] if isinstance(self.stop, str) else _as_list(self.stop, "stop")
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids")
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"logit_bias must map token ids to floats: {e}") from None
        self._verify()
        # Duplicates change nothing but cost a check for every token generated.
        self.stop = list(dict.fromkeys(self.stop))
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))

    def _verify(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            # Before the range checks, which would raise TypeError for a string or None.
            check(isinstance(value, (int, float)) and not isinstance(value, bool), name,
                  f"must be a number, got {value!r}.")

        check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}.")
        check(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}.")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}.")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
              f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}.")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}.")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"must be in [-2, 2], got {self.presence_penalty}.")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"must be in [-2, 2], got {self.frequency_penalty}.")
        check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
              f"must be in (0, 2], got {self.repetition_penalty}.")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", f"must be an integer of at least 1, got {self.max_tokens!r}.")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
              f"must be an integer >= 0, got {self.min_tokens!r}.")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}.")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
              "logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}.")
        check(self.prompt_logprobs is None
              or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
              "prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}.")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                    and -(1 << 63) <= self.seed < 1 << 63), "seed",
              f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}.")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings.")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers.")
        ids = self.allowed_token_ids
        check(ids is None or (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)),
              "allowed_token_ids", "must be a non-empty list of token ids.")
        check(all(isinstance(w, str) and w for w in self.bad_words), "bad_words", "must be non-empty strings.")
        k = self.truncate_prompt_tokens
        check(k is None or (isinstance(k, int) and k >= 1), "truncate_prompt_tokens", f"must be >= 1, got {k!r}.")
        if self.logit_bias:
            check(all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias",
                  "values must be in [-100, 100].")
            check(all(k >= 0 for k in self.logit_bias), "logit_bias", "keys must be non-negative token ids.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model's vocabulary (known only once a model is loaded)."""
        if self.logit_bias:
            bad = [t for t in self.logit_bias if t >= vocab_size]
            if bad:
                raise ValueError(f"logit_bias has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(self, name) or () if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _as_list(value: Any, name: str) -> list[Any]:
    if value is None:
        return []
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list, got {value!r}.") from None
