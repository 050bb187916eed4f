"""Verification of drafts: the rejection sampler a model runner calls, and its torch reference.

The sampler sees the target's raw logits at every sampled row (``len(drafts) + 1`` rows per
request: one per draft plus the bonus row; one row for a request without drafts) and applies the
normal sampler's processing to each row before accepting or rejecting (:mod:`.sampler`): logit
bias, min_tokens, penalties (the drafts before a row count as generated output), then greedy
argmax, or temperature, min-p, top-k and top-p. The accept/reject step runs in the Triton kernel
(``specloop.kernels.rejection_sample``) on CUDA and in :func:`rejection_sample_torch` elsewhere;
both draw the same counter-hashed noise as the normal sampler, so a request without drafts samples
the very token :func:`.sampler.sample` would. The reference is written the way gpt-fast's
``speculative_decode`` is, batched over requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from . import sampler as sampling
from .noise import exponential_noise, hashed_uniform, position_key

PLACEHOLDER_TOKEN_ID = -1

Backend = Literal["auto", "triton", "torch"]


@dataclass(slots=True)
class VerifyResult:
    """One verification. Set by :class:`RejectionSampler`."""

    sampled_token_ids: list[list[int]]  # per request: accepted drafts + the target's token
    num_accepted: list[int]  # per request; the rest of its drafts were rejected
    num_rejected: list[int]


class RejectionSampler:
    """Callable with the torch runner's ``rejection_sampler`` signature.

    :param backend: ``"triton"`` forces the kernel (under ``TRITON_INTERPRET=1`` it runs on CPU
        tensors), ``"torch"`` the reference; ``"auto"`` picks the kernel for CUDA logits.
    :param rows_per_program: requests per kernel program; 1 (one program per request) on the GPU.
    """

    def __init__(self, backend: Backend = "auto", rows_per_program: int = 1) -> None:
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"unknown rejection-sampler backend {backend!r}")
        self.backend = backend
        self.rows_per_program = rows_per_program

    def __call__(self, *, logits: torch.Tensor, metadata: sampling.SamplingMetadata,
                 spec_token_ids: Sequence[Sequence[int]], num_rows: Sequence[int],
                 draft_probs: Sequence[torch.Tensor | None] | None = None) -> list[list[int]]:
        """``logits`` ``[R, V]`` holds, request after request, ``num_rows[i]`` rows (0 for a request
        that samples nothing this step); ``metadata`` describes the same rows.
        ``draft_probs[i]``, when given, is ``[>= len(spec_token_ids[i]), V]``: the distribution
        each draft was sampled from (None: the draft was deterministic, one-hot)."""
        return self.verify(logits, metadata, spec_token_ids, num_rows, draft_probs).sampled_token_ids

    def verify(self, logits: torch.Tensor, meta: sampling.SamplingMetadata, spec_token_ids: Sequence[Sequence[int]],
               num_rows: Sequence[int], draft_probs: Sequence[torch.Tensor | None] | None = None) -> VerifyResult:
        device = logits.device
        live = [i for i, n in enumerate(num_rows) if n]
        counts = [num_rows[i] for i in live]
        for i in live:
            if num_rows[i] != len(spec_token_ids[i]) + 1:
                raise ValueError(f"request {i}: {num_rows[i]} rows for {len(spec_token_ids[i])} drafts")
        if sum(counts) != logits.shape[0]:
            raise ValueError(f"logits has {logits.shape[0]} rows, num_rows adds up to {sum(counts)}")
        if not live:
            return VerifyResult([[] for _ in num_rows], [0] * len(num_rows), [0] * len(num_rows))
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        first = torch.tensor(cu[:-1], dtype=torch.int64, device=device)
        draft_rows = [list(spec_token_ids[i]) + [0] for i in live]  # the bonus row verifies nothing
        draft_ids = torch.tensor([t for row in draft_rows for t in row], dtype=torch.int32, device=device)

        processed = sampling.process_logits(logits, meta)
        target_argmax = processed.argmax(dim=-1)
        target_probs = None if meta.all_greedy else sampling.probabilities(processed, meta).contiguous()
        q = None
        if target_probs is not None and draft_probs is not None and any(draft_probs[i] is not None for i in live):
            q = self._stack_draft_probs(draft_probs, live, spec_token_ids, draft_ids, cu, target_probs)

        args = (target_probs, target_argmax, draft_ids, q, torch.tensor(cu, dtype=torch.int32, device=device),
                meta.greedy[first], meta.seeds[first], meta.positions[first], max(counts) - 1)
        if self._use_kernel(device):
            from specloop.kernels.rejection_sample import rejection_sample

            out, accepted = rejection_sample(*args, rows_per_program=self.rows_per_program)
        else:
            out, accepted = rejection_sample_torch(*args)
        out_l, acc_l = out.tolist(), accepted.tolist()
        sampled: list[list[int]] = [[] for _ in num_rows]
        num_accepted = [0] * len(num_rows)
        num_rejected = [0] * len(num_rows)
        for k, i in enumerate(live):
            sampled[i] = out_l[k][:acc_l[k] + 1]
            num_accepted[i] = acc_l[k]
            num_rejected[i] = len(spec_token_ids[i]) - acc_l[k]
        return VerifyResult(sampled, num_accepted, num_rejected)

    def _use_kernel(self, device: torch.device) -> bool:
        if self.backend == "auto":
            return device.type == "cuda"
        return self.backend == "triton"

    @staticmethod
    def _stack_draft_probs(draft_probs: Sequence[torch.Tensor | None], live: list[int],
                           spec_token_ids: Sequence[Sequence[int]], draft_ids: torch.Tensor, cu: list[int],
                           target_probs: torch.Tensor) -> torch.Tensor:
        """``[R, V]`` aligned with the logits rows: each request's draft distributions, one-hot rows
        for deterministic drafts, zeros at bonus rows."""
        q = torch.zeros_like(target_probs)
        for k, i in enumerate(live):
            n = len(spec_token_ids[i])
            if not n:
                continue
            rows = slice(cu[k], cu[k] + n)
            probs = draft_probs[i]
            if probs is None:
                q[rows].scatter_(1, draft_ids[rows].long()[:, None], 1.0)
            else:
                q[rows] = probs[:n].to(device=q.device, dtype=q.dtype)
        return q


def rejection_sample_torch(
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    cu_num_logits: torch.Tensor,
    greedy: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_spec_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept/reject every request's drafts; the arguments and results of
    :func:`specloop.kernels.rejection_sample.rejection_sample`."""
    device = target_argmax.device
    num_reqs = cu_num_logits.numel() - 1
    cu = cu_num_logits.to(torch.int64)
    start, num_drafts = cu[:-1], cu[1:] - cu[:-1] - 1
    j = torch.arange(max_spec_len, device=device)
    valid = j[None, :] < num_drafts[:, None]
    rows = start[:, None] + torch.minimum(j[None, :], num_drafts[:, None].clamp_min(0))
    draft = draft_token_ids.to(torch.int64)[rows]

    ok = target_argmax[rows].to(torch.int64) == draft
    sampled = ~greedy.to(torch.bool)
    if target_probs is not None and bool(sampled.any()):
        p_d = target_probs[rows, draft]
        q_d = draft_probs[rows, draft] if draft_probs is not None else torch.ones_like(p_d)
        u = hashed_uniform(position_key(seeds[:, None], positions[:, None] + j[None, :]), 0)
        # accept with prob min(1, p/q): u < p/q, written as u*q < p so that q == 0 cannot divide
        ok = torch.where(sampled[:, None], u * q_d < p_d, ok)
    ok &= valid
    # accept_length: drafts accepted before the first rejection
    stop = ok.to(torch.int64).cumprod(dim=1).sum(dim=1) if max_spec_len else torch.zeros_like(start)
    final_row = start + stop
    rejected = stop < num_drafts

    token = target_argmax[final_row].to(torch.int64)
    if target_probs is not None and bool(sampled.any()):
        idx = sampled.nonzero().squeeze(1)
        p = target_probs[final_row[idx]]
        d = draft_token_ids.to(torch.int64)[final_row[idx]]  # the rejected draft (bonus row: unused)
        if draft_probs is not None:
            q = draft_probs[final_row[idx]] * rejected[idx, None]
        else:
            q = torch.zeros_like(p).scatter_(1, d[:, None], 1.0) * rejected[idx, None]
        # else sample from norm(max(p - q, 0)) (at the bonus row q = 0, so from p)
        e = exponential_noise(position_key(seeds[idx], positions[idx] + stop[idx]), p.shape[1])
        score = (p - q).clamp_min(0.0) / e
        best, best_id = score.max(dim=1)
        # An all-zero residual after a rejection means p == q up to rounding, where the draft is
        # accepted with probability 1 - O(eps): keep the draft.
        token[idx] = torch.where(best > 0, best_id, d)

    out = torch.where(j[None, :] < stop[:, None], draft, PLACEHOLDER_TOKEN_ID)
    out = torch.cat([out, torch.full((num_reqs, 1), PLACEHOLDER_TOKEN_ID, device=device, dtype=torch.int64)], 1)
    out.scatter_(1, stop[:, None], token[:, None])
    return out.to(torch.int32), stop.to(torch.int32)
