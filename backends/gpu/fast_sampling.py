"""The GPU runner's sampling stage: a fast path for plain batches around the reference stage.

A batch is *plain* when it verifies no drafts and every request samples with temperature, min-p and
a seed only (no penalties, bias, top-k/top-p, logprobs). Then the parameters are gathered on the
device from the persistent batch's slots, one Gumbel-max kernel draws every row with the reference
sampler's noise, the tokens are written straight back into the device token rows (the next step
reads them there), and one small copy brings them to the host. Everything else goes to the
reference stage, with the Gumbel-max kernel for its draws.
"""

from __future__ import annotations

import torch

from specloop.kernels.sampling import gumbel_sample

from ..batch import InputBatch
from ..requests import CachedRequestState
from ..sampling_stage import SampleResult, SamplingStage
from .persistent_batch import PersistentBatch


class FastSamplingStage:
    def __init__(self, reference: SamplingStage, batch: PersistentBatch, max_tokens: int) -> None:
        self.reference = reference
        self.batch = batch
        pinned = batch.device.type == "cuda"
        self._host_tokens = torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pinned)

    def forget(self, finished: frozenset[str]) -> None:
        self.reference.forget(finished)

    def sample(self, batch: InputBatch, hidden_states: torch.Tensor, requests: dict[str, CachedRequestState],
               draft_probs: dict[str, torch.Tensor | None]) -> SampleResult:
        plain = self.batch.plain
        if any(batch.spec_token_ids) or not all(plain[rid] for rid in batch.req_ids):
            return self.reference.sample(batch, hidden_states, requests, draft_probs)
        return self._sample_plain(batch, hidden_states, requests)

    def _sample_plain(self, batch: InputBatch, hidden_states: torch.Tensor,
                      requests: dict[str, CachedRequestState]) -> SampleResult:
        pb = self.batch
        num_rows = batch.logits_indices.shape[0]
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        if num_rows == 0:
            return SampleResult(sampled, None, {})
        with torch.inference_mode():
            logits = self.reference.logits(batch, hidden_states)
            rows = pb.sample_req_rows[:num_rows].long()
            slots = pb.req_slots.index_select(0, rows).long()
            any_min_p = any(requests[r].sampling_params.min_p > 0 for r in batch.req_ids)
            tokens = gumbel_sample(logits, pb.temperature.index_select(0, slots), pb.seeds.index_select(0, slots),
                                   pb.seq_lens.index_select(0, rows).long(),
                                   min_p=pb.min_p.index_select(0, slots) if any_min_p else None)
            pb.write_sampled(tokens)
            host = self._host_tokens[:num_rows]
            host.copy_(tokens, non_blocking=True)
            if tokens.is_cuda:
                torch.cuda.current_stream(tokens.device).synchronize()
        values = host.tolist()
        seq_lens = batch.attn_metadata.seq_lens_cpu
        for i, (first, count) in enumerate(batch.sample_rows):
            if count:
                sampled[i] = [values[first]]
                pb.note_sampled(batch.req_ids[i], seq_lens[i], values[first])
        return SampleResult(sampled, None, {})
