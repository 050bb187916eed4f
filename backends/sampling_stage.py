"""From one step's hidden states to its tokens: logits of the rows that need them, the sampling rows
and their parameters, sampling or verifying drafts (``specloop.sampling``), logprobs of the emitted
tokens and prompt logprobs.

This is the reference stage, on any device. The GPU runner composes a faster one around it
(``backends.gpu.fast_sampling``) and hands it everything that stage does not cover.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from specloop.kernel.outputs import TokenLogprobs
from specloop.sampling import sampler as sampling
from specloop.sampling.rejection import RejectionSampler
from specloop.sampling.structured_outputs import GrammarBitmask, allowed_ids_bitmask, apply_token_bitmask

from .batch import InputBatch
from .requests import CachedRequestState

Logprobs = list[list[TokenLogprobs] | None]


@dataclass(slots=True)
class SampleResult:
    """Per request in batch order: the emitted tokens (accepted drafts + the target's), their
    logprobs (None when not asked for), and prompt logprobs by request id. A deferred result has
    ``sampled`` empty and ``wait()`` returning it once the tokens reach the host."""

    sampled: list[list[int]]
    logprobs: Logprobs | None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]]
    wait: Callable[[], list[list[int]]] | None = None


def compute_logits(model: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(hidden_states).float()


class SamplingStage:
    """The reference: any device, every sampling parameter, drafts, logprobs."""

    def __init__(self, model: nn.Module, vocab_size: int, device: torch.device, use_kernels: bool = False) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.device = device
        self.use_kernels = use_kernels  # draw with the Gumbel-max kernel (batches without logprobs)
        self.rejection_sampler = RejectionSampler()
        # Per request, prompt-logprob entries already reported; survives preemption so that a
        # recomputed prefill does not report them twice.
        self.prompt_logprobs_sent: dict[str, int] = {}
        self.allowed_masks: dict[str, torch.Tensor] = {}  # packed allowed_token_ids, per request

    def forget(self, finished: Iterable[str]) -> None:
        for rid in finished:
            self.prompt_logprobs_sent.pop(rid, None)
            self.allowed_masks.pop(rid, None)

    def can_defer(self, batch: InputBatch) -> bool:
        return False

    def sample(self, batch: InputBatch, hidden_states: torch.Tensor, requests: dict[str, CachedRequestState],
               draft_probs: dict[str, torch.Tensor | None], defer: bool = False,
               grammar: GrammarBitmask | None = None,
               launch: Callable[[torch.Tensor], None] | None = None) -> SampleResult:
        """``launch``: a proposal the fast greedy path may start from the device (never called
        here: the drafting stage then proposes once the tokens are on the host)."""
        logits = self.logits(batch, hidden_states)
        meta, sample_logits = self.sampling_inputs(batch, logits, requests)
        self.apply_token_masks(batch, sample_logits, requests, grammar)
        sampled, logprobs = self.draw(batch, meta, sample_logits, draft_probs)
        return SampleResult(sampled, logprobs, self.prompt_logprobs(batch, logits, requests))

    def logits(self, batch: InputBatch, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits of ``batch.logits_indices``' rows, in that order. A step with no such
        row (only partial prefills) never calls the head: under tensor parallelism every rank
        must make the same calls, and the GPU stage skips it then too."""
        pre = batch.precomputed_logits  # every token row's, when a CUDA graph computed them
        if batch.logits_indices.shape[0] == 0:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if pre is None:
            return compute_logits(self.model, hidden_states[batch.logits_indices])
        return pre if batch.logits_indices.shape[0] == batch.num_tokens else pre.index_select(0, batch.logits_indices)

    def sampling_inputs(self, batch: InputBatch, logits: torch.Tensor, requests: dict[str, CachedRequestState]
                        ) -> tuple[sampling.SamplingMetadata, torch.Tensor]:
        """Sampling metadata and logits of every sampled row. Row ``j`` of a request verifying
        drafts sees the drafts before it as generated output (penalties, min_tokens)."""
        rows: list[sampling.SamplingRow] = []
        indices: list[int] = []
        for i, rid in enumerate(batch.req_ids):
            first, count = batch.sample_rows[i]
            if not count:
                continue
            state = requests[rid]
            params = state.sampling_params
            stop_ids = sampling.stop_token_ids(params, state.eos_token_ids)
            output = state.output_token_ids
            spec = batch.spec_token_ids[i]
            for j in range(count):
                rows.append(sampling.SamplingRow(params, state.seed, len(state.token_ids) + j,
                                                 state.prompt_token_ids, output + spec[:j], stop_ids))
                indices.append(first + j)
        meta = sampling.SamplingMetadata.build(rows, self.vocab_size, self.device)
        return meta, logits[torch.tensor(indices, dtype=torch.int64, device=logits.device)]

    def apply_token_masks(self, batch: InputBatch, logits: torch.Tensor, requests: dict[str, CachedRequestState],
                          grammar: GrammarBitmask | None) -> None:
        """In place, before sampling and verification (so a draft the grammar forbids is rejected):
        each structured row keeps only what its grammar allows at that position, and each row of a
        request with ``allowed_token_ids`` only those ids. The logprobs reported are then those of
        the masked distribution, as vLLM's are."""
        grammar_rows: dict[str, tuple[int, int]] = {}
        if grammar is not None:
            start = 0
            for rid, n in zip(grammar.req_ids, grammar.num_rows):
                grammar_rows[rid] = (start, n)
                start += n
            packed = torch.from_numpy(grammar.bitmask)
        masks, rows, row = [], [], 0
        for i, rid in enumerate(batch.req_ids):
            count = batch.sample_rows[i][1]
            if not count:
                continue
            allowed = self._allowed_mask(rid, requests[rid])
            span = grammar_rows.get(rid)
            if span is not None:
                if span[1] != count:
                    raise RuntimeError(f"request {rid!r}: {span[1]} grammar rows for {count} sampled rows")
                mask = packed[span[0]:span[0] + count]
                masks.append(mask & allowed if allowed is not None else mask)
            elif allowed is not None:
                masks.append(allowed.expand(count, -1))
            if span is not None or allowed is not None:
                rows.extend(range(row, row + count))
            row += count
        if rows:
            apply_token_bitmask(logits, torch.cat(masks).to(logits.device),
                                torch.tensor(rows, dtype=torch.int64, device=logits.device))

    def _allowed_mask(self, rid: str, state: CachedRequestState) -> torch.Tensor | None:
        ids = state.sampling_params.allowed_token_ids
        if ids is None:
            return None
        mask = self.allowed_masks.get(rid)
        if mask is None:
            mask = self.allowed_masks[rid] = allowed_ids_bitmask(ids, self.vocab_size)
        return mask

    def draw(self, batch: InputBatch, meta: sampling.SamplingMetadata, logits: torch.Tensor,
             draft_probs: dict[str, torch.Tensor | None]) -> tuple[list[list[int]], Logprobs | None]:
        """Sample every row or verify drafts, and gather logprobs of the emitted tokens."""
        counts = [count for _, count in batch.sample_rows]
        if any(batch.spec_token_ids):
            sampled = self.rejection_sampler(logits=logits, metadata=meta, spec_token_ids=batch.spec_token_ids,
                                             num_rows=counts, draft_probs=[draft_probs.get(r) for r in batch.req_ids])
        else:
            kernel = self.use_kernels and all(k is None for k in meta.num_logprobs)
            tokens = sampling.sample(logits, meta, use_kernel=kernel).tolist()
            sampled, first = [], 0
            for count in counts:  # one row per request that samples, none for partial prefills
                sampled.append(tokens[first:first + count])
                first += count
        if all(k is None for k in meta.num_logprobs):
            return sampled, None
        # Logprobs of the emitted tokens, each at the row that produced it.
        row_ids, emitted, first = [], [], 0
        for out, count in zip(sampled, counts):
            row_ids.extend(range(first, first + len(out)))
            emitted.extend(out)
            first += count
        index = torch.tensor(row_ids, dtype=torch.int64, device=logits.device)
        entries = sampling.compute_logprobs(logits[index], torch.tensor(emitted, dtype=torch.int64,
                                                                        device=logits.device),
                                            [meta.num_logprobs[r] for r in row_ids])
        logprobs: Logprobs = []
        pos = 0
        for out in sampled:
            chunk = entries[pos:pos + len(out)]
            pos += len(out)
            logprobs.append(chunk if chunk and chunk[0] is not None else None)
        return sampled, logprobs

    def prompt_logprobs(self, batch: InputBatch, logits: torch.Tensor, requests: dict[str, CachedRequestState]
                        ) -> dict[str, list[TokenLogprobs | None]]:
        """For requests with ``prompt_logprobs``: entries for prompt tokens ``s + 1 .. e`` scored by
        positions ``s .. e - 1`` computed this step, with a leading ``None`` (token 0 has no
        logprob) when the step starts at position 0. Concatenated over steps they cover the prompt
        once, in order, even when a preempted request recomputes its prefill."""
        out: dict[str, list[TokenLogprobs | None]] = {}
        for i, rid in enumerate(batch.req_ids):
            state = requests[rid]
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            first, count = batch.prompt_rows[i]
            start = batch.num_computed_tokens[i]
            entries: list[TokenLogprobs | None] = [None] if start == 0 else []
            if count:
                targets = torch.tensor(state.prompt_token_ids[start + 1:start + 1 + count], dtype=torch.int64,
                                       device=logits.device)
                entries.extend(sampling.compute_logprobs(logits[first:first + count], targets, [k] * count))
            # entries[j] is prompt token first_token + j
            first_token = 0 if start == 0 else start + 1
            sent = self.prompt_logprobs_sent.get(rid, 0)
            self.prompt_logprobs_sent[rid] = max(sent, first_token + len(entries))
            out[rid] = entries[max(0, sent - first_token):]
        return out
