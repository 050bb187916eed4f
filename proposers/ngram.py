"""Prompt-lookup (n-gram) proposer: continue the sequence the way it continued before.

The last ``n`` tokens (``prompt_lookup_max >= n >= prompt_lookup_min``) are looked up in the
prompt + output; the tokens that followed the match become the drafts.

Which match wins: the longest ``n`` first; among occurrences of that n-gram, the **earliest**
(leftmost) one. The earliest occurrence has the longest continuation before it runs into the
suffix itself and does not move as the sequence grows, so a repeating pattern keeps drafting the
same continuation.
"""

from __future__ import annotations

import numpy as np

from specloop.kernel.config import EngineConfig

from .base import DraftProposal, Proposer, ProposerContext, ProposerInputs, draft_limits


def find_ngram_continuation(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens following the earliest occurrence of the longest suffix n-gram
    (``min_n <= n <= max_n``) that ends before the last token; empty when none matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    max_n = min(max_n, length - 1)
    if k <= 0 or max_n < min_n or min_n < 1:
        return tokens[:0]
    # Candidate ends: earlier occurrences of the newest token. Extend each match backwards one
    # token at a time while it still agrees with the suffix (a handful of vector steps).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if ends.size == 0:
        return tokens[:0]
    match_len = np.ones(ends.size, dtype=np.int64)
    extending = np.ones(ends.size, dtype=bool)
    for m in range(1, max_n):
        before = ends - m
        extending &= before >= 0
        extending &= tokens[np.maximum(before, 0)] == tokens[length - 1 - m]
        if not extending.any():
            break
        match_len += extending
    best = int(match_len.max())
    if best < min_n:
        return tokens[:0]
    end = int(ends[np.argmax(match_len == best)])  # the earliest end of a longest match
    return tokens[end + 1:end + 1 + k]


class NgramProposer(Proposer):
    """``speculative_config={"method": "ngram", "num_speculative_tokens": K,
    "prompt_lookup_min": m, "prompt_lookup_max": M}``. Needs nothing from the target model."""

    catches_up = True  # stateless

    def __init__(self, config: EngineConfig, context: ProposerContext | None = None) -> None:
        super().__init__(config, context)
        spec = config.speculative_config
        self.min_n = int(spec.prompt_lookup_min or 1)
        self.max_n = int(spec.prompt_lookup_max or self.min_n)

    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        limits = draft_limits(self.config, inputs, self.num_speculative_tokens)
        return DraftProposal([find_ngram_continuation(t, self.min_n, self.max_n, int(k)).tolist()
                              for t, k in zip(inputs.token_ids, limits)])
