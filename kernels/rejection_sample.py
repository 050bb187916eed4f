"""Rejection sampling for speculative decoding: one Triton program per request (vLLM's layout).

Layout (vLLM's flattened one): request ``r`` owns logits rows ``cu_num_logits[r] ..
cu_num_logits[r + 1] - 1``; the first ``n_r = cu_num_logits[r + 1] - cu_num_logits[r] - 1`` rows
verify its drafts and the last row is the bonus position. ``draft_token_ids`` is aligned with the
logits rows (row ``t`` holds the draft verified at row ``t``; bonus rows are ignored).

Per request, left to right over its drafts:

* greedy rows accept while the target's argmax equals the draft; the first mismatch emits the
  argmax; if every draft is accepted, the argmax at the bonus row is appended;
* sampled rows accept draft ``d`` with probability ``min(1, p(d) / q(d))``; at the first rejection
  they emit a sample of ``normalize(max(p - q, 0))``; if every draft is accepted they append a
  sample of ``p`` at the bonus row. Without draft probabilities ``q`` is one-hot at the draft.

Randomness is a counter-based hash of (request seed, sequence position, index): the acceptance
uniform of position ``s`` uses index 0, the exponential noise of vocabulary id ``v`` index
``v + 1``. A seeded request therefore samples the same tokens whatever else is in the batch, on
every run. ``specloop.sampling.noise`` holds the torch implementation of the same hash and
the same algorithm (the reference this kernel is tested against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PLACEHOLDER_TOKEN_ID = -1


@triton.jit
def _mix32(x):
    # Wellons' "lowbias32" finaliser on uint32 lanes (wrapping multiplies).
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _position_key(seed, position):
    seed_lo = seed.to(tl.uint32)
    seed_hi = (seed >> 32).to(tl.uint32)
    return _mix32(_mix32(_mix32(seed_lo) ^ seed_hi) + position.to(tl.uint32))


@triton.jit
def _uniform(key, index):
    # 23 random bits, centred in their bucket: strictly inside (0, 1) and exact in float32.
    h = _mix32(_mix32(key + index.to(tl.uint32) * 0x9E3779B9))
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _rejection_sample_kernel(
    out_ptr, out_stride,
    num_accepted_ptr,
    draft_ptr,
    draft_probs_ptr, draft_probs_stride,
    target_probs_ptr, target_probs_stride,
    target_argmax_ptr,
    cu_ptr, greedy_ptr, seed_ptr, pos_ptr,
    num_reqs, vocab_size, max_spec_len,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < num_reqs
    start = tl.load(cu_ptr + rows, mask=rmask, other=0)
    num_drafts = tl.maximum(tl.load(cu_ptr + rows + 1, mask=rmask, other=0) - start - 1, 0)
    greedy = tl.load(greedy_ptr + rows, mask=rmask, other=1) != 0
    sampled = rmask & (greedy == 0)
    seed = tl.load(seed_ptr + rows, mask=rmask, other=0)
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0)

    stop = num_drafts
    running = rmask
    for j in range(0, max_spec_len):
        live = running & (j < num_drafts)
        t = (start + j).to(tl.int64)
        d = tl.load(draft_ptr + t, mask=live, other=0).to(tl.int64)
        argmax = tl.load(target_argmax_ptr + t, mask=live & greedy, other=-1)
        p_d = tl.load(target_probs_ptr + t * target_probs_stride + d, mask=live & sampled, other=0.0)
        if HAS_DRAFT_PROBS:
            q_d = tl.load(draft_probs_ptr + t * draft_probs_stride + d, mask=live & sampled, other=1.0)
        else:
            q_d = tl.full([BLOCK_R], 1.0, tl.float32)
        u = _uniform(_position_key(seed, pos + j), tl.zeros([BLOCK_R], tl.int32))
        # accept with prob min(1, p/q): u < p/q, written as u*q < p so that q == 0 cannot divide
        ok = tl.where(greedy, argmax == d, u * q_d < p_d)
        tl.store(out_ptr + rows.to(tl.int64) * out_stride + j, d.to(tl.int32), mask=live & ok)
        stop = tl.where(live & (ok == 0), j, stop)
        running = running & (ok | (live == 0))

    final_row = (start + stop).to(tl.int64)
    rejected = stop < num_drafts
    token = tl.load(target_argmax_ptr + final_row, mask=rmask & greedy, other=0).to(tl.int64)
    if tl.sum(sampled.to(tl.int32)) > 0:
        d = tl.load(draft_ptr + final_row, mask=sampled, other=0).to(tl.int64)
        key = _position_key(seed, pos + stop)
        best = tl.full([BLOCK_R], -1.0, tl.float32)
        best_id = tl.zeros([BLOCK_R], tl.int64)
        for v0 in range(0, vocab_size, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            m = sampled[:, None] & (cols < vocab_size)[None, :]
            p = tl.load(target_probs_ptr + final_row[:, None] * target_probs_stride + cols[None, :],
                        mask=m, other=0.0)
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + final_row[:, None] * draft_probs_stride + cols[None, :],
                            mask=m & rejected[:, None], other=0.0)
            else:
                q = tl.where(rejected[:, None] & (cols[None, :] == d[:, None]), 1.0, 0.0)
            # else sample from norm(max(p - q, 0)) (at the bonus row q = 0, so from p): the
            # exponential race argmax(r / E), E ~ Exp(1), needs no normalisation
            e = -tl.log(_uniform(key[:, None], cols[None, :] + 1))
            score = tl.where(m, tl.maximum(p - q, 0.0) / e, -1.0)
            block_best = tl.max(score, axis=1)
            block_id = tl.argmax(score, axis=1).to(tl.int64) + v0
            better = block_best > best
            best = tl.where(better, block_best, best)
            best_id = tl.where(better, block_id, best_id)
        # An all-zero residual after a rejection means p == q up to rounding, where the draft is
        # accepted with probability 1 - O(eps): keep the draft.
        token = tl.where(sampled, tl.where(best > 0.0, best_id, d), token)
    tl.store(out_ptr + rows.to(tl.int64) * out_stride + stop, token.to(tl.int32), mask=rmask)
    tl.store(num_accepted_ptr + rows, stop.to(tl.int32), mask=rmask)


def rejection_sample(
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    cu_num_logits: torch.Tensor,
    greedy: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_spec_len: int,
    *,
    rows_per_program: int = 1,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel.

    :param target_probs: ``[T, V]`` float32 target probabilities (processed: temperature, top-k/p,
        min-p, penalties). May be None when every request is greedy.
    :param target_argmax: ``[T]`` argmax of the processed target logits (read for greedy rows).
    :param draft_token_ids: ``[T]`` draft verified at each row.
    :param draft_probs: ``[T, V]`` float32 draft probabilities, or None for one-hot drafts.
    :param cu_num_logits: ``[B + 1]`` int32 prefix sums of logits rows per request.
    :param greedy: ``[B]`` bool.
    :param seeds: ``[B]`` int64 per-request seeds.
    :param positions: ``[B]`` int64 sequence position of each request's first row's sample.
    :param max_spec_len: at least the largest ``n_r`` in the batch.
    :param rows_per_program: requests per program; 1 on the GPU (one program per request), larger
        under ``TRITON_INTERPRET=1`` where each program costs Python overhead.
    :returns: ``(output_token_ids [B, max_spec_len + 1] int32`` padded with
        ``PLACEHOLDER_TOKEN_ID``, ``num_accepted [B] int32)``; request ``r`` emitted
        ``num_accepted[r] + 1`` tokens.
    """
    num_reqs = cu_num_logits.numel() - 1
    num_rows = target_argmax.numel()
    device = target_argmax.device
    if num_reqs < 0 or cu_num_logits.dtype != torch.int32:
        raise ValueError("cu_num_logits must be an int32 tensor of shape [B + 1]")
    for name, t, shape in (("greedy", greedy, (num_reqs,)), ("seeds", seeds, (num_reqs,)),
                           ("positions", positions, (num_reqs,)), ("draft_token_ids", draft_token_ids, (num_rows,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError("seeds and positions must be int64")
    vocab_size = 0
    for name, probs in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if probs is None:
            continue
        if probs.dim() != 2 or probs.shape[0] != num_rows or probs.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [{num_rows}, V], got {probs.dtype} {tuple(probs.shape)}")
        if probs.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along the vocabulary")
        if vocab_size and probs.shape[1] != vocab_size:
            raise ValueError("target_probs and draft_probs disagree on the vocabulary size")
        vocab_size = probs.shape[1]
    if target_probs is None and not bool(greedy.all()):
        raise ValueError("target_probs is required when any request samples")
    out = torch.full((num_reqs, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int32, device=device)
    if num_reqs == 0:
        return out, num_accepted
    dummy = target_argmax.new_empty(0, dtype=torch.float32)
    tp = target_probs if target_probs is not None else dummy
    dp = draft_probs if draft_probs is not None else dummy
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    # Keep a program's tile near 8k elements: wide vocabulary blocks for one request on the GPU,
    # narrow ones when many requests share a program.
    block_v = block_v or min(triton.next_power_of_2(max(vocab_size, 1)), max(16, 8192 // rows_per_program))
    grid = (triton.cdiv(num_reqs, rows_per_program),)
    _rejection_sample_kernel[grid](
        out, out.stride(0), num_accepted,
        draft_token_ids,
        dp, dp.stride(0) if draft_probs is not None else 0,
        tp, tp.stride(0) if target_probs is not None else 0,
        target_argmax,
        cu_num_logits, greedy.to(torch.int8), seeds, positions,
        num_reqs, vocab_size, max_spec_len,
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK_R=rows_per_program,
        BLOCK_V=block_v,
    )
    return out, num_accepted
