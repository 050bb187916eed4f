"""Verification of drafts: the torch reference rejection sampler and the noise it draws.

``rejection_sample_torch`` is the reference for ``specloop.kernels.rejection_sample`` (same
arguments, same hash, same algorithm) and the implementation used off CUDA. It is written the way
gpt-fast's ``speculative_decode`` is, batched over requests.
"""

from __future__ import annotations

import torch

PLACEHOLDER_TOKEN_ID = -1


def _u32(c: int) -> int:
    # A uint32 constant as the int32 with the same bits (int32 products wrap like uint32 ones).
    return c - (1 << 32) if c >= 1 << 31 else c


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    # Logical right shift of int32 lanes (torch's >> is arithmetic).
    return (x >> n) & ((1 << (32 - n)) - 1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # Wellons' "lowbias32" finaliser on uint32 bit patterns held in int32.
    x = x ^ _shr(x, 16)
    x = x * _u32(0x7FEB352D)
    x = x ^ _shr(x, 15)
    x = x * _u32(0x846CA68B)
    return x ^ _shr(x, 16)


def position_key(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A 32-bit key (int32 bits) per (int64 seed, int64 sequence position); the kernel's
    ``_position_key``."""
    seed_lo = seeds.to(torch.int32)  # truncation keeps the low 32 bits
    seed_hi = (seeds >> 32).to(torch.int32)
    return _mix32(_mix32(_mix32(seed_lo) ^ seed_hi) + positions.to(torch.int32))


def hashed_uniform(key: torch.Tensor, index: torch.Tensor | int) -> torch.Tensor:
    """Uniform float32 in (0, 1) for (key, index), broadcasting; the kernel's ``_uniform``: 23
    random bits centred in their bucket, exact in float32."""
    index = torch.as_tensor(index, device=key.device).to(torch.int32)
    h = _mix32(_mix32(key + index * _u32(0x9E3779B9)))
    return (_shr(h, 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def exponential_noise(key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` i.i.d. Exp(1) draws, entry ``(b, v)`` from (``key[b]``, index ``v + 1``)."""
    vocab = torch.arange(vocab_size, device=key.device)
    return -torch.log(hashed_uniform(key[:, None], vocab[None, :] + 1))


def exponential_race(weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Sample one index per row of ``weights`` ``[B, V]`` (non-negative, not necessarily
    normalised) with the noise of ``key`` ``[B]``: ``argmax(w / E)``, ``E ~ Exp(1)`` per entry.
    Rows of zeros return 0."""
    return (weights / exponential_noise(key, weights.shape[-1])).argmax(dim=-1)


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
