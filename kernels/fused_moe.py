"""The routed experts of a mixture-of-experts layer as two grouped GEMMs.

Each token picked ``top_k`` experts: ``T * top_k`` (token, expert) pairs. :func:`sort_by_expert`
groups the pairs by expert (three small kernels: a rank within the expert by atomic counting, the
experts' padded offsets, the scatter) and pads each expert's run to a multiple of ``BLOCK_M``, so
every block of ``BLOCK_M`` sorted pairs belongs to one expert. :func:`_moe_gemm_kernel` then computes, per block,
its rows against that expert's weight matrix: once for gate/up (rows gathered from the tokens,
``[pairs, 2I]``), once for down (rows are the pairs, each output scaled by its routing weight,
``[pairs, H]``); SiLU-and-mul runs between them and a sum over each token's ``top_k`` rows ends it.

Everything has a size known from ``T`` alone (the sort pads to a worst case; blocks past the end
exit at once), so the layer runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ptr, expert_ptr, num_sorted_ptr,
    num_pairs, N, K,
    stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr, A_ROW_IS_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_sorted_ptr):
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    pair_ok = pair < num_pairs  # padding entries hold num_pairs
    a_row = pair if A_ROW_IS_PAIR else pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=pair_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])


@triton.jit
def _rank_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, BLOCK: tl.constexpr):
    # Each pair's place among its expert's pairs (in no particular order: a row's result does not
    # depend on the rows it shares a tile with).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0)
    tl.store(rank_ptr + offs, tl.atomic_add(counts_ptr + expert, 1, mask=ok), mask=ok)


@triton.jit
def _offsets_kernel(counts_ptr, starts_ptr, sorted_ptr, block_expert_ptr, num_sorted_ptr, num_pairs, capacity,
                    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                    ROWS: tl.constexpr, FILL: tl.constexpr):
    e = tl.arange(0, EXPERTS_PAD)
    ok = e < NUM_EXPERTS
    padded = (tl.load(counts_ptr + e, mask=ok, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + e, ends - padded, mask=ok)
    total = tl.sum(padded, 0)
    tl.store(num_sorted_ptr, total)
    for first in range(0, capacity // BLOCK_M, ROWS):  # each block's expert: how many experts end before it
        block = first + tl.arange(0, ROWS)
        start = block * BLOCK_M
        expert = tl.sum(tl.where((ends[None, :] <= start[:, None]) & ok[None, :], 1, 0), 1)
        tl.store(block_expert_ptr + block, tl.where(start < total, expert, -1), mask=start < capacity)
    for first in range(0, capacity, FILL):  # padding entries name no pair
        offs = first + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs, num_pairs, mask=offs < capacity)


@triton.jit
def _scatter_kernel(ids_ptr, rank_ptr, starts_ptr, sorted_ptr, num_pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0)
    place = tl.load(starts_ptr + expert, mask=ok, other=0) + tl.load(rank_ptr + offs, mask=ok, other=0)
    tl.store(sorted_ptr + place, offs, mask=ok)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert, each expert's run padded to a multiple of ``block_m``.

    :returns: ``sorted_pairs`` int32 ``[capacity]`` (pair index ``t * top_k + k``; padding holds
        ``T * top_k``), ``block_expert`` int32 ``[capacity // block_m]`` (the expert of each block,
        -1 past the end), ``num_sorted`` int32 ``[1]`` (padded length in use). ``capacity`` is the
        worst case, ``pairs + min(experts, pairs) * (block_m - 1)`` rounded up to ``block_m``.
    """
    flat = topk_ids.reshape(-1)
    pairs, device = flat.numel(), flat.device
    capacity = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(pairs, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_sorted = torch.empty(1, dtype=torch.int32, device=device)
    block = 1024
    _rank_kernel[(triton.cdiv(pairs, block),)](flat, counts, rank, pairs, BLOCK=block)
    experts_pad = triton.next_power_of_2(num_experts)
    _offsets_kernel[(1,)](counts, starts, sorted_pairs, block_expert, num_sorted, pairs, capacity,
                          NUM_EXPERTS=num_experts, EXPERTS_PAD=experts_pad, BLOCK_M=block_m,
                          ROWS=max(1, 4096 // experts_pad), FILL=1024, num_warps=4)
    _scatter_kernel[(triton.cdiv(pairs, block),)](flat, rank, starts, sorted_pairs, pairs, BLOCK=block)
    return sorted_pairs, block_expert, num_sorted


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None, sorted_pairs: torch.Tensor,
          block_expert: torch.Tensor, num_sorted: torch.Tensor, top_k: int, a_row_is_pair: bool, block_m: int) -> None:
    num_pairs = out.shape[0]
    n, k = b.shape[1], b.shape[2]
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 32 if a.dtype == torch.float32 else 64
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, sorted_pairs, block_expert, num_sorted,
        num_pairs, n, k, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        TOP_K=top_k, A_ROW_IS_PAIR=a_row_is_pair, MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H]``; ``w13`` ``[E, 2I, H]`` (gate rows, then up rows); ``w2`` ``[E, H, I]``;
    ``topk_weights`` float32 ``[T, top_k]``; ``topk_ids`` int32 ``[T, top_k]``. Returns ``[T, H]``:
    ``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with the per-pair products in float32."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    shapes_ok = w13.shape[2] == hidden and w2.shape == (num_experts, hidden, two_i // 2)
    if not shapes_ok or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} and routing "
                         f"{tuple(topk_ids.shape)} disagree")
    if x.stride(-1) != 1 or not w13.is_contiguous() or not w2.is_contiguous() or not topk_ids.is_contiguous():
        raise ValueError("x needs a unit last stride, the expert weights must be contiguous")
    if tokens == 0:
        return torch.zeros_like(x)
    # Small batches: blocks of 16 pairs (few pairs per expert); large ones: 64 for weight reuse.
    block_m = 16 if tokens * top_k <= 4 * num_experts * 16 else 64
    sorted_pairs, block_expert, num_sorted = sort_by_expert(topk_ids, num_experts, block_m)
    gate_up = torch.empty(tokens * top_k, two_i, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, None, sorted_pairs, block_expert, num_sorted, top_k, False, block_m)
    down = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _gemm(silu_and_mul(gate_up), w2, down, topk_weights.reshape(-1).float().contiguous(), sorted_pairs, block_expert,
          num_sorted, top_k, True, block_m)
    return down.view(tokens, top_k, hidden).sum(dim=1)
