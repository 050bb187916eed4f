"""The GPU runner's sampling stage: fast paths for plain batches around the reference stage.

A batch is *plain* when it verifies no drafts and every request samples with temperature, min-p and
a seed only (no penalties, bias, top-k/top-p, logprobs). Then the parameters are gathered on the
device from the persistent batch's slots, one Gumbel-max kernel draws every row with the reference
sampler's noise, the tokens are written straight back into the device token rows (the next step
reads them there), and one small copy brings them to the host.

A batch that verifies drafts with every request plain and greedy takes the argmax of every sampled
row on the device and one copy of those ids to the host, where each request keeps its drafts up to
the first that differs from the target's token, plus that token: what the rejection sampler does
for greedy rows, without its per-row metadata and kernel launches. A verification graph may have
taken that argmax already (``batch.greedy``). The next proposal may be
launched from those ids on the device while they travel (``launch``, from the drafting stage).

Both paths take structured outputs' grammar masks: the step's packed bitmask goes to the device
through a pinned buffer and the mask kernel clears the forbidden logits of its rows before the draw
or the argmax, so a constrained plain batch still samples on the device and defers its tokens.

A plain decode step replayed from a CUDA graph finds its draws made already (``batch.presampled``:
the graph ran the same kernel on the same parameters and stored the tokens); without min-p and a
grammar mask it only copies them to the host.

Everything else goes to the reference stage, with the Gumbel-max kernel for its draws.
"""

from __future__ import annotations

from typing import Callable

import torch

from specloop.kernels.sampling import argmax_rows, gumbel_sample
from specloop.sampling.structured_outputs import GrammarBitmask, apply_token_bitmask

from ..batch import InputBatch
from ..requests import CachedRequestState
from ..sampling_stage import SampleResult, SamplingStage
from .persistent_batch import PersistentBatch, send


