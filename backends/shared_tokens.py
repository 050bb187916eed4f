"""How the ranks of a tensor-parallel group come to hold the same sampled tokens (invariant 8).

Rank 0 samples and broadcasts; the other ranks adopt its tokens. Every rank holds the whole logits
(the head's all-gather), so each could sample by itself with the same seeds, but then agreement
would rest on every sampling kernel being bit-for-bit deterministic across devices; broadcasting
makes it hold by construction, for one small host broadcast per step, and lets the other ranks skip
the sampling work (penalties, top-k/top-p, logprobs) altogether.

Both are sampling stages (the runner's ``Sampler`` part) wrapped around what the platform supplies,
so the runner, its batch builder and its drafting stage are the same on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch

from specloop.models.parallel import TensorParallel

from specloop.sampling.structured_outputs import GrammarBitmask
from .batch import InputBatch
from .requests import CachedRequestState
from .parts import Sampler
from .sampling_stage import SampleResult, SamplingStage


def _sizes(batch: InputBatch) -> tuple[int, int]:
    """(requests, sampled rows) of the step: what every rank knows before the tokens exist."""
    return len(batch.req_ids), sum(count for _, count in batch.sample_rows)


class BroadcastSampledTokens:
    """Rank 0: sample with the platform's stage, then send the tokens to the other ranks."""

    def __init__(self, inner: Sampler, tp: TensorParallel) -> None:
        self.inner = inner
        self.tp = tp

    def forget(self, finished: frozenset[str]) -> None:
        self.inner.forget(finished)

    def can_defer(self, batch: InputBatch) -> bool:
        return False  # the broadcast needs the tokens on the host

    def sample(self, batch: InputBatch, hidden_states: torch.Tensor, requests: dict[str, CachedRequestState],
               draft_probs: dict[str, torch.Tensor | None], defer: bool = False,
               grammar: GrammarBitmask | None = None, launch: Callable[[torch.Tensor], None] | None = None
               ) -> SampleResult:
        # ``launch`` is always None here: with several ranks proposals are not launched from the
        # device (``DraftingStage.attach``).
        result = self.inner.sample(batch, hidden_states, requests, draft_probs, grammar=grammar)
        num_reqs, num_rows = _sizes(batch)
        # [emitted count per request | the tokens, request after request | padding]; a request
        # emits at most one token per sampled row.
        packed = torch.zeros(num_reqs + num_rows, dtype=torch.int64)
        packed[:num_reqs] = torch.tensor([len(s) for s in result.sampled], dtype=torch.int64)
        flat = [t for s in result.sampled for t in s]
        packed[num_reqs:num_reqs + len(flat)] = torch.tensor(flat, dtype=torch.int64)
        self.tp.broadcast_ints(packed)
        return result


class ReceiveSampledTokens:
    """The other ranks: take part in the logits' all-gather, then adopt rank 0's tokens."""

    def __init__(self, reference: SamplingStage, tp: TensorParallel) -> None:
        self.reference = reference
        self.tp = tp

    def forget(self, finished: frozenset[str]) -> None:
        pass

    def can_defer(self, batch: InputBatch) -> bool:
        return False

    def sample(self, batch: InputBatch, hidden_states: torch.Tensor, requests: dict[str, CachedRequestState],
               draft_probs: dict[str, torch.Tensor | None], defer: bool = False,
               grammar: GrammarBitmask | None = None, launch: Callable[[torch.Tensor], None] | None = None
               ) -> SampleResult:
        if batch.precomputed_logits is None:  # else a CUDA graph gathered them on every rank already
            self.reference.logits(batch, hidden_states)
        num_reqs, num_rows = _sizes(batch)
        packed = self.tp.broadcast_ints(torch.zeros(num_reqs + num_rows, dtype=torch.int64)).tolist()
        sampled, pos = [], num_reqs
        for count in packed[:num_reqs]:
            sampled.append(packed[pos:pos + count])
            pos += count
        return SampleResult(sampled, None, {})
