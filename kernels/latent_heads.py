"""DeepSeek's absorbed latent attention at one token: the per-head products around the attention,
each fused with the small kernel next to it.

At one token (a decode step at batch 1, an MTP draft) a latent attention layer is a handful of
kernels that each read little: the rotary and cache write (one program), ``W_UK`` folded into the
query, the attention over the latent cache, its flash-decoding merge, ``W_UV``. Each is a few
microseconds of launch and drain for well under a microsecond of bytes, so here they take three:

* :func:`rope_cache_uk`: ``q_nope @ W_UK`` per head, and in one more program of the same launch
  ``kernels.mla_rope_cache``'s work (the latent's norm, the rotary of the shared key and of every
  head's ``q_rope``, the cache write); the two read and write disjoint data;
* the attention, its splits left unmerged (:class:`SplitParts`);
* :func:`head_gemv` on those partials: each program merges its head's splits as
  ``kernels.splits``' reduction does (same weights, the merged row rounded to the
  activation dtype) and multiplies the row by its block of ``W_UV``.

A product accumulates in float32 and is rounded once, as ``torch.bmm`` rounds. A program owns
``BLOCK_N`` outputs of one head, as many as give every SM a program.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import pdl
from .gemv import _num_sms
from .mla_rope_cache import _rope_cache_token, check_rope_cache
from .pdl import wait_previous
from .splits import split_weights

BLOCK_K = 128
_FUSED = True  # the GPU runner's fused_latent option


def set_fused(on: bool) -> None:
    """Whether ``models.few_rows_ops`` runs one-token latent attention through this module's fused
    kernels (else the rotary, the merge and each product in their own)."""
    global _FUSED
    _FUSED = bool(on)


def fused() -> bool:
    return _FUSED


class SplitParts(NamedTuple):
    """One token's flash-decoding partials, not merged yet: float32 sums ``acc`` laid out
    ``[heads, splits, dim_pad]`` and ``ml`` ``[heads, splits, 2]`` (the running max, base 2, and the
    softmax denominator), as ``kernels.mla_attention`` writes them; the merged row has ``dim``
    values in ``dtype``."""

    acc: torch.Tensor
    ml: torch.Tensor
    heads: int
    splits: int
    dim: int
    dim_pad: int
    dtype: torch.dtype


@triton.jit
def _head_products(x_ptr, acc_ptr, ml_ptr, w_ptr, out_ptr, head, block, K, N, stride_xh, stride_wh, stride_wk,
                   stride_wn, stride_oh, SPLITS: tl.constexpr, K_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """``out[head, block's columns] = x[head] @ w[head][:, block's columns]``; with ``SPLITS > 1``
    the row ``x[head]`` is first merged from its splits' partial sums."""
    head = head.to(tl.int64)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    if SPLITS > 1:  # the merge's weights, as kernels.splits' reduction weighs them
        part = head * SPLITS + tl.arange(0, SPLITS)
        l, weight, denom = split_weights(ml_ptr, part)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        if SPLITS > 1:
            sums = tl.load(acc_ptr + part[:, None] * K_PAD + (k0 + ks)[None, :],
                           mask=(l > 0.0)[:, None] & k_ok[None, :], other=0.0)
            x = (tl.sum(sums * weight[:, None], 0) / denom).to(dtype).to(tl.float32)  # rounded as the merge stores it
        else:
            x = tl.load(x_ptr + head * stride_xh + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + head * stride_wh + (k0 + ks)[:, None].to(tl.int64) * stride_wk + cols[None, :] * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[:, None], 0)
    tl.store(out_ptr + head * stride_oh + cols, acc.to(dtype), mask=col_ok)


@triton.jit
def _head_gemv_kernel(x_ptr, acc_ptr, ml_ptr, w_ptr, out_ptr, K, N, stride_xh, stride_wh, stride_wk, stride_wn,
                      stride_oh, SPLITS: tl.constexpr, K_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)
    _head_products(x_ptr, acc_ptr, ml_ptr, w_ptr, out_ptr, tl.program_id(0), tl.program_id(1), K, N, stride_xh,
                   stride_wh, stride_wk, stride_wn, stride_oh, SPLITS, K_PAD, BLOCK_K, BLOCK_N)


