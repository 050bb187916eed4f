"""One kernel for everything between MLA's projections and its attention, per token: the RMSNorm of
the latent ``c_kv``, the rotary embedding of the shared key ``k_rope`` and of every head's ``q_rope``,
and the write of ``[normalised c_kv | rotated k_rope]`` into the latent paged cache.

Rounding as the separate steps' (and Hugging Face's): float32 statistics, the normalised row rounded
to the activation dtype before its weight multiplies it; rotation with the tables rounded to that
dtype, each product and the sum rounded (the GPU compiler may keep intermediates in float32).
``q_rope`` is rotated in place; slot ``-1`` (CUDA-graph padding) writes no cache row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_previous
from .qk_rope_cache import _rope


@triton.jit
def _rope_cache_token(
    t, q_ptr, latent_ptr, pos_ptr, cos_ptr, sin_ptr, w_ptr, eps, cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_lt, stride_cb, stride_cs,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    t = t.to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    d_ok = dims < HALF
    dt = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * HALF + dims, mask=d_ok, other=0.0).to(dt).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * HALF + dims, mask=d_ok, other=0.0).to(dt).to(tl.float32)[None, :]

    heads = tl.arange(0, HEADS_PAD)[:, None]
    q_ok = (heads < NUM_HEADS) & d_ok[None, :]
    q_ptrs = q_ptr + t * stride_qt + heads * stride_qh + dims[None, :]
    q1, q2 = _rope(tl.load(q_ptrs, mask=q_ok, other=0.0), tl.load(q_ptrs + HALF, mask=q_ok, other=0.0), c, s)
    tl.store(q_ptrs, q1, mask=q_ok)
    tl.store(q_ptrs + HALF, q2, mask=q_ok)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        row = latent_ptr + t * stride_lt
        dst = cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
        r = tl.arange(0, RANK_PAD)
        r_ok = r < RANK
        x = tl.load(row + r, mask=r_ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / RANK + eps)
        w = tl.load(w_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
        normed = (x * rstd).to(dt).to(tl.float32) * w
        tl.store(dst + r, normed.to(cache_ptr.dtype.element_ty), mask=r_ok)
        k1 = tl.load(row + RANK + dims, mask=d_ok, other=0.0)[None, :]
        k2 = tl.load(row + RANK + HALF + dims, mask=d_ok, other=0.0)[None, :]
        k1, k2 = _rope(k1, k2, c, s)
        tl.store(dst + RANK + dims[None, :], k1.to(cache_ptr.dtype.element_ty), mask=d_ok[None, :])
        tl.store(dst + RANK + HALF + dims[None, :], k2.to(cache_ptr.dtype.element_ty), mask=d_ok[None, :])


@triton.jit
def _mla_rope_cache_kernel(
    q_ptr, latent_ptr, pos_ptr, cos_ptr, sin_ptr, w_ptr, eps, cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_lt, stride_cb, stride_cs,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, PDL: tl.constexpr,
):
    wait_previous(PDL)
    _rope_cache_token(tl.program_id(0), q_ptr, latent_ptr, pos_ptr, cos_ptr, sin_ptr, w_ptr, eps, cache_ptr, slot_ptr,
                      stride_qt, stride_qh, stride_lt, stride_cb, stride_cs, NUM_HEADS, HEADS_PAD, RANK, RANK_PAD,
                      HALF, HALF_PAD, PAGE_SIZE)


def mla_rope_cache(q_rope: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, norm_weight: torch.Tensor, eps: float, cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """``q_rope`` ``[T, H, R]`` (a strided view into the query, rotated in place); ``latent``
    ``[T, kv_lora_rank + R]`` (unit last stride); ``cos``/``sin`` float32 ``[max_position, R / 2]``;
    ``cache`` ``[num_blocks, page_size, kv_lora_rank + R]``; ``slot_mapping`` ``[>= T]``."""
    check_rope_cache(q_rope, latent, cos, sin, norm_weight, cache, slot_mapping)
    tokens, heads, rope = q_rope.shape
    rank, half = latent.shape[1] - rope, rope // 2
    if tokens == 0:
        return
    _mla_rope_cache_kernel[(tokens,)](
        q_rope, latent, positions, cos, sin, norm_weight, eps, cache, slot_mapping,
        q_rope.stride(0), q_rope.stride(1), latent.stride(0), cache.stride(0), cache.stride(1),
        NUM_HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), RANK=rank, RANK_PAD=triton.next_power_of_2(rank),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), PAGE_SIZE=cache.shape[1], num_warps=4,
        **pdl.launch_options(q_rope.device),
    )


def check_rope_cache(q_rope: torch.Tensor, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     norm_weight: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the arguments of :func:`mla_rope_cache` agree."""
    tokens, heads, rope = q_rope.shape
    rank = latent.shape[1] - rope
    half = rope // 2
    if rope % 2 or latent.shape[0] != tokens or norm_weight.numel() != rank or cache.shape[-1] != rank + rope:
        raise ValueError(f"q_rope {tuple(q_rope.shape)}, latent {tuple(latent.shape)}, norm {tuple(norm_weight.shape)}"
                         f" and cache {tuple(cache.shape)} disagree")
    if cos.shape != sin.shape or cos.shape[-1] != half or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32 [max_position, {half}], got {tuple(cos.shape)} {cos.dtype}")
    if q_rope.stride(-1) != 1 or latent.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("q_rope, latent and the cache need a unit stride on their last dim")
    if slot_mapping.shape[0] < tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {tokens} tokens")
