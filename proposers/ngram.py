"""Prompt-lookup (n-gram) proposer: continue the sequence the way it continued before.

The last ``n`` tokens (``prompt_lookup_max >= n >= prompt_lookup_min``) are looked up in the
prompt + output; the tokens that followed the match become the drafts. A continuation that runs
into the end of the sequence repeats: after ``... a b c a b``, the match ``a b`` is followed by
``c a b``, and the pattern goes on ``c a b c a ...``.

Which match wins: the longest ``n`` first; among occurrences of that n-gram, the **earliest**
(leftmost) one. The earliest occurrence has the longest continuation before it runs into the
suffix itself and does not move as the sequence grows, so a repeating pattern keeps drafting the
same continuation.

A step of more than a few requests is searched at once (:func:`find_ngram_continuations`: one padded
array, one comparison for every request's candidate ends), with the per-request search's results.
After a greedy verification on the GPU runner the search runs on the device instead
(:meth:`NgramProposer.launch`, ``kernels.ngram``), where the verified tokens already are.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from specloop.kernel.config import EngineConfig

from .base import DeviceStep, DraftProposal, LaunchInputs, Proposer, ProposerContext, ProposerInputs, draft_limits
from .step_graphs import LaunchGraphs, capture_launches


def find_ngram_continuation(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """``k`` tokens following the earliest occurrence of the longest suffix n-gram
    (``min_n <= n <= max_n``) that ends before the last token, the continuation repeating if it
    reaches the last token; empty when none matches."""
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
    return continuation(tokens, end, length, k)


def continuation(tokens: np.ndarray, end: int, length: int, k: int) -> np.ndarray:
    """``k`` tokens after ``tokens[end]``, the ``tokens[end + 1:length]`` pattern repeated."""
    return tokens[end + 1 + np.arange(k) % (length - 1 - end)]


_PAD = np.int64(-(1 << 62))  # past a row's end: equal to no token


def find_ngram_continuations(token_ids: Sequence[np.ndarray], min_n: int, max_n: int,
                             limits: Sequence[int]) -> list[np.ndarray]:
    """:func:`find_ngram_continuation` for a batch at once (``limits[i]`` tokens at most for row
    ``i``), with the same result for every row: the rows side by side in one padded array, one
    whole-batch comparison for the candidate ends, then the candidates of every row extended
    together, rather than a dozen small numpy calls per request."""
    b = len(token_ids)
    empty = [t[:0] for t in token_ids]
    if b == 0 or min_n < 1:
        return empty
    lengths = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=b)
    width = int(lengths.max())
    tokens = np.full((b, width), _PAD, dtype=np.int64)
    for i, t in enumerate(token_ids):
        tokens[i, :len(t)] = t
    last = np.maximum(lengths - 1, 0)
    row_max_n = np.minimum(max_n, lengths - 1)  # a match ends before the last token
    candidates = (tokens == tokens[np.arange(b), last][:, None]) & (np.arange(width)[None, :] < last[:, None])
    rows, ends = np.nonzero(candidates)  # row by row, each row's ends in increasing order
    if rows.size == 0:
        return empty
    match_len = np.ones(rows.size, dtype=np.int64)
    extending = np.ones(rows.size, dtype=bool)
    for m in range(1, max_n):
        before = ends - m
        extending &= (m < row_max_n[rows]) & (before >= 0)
        extending &= tokens[rows, np.maximum(before, 0)] == tokens[rows, np.maximum(last[rows] - m, 0)]
        if not extending.any():
            break
        match_len += extending
    best = np.zeros(b, dtype=np.int64)
    np.maximum.at(best, rows, match_len)
    longest = match_len == best[rows]
    first_rows, first = np.unique(rows[longest], return_index=True)  # the earliest end of a longest match
    out = empty
    for i, end in zip(first_rows.tolist(), ends[longest][first].tolist()):
        if best[i] >= min_n and row_max_n[i] >= min_n and limits[i] > 0:
            out[i] = continuation(np.asarray(token_ids[i]), end, int(lengths[i]), int(limits[i]))
    return out


class NgramProposer(Proposer):
    """``speculative_config={"method": "ngram", "num_speculative_tokens": K,
    "prompt_lookup_min": m, "prompt_lookup_max": M}``. Needs nothing from the target model."""
    config_fields = frozenset({"prompt_lookup_min", "prompt_lookup_max"})

    catches_up = True  # stateless
    launches = True

    def __init__(self, config: EngineConfig, context: ProposerContext | None = None) -> None:
        super().__init__(config, context)
        spec = config.speculative_config
        self.min_n = int(spec.prompt_lookup_min or 1)
        self.max_n = int(spec.prompt_lookup_max or self.min_n)
        self.launch_graphs: dict[int, LaunchGraphs] = {}  # by rows per request

    def initialize(self, num_kv_blocks: int) -> None:
        """With the runner's step on the device and CUDA graphs: one graph per verification shape
        (rows per request, padded request count) that accepts, searches and writes the drafts."""
        if self.context is not None:
            self.launch_graphs = capture_launches(self._search, self.config, self.device_step,
                                                  self.context.device, self.num_speculative_tokens, "n-gram searches")

    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        limits = draft_limits(self.config, inputs, self.num_speculative_tokens)
        if inputs.num_reqs <= 4:  # a few requests: the per-request search has less to set up
            found = [find_ngram_continuation(t, self.min_n, self.max_n, int(k))
                     for t, k in zip(inputs.token_ids, limits)]
        else:
            found = find_ngram_continuations(inputs.token_ids, self.min_n, self.max_n, limits)
        return DraftProposal([d.tolist() for d in found])

    def launch(self, step: LaunchInputs) -> torch.Tensor | None:
        """The search on the device, over the token rows of the runner's step (``kernels.ngram``):
        one graph replay when one was captured for the step's shape, else three kernels. Every
        request gets ``K`` drafts: with no match, its newest token repeated."""
        src = self.device_step
        if src is None or step.device is not src:
            return None
        graphs = self.launch_graphs.get(step.q)
        drafts = graphs.replay(step) if graphs is not None else None
        return drafts if drafts is not None else self.search(src, step.accept(), step.q)

    def _search(self, accepted: torch.Tensor, q: int) -> torch.Tensor:
        return self.search(self.device_step, accepted, q)

    def search(self, src: DeviceStep, accepted: torch.Tensor, q: int) -> torch.Tensor:
        from specloop.kernels.ngram import ngram_drafts

        return ngram_drafts(src.tokens, src.req_slots, src.positions, accepted, q, self.min_n, self.max_n,
                            self.num_speculative_tokens)