class FastSamplingStage:
    # Host buffers the device copies tokens into, used in turn: with asynchronous scheduling a
    # step's copy is read after the next step's has been queued.
    NUM_HOST_BUFFERS = 3

    def __init__(self, reference: SamplingStage, batch: PersistentBatch, max_tokens: int) -> None:
        self.reference = reference
        self.batch = batch
        pinned = batch.device.type == "cuda"
        self._host = [torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pinned)
                      for _ in range(self.NUM_HOST_BUFFERS)]
        self._turn = 0
        self.num_presampled = 0  # plain steps whose draws a decode graph made
        self._masks: list[torch.Tensor | None] = [None] * self.NUM_HOST_BUFFERS  # pinned bitmask staging
        self._mask_turn = 0

    def forget(self, finished: frozenset[str]) -> None:
        self.reference.forget(finished)

    def can_defer(self, batch: InputBatch) -> bool:
        plain = self.batch.plain
        return not any(batch.spec_token_ids) and all(plain[rid] for rid in batch.req_ids)

    def _greedy_verification(self, batch: InputBatch, requests: dict[str, CachedRequestState]) -> bool:
        plain = self.batch.plain
        return (any(batch.spec_token_ids)
                and all(plain[rid] and requests[rid].sampling_params.greedy for rid in batch.req_ids))

    def sample(self, batch: InputBatch, hidden_states: torch.Tensor, requests: dict[str, CachedRequestState],
               draft_probs: dict[str, torch.Tensor | None], defer: bool = False,
               grammar: GrammarBitmask | None = None,
               launch: Callable[[torch.Tensor], None] | None = None) -> SampleResult:
        if self._greedy_verification(batch, requests):
            return self._verify_greedy(batch, hidden_states, grammar, launch, defer)
        if not self.can_defer(batch):
            return self.reference.sample(batch, hidden_states, requests, draft_probs, grammar=grammar)
        result = self._sample_plain(batch, hidden_states, grammar)
        if not defer:
            result.sampled, result.wait = result.wait(), None
        return result

    def _verify_greedy(self, batch: InputBatch, hidden_states: torch.Tensor, grammar: GrammarBitmask | None,
                       launch: Callable[[torch.Tensor], None] | None, defer: bool = False) -> SampleResult:
        """Drafts against the target's argmax; see the module docstring. ``launch`` (the next
        proposal, fed from the device) runs while the argmax travels to the host. With ``defer``
        the result's ``wait()`` reads it."""
        num_rows = batch.logits_indices.shape[0]
        with torch.inference_mode():
            if batch.greedy is not None and grammar is None and num_rows == batch.num_tokens:
                top = batch.greedy[:num_rows]  # the verification graph took the argmax
            else:
                logits = self.reference.logits(batch, hidden_states)
                self._apply_grammar(batch, logits, grammar)
                top = (argmax_rows(logits, out=self.batch.top[:num_rows]) if logits.is_cuda
                       else torch.argmax(logits, dim=-1, out=self.batch.top[:num_rows]))
            host = self._next_host_buffer(num_rows)
            host.copy_(top, non_blocking=True)
            copied = torch.cuda.Event() if top.is_cuda else None
            if copied is not None:
                copied.record()
            if launch is not None:
                launch(top)

        def wait() -> list[list[int]]:
            if copied is not None:
                copied.synchronize()
            values = host.tolist()
            sampled: list[list[int]] = []
            for (first, count), drafts in zip(batch.sample_rows, batch.spec_token_ids):
                target = values[first:first + count]
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                    accepted += 1
                sampled.append(target[:accepted + 1] if count else [])
            return sampled

        return SampleResult([], None, {}, wait=wait) if defer else SampleResult(wait(), None, {})

    def _apply_grammar(self, batch: InputBatch, logits: torch.Tensor, grammar: GrammarBitmask | None) -> None:
        """In place: the structured rows of ``logits`` (one per sampled row of each constrained
        request, drafts included) keep only what their grammar allows."""
        if grammar is None:
            return
        position = {rid: i for i, rid in enumerate(batch.req_ids)}
        rows: list[int] = []
        for rid, n in zip(grammar.req_ids, grammar.num_rows):
            first, count = batch.sample_rows[position[rid]]
            if count != n:
                raise RuntimeError(f"request {rid!r}: {n} grammar rows for {count} sampled rows")
            rows.extend(range(first, first + count))
        bitmask = self._stage_bitmask(grammar.bitmask)
        apply_token_bitmask(logits, bitmask, send(rows, torch.int64, logits.device))

    def _stage_bitmask(self, bitmask) -> torch.Tensor:
        """The step's bitmask on the device, copied from a pinned buffer (reused three steps later,
        long after its copy ran: each step waits for its own tokens, copied after the mask)."""
        rows, words = bitmask.shape
        staged = self._masks[self._mask_turn]
        if staged is None or staged.shape[0] < rows or staged.shape[1] != words:
            capacity = max(rows, 2 * staged.shape[0] if staged is not None else 64)
            staged = torch.empty((capacity, words), dtype=torch.int32, pin_memory=self.batch.device.type == "cuda")
            self._masks[self._mask_turn] = staged
        self._mask_turn = (self._mask_turn + 1) % self.NUM_HOST_BUFFERS
        host = staged[:rows]
        host.numpy()[...] = bitmask
        return host.to(self.batch.device, non_blocking=True)

    def _next_host_buffer(self, num_rows: int) -> torch.Tensor:
        host = self._host[self._turn][:num_rows]
        self._turn = (self._turn + 1) % self.NUM_HOST_BUFFERS
        return host

    def _sample_plain(self, batch: InputBatch, hidden_states: torch.Tensor,
                      grammar: GrammarBitmask | None = None) -> SampleResult:
        """Launch the draw and the copy of its tokens to the host; ``wait()`` reads them."""
        pb = self.batch
        num_rows = batch.logits_indices.shape[0]
        rows_of = [(i, first) for i, (first, count) in enumerate(batch.sample_rows) if count]
        num_reqs = len(batch.req_ids)
        if num_rows == 0:
            return SampleResult([], None, {}, wait=lambda: [[] for _ in range(num_reqs)])
        any_min_p = bool(pb.with_min_p) and any(rid in pb.with_min_p for rid in batch.req_ids)
        with torch.inference_mode():
            if (batch.presampled is not None and grammar is None and not any_min_p and num_rows == num_reqs):
                # The decode graph drew every row, and stored each token in its row, already.
                tokens = batch.presampled[:num_rows]
                self.num_presampled += 1
            else:
                logits = self.reference.logits(batch, hidden_states)
                self._apply_grammar(batch, logits, grammar)
                rows = pb.sample_req_rows[:num_rows].long()
                slots = pb.req_slots.index_select(0, rows).long()
                tokens = gumbel_sample(logits, pb.temperature.index_select(0, slots),
                                       pb.seeds.index_select(0, slots), pb.seq_lens.index_select(0, rows).long(),
                                       min_p=pb.min_p.index_select(0, slots) if any_min_p else None)
                pb.write_sampled(tokens)
            host = self._next_host_buffer(num_rows)
            host.copy_(tokens, non_blocking=True)
            copied = torch.cuda.Event() if tokens.is_cuda else None
            if copied is not None:
                copied.record()
        seq_lens = batch.attn_metadata.seq_lens_cpu
        for i, _ in rows_of:
            pb.mark_sampled(batch.req_ids[i], seq_lens[i])

        def wait() -> list[list[int]]:
            if copied is not None:
                copied.synchronize()
            values = host.tolist()
            sampled: list[list[int]] = [[] for _ in range(num_reqs)]
            for i, first in rows_of:
                sampled[i] = [values[first]]
            return sampled

        return SampleResult([], None, {}, wait=wait)
