"""Write this step's keys and values into the paged cache, one token per program.

``slot_mapping[t] = block * page_size + offset`` is the physical slot of packed token ``t``; a
negative slot (CUDA-graph padding) writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    ok = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=ok)
    tl.store(k_cache_ptr + page * stride_cb + offset * stride_cs + heads * stride_ch + dims, k, mask=ok)
    tl.store(v_cache_ptr + page * stride_vcb + offset * stride_vcs + heads * stride_vch + dims, v, mask=ok)


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``k``, ``v``: ``[num_tokens, num_kv_heads, head_dim]``; caches ``[num_blocks, page_size,
    num_kv_heads, head_dim]``; ``slot_mapping``: integer ``[num_tokens]``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} and caches {tuple(k_cache.shape)} disagree")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k, v and the caches need a unit stride on head_dim")
    if k_cache.dtype != k.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from k's {k.dtype}")
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_cache.shape[1], num_warps=4,
    )