@triton.jit
def _rope_cache_uk_kernel(
    qn_ptr, qr_ptr, latent_ptr, pos_ptr, cos_ptr, sin_ptr, nw_ptr, eps, cache_ptr, slot_ptr, w_ptr, out_ptr,
    stride_qh, stride_qrt, stride_qrh, stride_lt, stride_cb, stride_cs, K, N, stride_wh, stride_wk, stride_wn,
    stride_oh,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCKS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    wait_previous(PDL)
    pid = tl.program_id(0)
    if pid < NUM_HEADS * BLOCKS:
        _head_products(qn_ptr, qn_ptr, qn_ptr, w_ptr, out_ptr, pid // BLOCKS, pid % BLOCKS, K, N, stride_qh,
                       stride_wh, stride_wk, stride_wn, stride_oh, 1, 1, BLOCK_K, BLOCK_N)
    else:
        _rope_cache_token(pid - NUM_HEADS * BLOCKS, qr_ptr, latent_ptr, pos_ptr, cos_ptr, sin_ptr, nw_ptr, eps,
                          cache_ptr, slot_ptr, stride_qrt, stride_qrh, stride_lt, stride_cb, stride_cs, NUM_HEADS,
                          HEADS_PAD, RANK, RANK_PAD, HALF, HALF_PAD, PAGE_SIZE)


def _block_n(heads: int, n: int, num_sms: int | None, device: torch.device) -> int:
    num_sms = num_sms or _num_sms(device)
    return max(16, min(128, 1 << max(0, (heads * n // num_sms).bit_length() - 1)))


def _check_weights(heads: int, k: int, w: torch.Tensor) -> None:
    if w.dim() != 3 or w.shape[:2] != (heads, k):
        raise ValueError(f"{heads} heads of {k} values and w {tuple(w.shape)} disagree")


def head_gemv(x: torch.Tensor | SplitParts, w: torch.Tensor, num_sms: int | None = None) -> torch.Tensor:
    """One token's per-head products ``out[h] = x[h] @ w[h]``: ``x`` ``[H, K]`` (unit last stride) or
    the :class:`SplitParts` that merge into it, ``w`` ``[H, K, N]`` with any strides (unit along
    ``K`` or along ``N``: the load follows the contiguous one) -> ``[H, N]`` in ``x``'s dtype."""
    if isinstance(x, SplitParts):
        heads, k, dtype, device = x.heads, x.dim, x.dtype, x.acc.device
        if x.acc.numel() < heads * x.splits * x.dim_pad or x.ml.numel() < heads * x.splits * 2:
            raise ValueError(f"partials {x.acc.numel()} / {x.ml.numel()} too small for {heads} heads x "
                             f"{x.splits} splits")
        args, splits, k_pad, stride_xh = (x.acc, x.acc, x.ml), x.splits, x.dim_pad, 0
    else:
        heads, k = x.shape
        if x.stride(-1) != 1:
            x = x.contiguous()
        dtype, device = x.dtype, x.device
        args, splits, k_pad, stride_xh = (x, x, x), 1, 1, x.stride(0)
    _check_weights(heads, k, w)
    n = w.shape[2]
    out = torch.empty(heads, n, dtype=dtype, device=device)
    if heads == 0 or n == 0:
        return out
    block_n = _block_n(heads, n, num_sms, device)
    _head_gemv_kernel[(heads, triton.cdiv(n, block_n))](
        *args, w, out, k, n, stride_xh, w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        SPLITS=splits, K_PAD=k_pad, BLOCK_K=BLOCK_K, BLOCK_N=block_n, num_warps=4, **pdl.launch_options(device))
    return out


def rope_cache_uk(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float, cache: torch.Tensor,
                  slot_mapping: torch.Tensor, w_uk: torch.Tensor, num_sms: int | None = None) -> torch.Tensor:
    """For one token: ``kernels.mla_rope_cache.mla_rope_cache(q_rope, latent, ...)`` (``q_rope``
    ``[1, H, R]`` rotated in place, the cache row written) and, in the same launch, returns
    ``head_gemv(q_nope[0], w_uk)[None]`` (``q_nope`` ``[1, H, nope]``, ``w_uk`` ``[H, nope, rank]``)."""
    if q_nope.shape[0] != 1 or q_nope.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"one token's q_nope and q_rope, got {tuple(q_nope.shape)} and {tuple(q_rope.shape)}")
    check_rope_cache(q_rope, latent, cos, sin, norm_weight, cache, slot_mapping)
    heads, k = q_nope.shape[1:]
    if q_nope.stride(-1) != 1:
        raise ValueError("q_nope needs a unit last stride")
    _check_weights(heads, k, w_uk)
    n, rope = w_uk.shape[2], q_rope.shape[2]
    rank, half = latent.shape[1] - rope, rope // 2
    out = torch.empty(1, heads, n, dtype=q_nope.dtype, device=q_nope.device)
    block_n = _block_n(heads, n, num_sms, q_nope.device)
    blocks = triton.cdiv(n, block_n)
    _rope_cache_uk_kernel[(heads * blocks + 1,)](
        q_nope, q_rope, latent, positions, cos, sin, norm_weight, eps, cache, slot_mapping, w_uk, out,
        q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), latent.stride(0), cache.stride(0), cache.stride(1),
        k, n, w_uk.stride(0), w_uk.stride(1), w_uk.stride(2), out.stride(1),
        NUM_HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), RANK=rank, RANK_PAD=triton.next_power_of_2(rank),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), PAGE_SIZE=cache.shape[1], BLOCKS=blocks,
        BLOCK_K=BLOCK_K, BLOCK_N=block_n, num_warps=4, **pdl.launch_options(q_nope.device),
    )
    return out
