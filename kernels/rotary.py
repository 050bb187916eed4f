"""Rotary position embedding (the "neox" half-split layout of Llama and Qwen), in place on the query
and key heads of each token.

``cos``/``sin`` are float32 tables ``[max_position, head_dim // 2]`` built by the model, so the
frequencies (including Llama-3's scaled ones) come from one place. Rounding is written as Hugging
Face's ``q * cos + rotate_half(q) * sin`` in the activation dtype (tables, products and sum rounded);
on the GPU the compiler may keep the products in float32 (2e-3 relative in bf16, measured).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, t, cos, sin,
            NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    ok = heads < NUM_HEADS
    base = x_ptr + t * stride_t + heads * stride_h + dims
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    dt = x1.dtype
    c = cos.to(dt).to(tl.float32)
    s = sin.to(dt).to(tl.float32)
    a1 = (x1.to(tl.float32) * c).to(dt).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s).to(dt).to(tl.float32)
    tl.store(base, (a1 + b1).to(dt), mask=ok)
    tl.store(base + HALF, (a2 + b2).to(dt), mask=ok)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + pos * HALF + dims)
    sin = tl.load(sin_ptr + pos * HALF + dims)
    _rotate(q_ptr, stride_qt, stride_qh, t, cos, sin, NUM_Q_HEADS, Q_HEADS_PAD, HALF)
    _rotate(k_ptr, stride_kt, stride_kh, t, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """Rotate ``q`` ``[num_tokens, num_q_heads, head_dim]`` and ``k`` ``[num_tokens, num_kv_heads,
    head_dim]`` in place (they may be strided views into one fused projection)."""
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree")
    if head_dim % 2 or half & (half - 1):
        raise ValueError(f"head_dim must be twice a power of two, got {head_dim}")
    if cos.shape != sin.shape or cos.shape[-1] != half or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32 [max_position, {half}], got {tuple(cos.shape)} {cos.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("q and k need a unit stride on head_dim; cos/sin must be contiguous")
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=k.shape[1],
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF=half, num_warps=4,
    )
