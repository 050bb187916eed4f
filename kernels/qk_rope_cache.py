"""One kernel for everything between the qkv projection and attention, per token: the optional
per-head RMSNorm of q and k (Qwen3), the rotary embedding of q and k, and the KV write into the
paged cache. Replaces four launches per layer (q norm, k norm, rotary, KV write) with one.

Rounding is written as the separate kernels' (and Hugging Face's): the normalised head rounded to
the activation dtype before its weight multiplies it, then rotated with the tables rounded to that
dtype and each product and the sum rounded (the GPU compiler may keep intermediates in float32). q is rotated in place (attention reads it next); the
rotated k and the untouched v go straight to ``slot_mapping[t]`` of the caches (slot -1: no write).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_previous


@triton.jit
def _norm_heads(x1, x2, w_ptr, eps, HALF: tl.constexpr):
    # RMS over the whole head (both halves), float32 statistics, HF rounding.
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    ms = (tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF)
    rstd = 1.0 / tl.sqrt(ms + eps)
    dims = tl.arange(0, HALF)
    w1 = tl.load(w_ptr + dims).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + dims).to(tl.float32)
    n1 = (f1 * rstd[:, None]).to(dt).to(tl.float32) * w1[None, :]
    n2 = (f2 * rstd[:, None]).to(dt).to(tl.float32) * w2[None, :]
    return n1.to(dt), n2.to(dt)


@triton.jit
def _rope(x1, x2, c, s):
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    a1 = (f1 * c).to(dt).to(tl.float32)
    b1 = (-f2 * s).to(dt).to(tl.float32)
    a2 = (f2 * c).to(dt).to(tl.float32)
    b2 = (f1 * s).to(dt).to(tl.float32)
    return (a1 + b1).to(dt), (a2 + b2).to(dt)


class DecodeRope(NamedTuple):
    """A decode step's q/k norms, rotary embedding and KV write, done inside the attention kernel
    (``kernels.paged_attention.paged_attention(rope=...)``), rounded as :func:`qk_rope_cache`
    rounds them: one launch a layer fewer at batch 1."""

    positions: torch.Tensor  # [num_tokens], each new token's position
    cos: torch.Tensor  # float32 [max_position, head_dim / 2]
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens], cache slot of each new token (-1: no write)
    q_norm_weight: torch.Tensor | None = None  # per-head RMSNorm of q and k (Qwen3), both or neither
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


@triton.jit
def rope_heads(x_ptr, offs, row_base, pos, cos_ptr, sin_ptr, w_ptr, eps, ok, dims, HEAD_DIM: tl.constexpr,
                HAS_NORM: tl.constexpr):
    """Heads ``[rows, HEAD_DIM]`` at ``x_ptr + offs`` (``row_base``: each row's first element)
    normed (optional) and rotated at positions ``pos`` [rows], rounded as
    ``kernels.qk_rope_cache`` rounds them: every element is computed with its rotary partner (the
    other half's element), read a second time, so the head stays one tile."""
    HALF: tl.constexpr = HEAD_DIM // 2
    partner = (dims + HALF) % HEAD_DIM
    mask = ok[:, None] & (dims[None, :] < HEAD_DIM)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    xp = tl.load(x_ptr + row_base[:, None] + partner[None, :], mask=mask, other=0.0)
    dt = x.dtype
    f = x.to(tl.float32)
    fp = xp.to(tl.float32)
    if HAS_NORM:  # RMS over the whole head, float32 statistics, HF rounding
        rstd = 1.0 / tl.sqrt(tl.sum(f * f, 1) / HEAD_DIM + eps)
        f = (f * rstd[:, None]).to(dt).to(tl.float32) * tl.load(w_ptr + dims).to(tl.float32)[None, :]
        fp = (fp * rstd[:, None]).to(dt).to(tl.float32) * tl.load(w_ptr + partner).to(tl.float32)[None, :]
        f = f.to(dt).to(tl.float32)
        fp = fp.to(dt).to(tl.float32)
    half = dims % HALF
    c = tl.load(cos_ptr + pos[:, None] * HALF + half[None, :], mask=mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos[:, None] * HALF + half[None, :], mask=mask, other=0.0).to(dt).to(tl.float32)
    sign = tl.where(dims < HALF, -1.0, 1.0)[None, :]  # first half: x1 c - x2 s; second: x2 c + x1 s
    return ((f * c).to(dt).to(tl.float32) + (sign * fp * s).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _qk_rope_cache_kernel(
    qkv_ptr, stride_t, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, eps,
    k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_cb, stride_cs, stride_ch, stride_vb, stride_vs, stride_vh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * HALF + dims)[None, :]
    s = tl.load(sin_ptr + pos * HALF + dims)[None, :]
    row = qkv_ptr + t * stride_t
    head_dim: tl.constexpr = 2 * HALF
    c = c.to(row.dtype.element_ty).to(tl.float32)
    s = s.to(row.dtype.element_ty).to(tl.float32)

    qh = tl.arange(0, Q_PAD)[:, None]
    q_ok = qh < NUM_Q_HEADS
    q_ptrs = row + qh * head_dim + dims[None, :]
    q1 = tl.load(q_ptrs, mask=q_ok, other=0.0)
    q2 = tl.load(q_ptrs + HALF, mask=q_ok, other=0.0)
    if HAS_NORM:
        q1, q2 = _norm_heads(q1, q2, q_w_ptr, eps, HALF)
    q1, q2 = _rope(q1, q2, c, s)
    tl.store(q_ptrs, q1, mask=q_ok)
    tl.store(q_ptrs + HALF, q2, mask=q_ok)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        kh = tl.arange(0, KV_PAD)[:, None]
        kv_ok = kh < NUM_KV_HEADS
        k_ptrs = row + (NUM_Q_HEADS + kh) * head_dim + dims[None, :]
        k1 = tl.load(k_ptrs, mask=kv_ok, other=0.0)
        k2 = tl.load(k_ptrs + HALF, mask=kv_ok, other=0.0)
        if HAS_NORM:
            k1, k2 = _norm_heads(k1, k2, k_w_ptr, eps, HALF)
        k1, k2 = _rope(k1, k2, c, s)
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        kc = k_cache_ptr + page * stride_cb + offset * stride_cs + kh * stride_ch + dims[None, :]
        tl.store(kc, k1, mask=kv_ok)
        tl.store(kc + HALF, k2, mask=kv_ok)
        v_ptrs = row + (NUM_Q_HEADS + NUM_KV_HEADS + kh) * head_dim + dims[None, :]
        vc = v_cache_ptr + page * stride_vb + offset * stride_vs + kh * stride_vh + dims[None, :]
        tl.store(vc, tl.load(v_ptrs, mask=kv_ok, other=0.0), mask=kv_ok)
        tl.store(vc + HALF, tl.load(v_ptrs + HALF, mask=kv_ok, other=0.0), mask=kv_ok)


def qk_rope_cache(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                  k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``qkv``: ``[T, (Hq + 2 Hkv) * D]`` (q heads, then k, then v; unit last stride). Returns the
    rotated q as a ``[T, Hq, D]`` view of ``qkv``; k and v land in the caches
    (``[num_blocks, page_size, Hkv, D]``)."""
    tokens, width = qkv.shape
    head_dim = width // (num_q_heads + 2 * num_kv_heads)
    half = head_dim // 2
    if head_dim * (num_q_heads + 2 * num_kv_heads) != width or half & (half - 1) or head_dim % 2:
        raise ValueError(f"qkv width {width} is not (Hq + 2 Hkv) x D with D twice a power of two")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not match {num_kv_heads} x {head_dim}")
    if qkv.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or k_cache.dtype != qkv.dtype:
        raise ValueError("qkv and the caches need a unit last stride and one dtype")
    if cos.shape != sin.shape or cos.shape[-1] != half or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32 [max_position, {half}]")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q and k norm weights or neither")
    q = qkv[:, :num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
    if tokens == 0:
        return q
    has_norm = q_norm_weight is not None
    _qk_rope_cache_kernel[(tokens,)](
        qkv, qkv.stride(0), positions, cos, sin,
        q_norm_weight if has_norm else cos, k_norm_weight if has_norm else cos, eps,
        k_cache, v_cache, slot_mapping,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        Q_PAD=triton.next_power_of_2(num_q_heads), KV_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, PAGE_SIZE=k_cache.shape[1], HAS_NORM=has_norm, num_warps=4,
        **pdl.launch_options(qkv.device),
    )
    return q
