"""The few-rows linear layer (``kernels.gemv``) from three rows on: the rows padded to one tile of 16
and multiplied on tensor cores.

The one-row-at-a-time kernel reduces every row of every weight chunk across its tile, which from
three rows on costs more than the chunk's loads; here a program loads a ``[BLOCK_N, BLOCK_K]`` chunk
of the weight once and multiplies it with all the rows at once (``tl.dot``), accumulating in
float32. The prologues (RMSNorm with the residual add, SiLU-and-mul), the split of ``K`` and the
second pass that adds the slices in order are ``kernels.gemv``'s, and round as they do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import prefetch_l2, wait_previous


@triton.jit
def program_slice(w_ptr, N, K, k_per_split, stride_wn, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                  LINE: tl.constexpr, PDL: tl.constexpr):
    """A few-rows program's output features (``cols``, ``col_ok``) and slice of ``K``
    (``k_start``, ``k_end``); with ``PREFETCH``, its weights asked of L2 while the kernel before
    still runs, then the wait for that kernel (``kernels.pdl``)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH > 0:
        starts = k_start + tl.arange(0, PREFETCH) * LINE
        ok = col_ok[:, None] & (starts < k_end)[None, :]
        prefetch_l2(w_ptr + tl.where(ok, cols[:, None].to(tl.int64) * stride_wn + starts[None, :], 0))
    wait_previous(PDL)
    return cols, col_ok, k_start, k_end


@triton.jit
def store_rows(acc, out_ptr, b_ptr, rows, row_ok, cols, col_ok, M, N, stride_om, HAS_BIAS: tl.constexpr,
               SPLIT: tl.constexpr):
    """A program's sums: the output rows (with the bias), or with ``SPLIT`` slices its slice of
    the ``[SPLIT, M, N]`` float32 workspace that a second pass adds up in order."""
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        offs = (tl.program_id(1) * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(out_ptr + offs, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _input_tile(x_ptr, r_ptr, nw_ptr, rows, row_ok, k0, ks, k_ok, stride_xm, rstds, K,
                PRE: tl.constexpr, HAS_RES: tl.constexpr):
    """:func:`_input_chunk` for every row of the tile at once: ``[rows, BLOCK_K]`` in ``x``'s dtype."""
    mask = row_ok[:, None] & k_ok[None, :]
    offs = rows[:, None] * stride_xm + (k0 + ks)[None, :]
    v = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if PRE == 1:
        if HAS_RES:
            v = (v.to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                 ).to(x_ptr.dtype.element_ty)
        normed = (v.to(tl.float32) * rstds[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        v = (normed * tl.load(nw_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
             ).to(x_ptr.dtype.element_ty)
    elif PRE == 2:
        gate = v.to(tl.float32)
        up = tl.load(x_ptr + offs + K, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
        v = (act * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return v


@triton.jit
def _rows_dot_kernel(x_ptr, r_ptr, nw_ptr, new_r_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_per_split,
                     stride_xm, stride_wn, stride_om, eps,
                     M_TILE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr, HAS_RES: tl.constexpr,
                     PREFETCH: tl.constexpr, LINE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """:func:`_gemv_kernel` for several rows: the rows padded to one ``M_TILE`` (16) and multiplied
    on tensor cores, every row of a weight chunk at once (the per-row kernel reduces each row of
    each chunk across the tile, which costs more than the loads from three rows on)."""
    cols, col_ok, k_start, k_end = program_slice(w_ptr, N, K, k_per_split, stride_wn, BLOCK_N, PREFETCH, LINE, PDL)
    rows = tl.arange(0, M_TILE)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    rstds = tl.zeros([M_TILE], tl.float32)
    if PRE == 1:
        ss = tl.zeros([M_TILE, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            mask = row_ok[:, None] & k_ok[None, :]
            offs = rows[:, None] * stride_xm + (k0 + ks)[None, :]
            v = tl.load(x_ptr + offs, mask=mask, other=0.0)
            if HAS_RES:
                v = (v.to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                     ).to(x_ptr.dtype.element_ty)
                if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                    tl.store(new_r_ptr + rows[:, None] * K + (k0 + ks)[None, :], v, mask=mask)
            vf = v.to(tl.float32)
            ss += vf * vf
        rstds = 1.0 / tl.sqrt(tl.sum(ss, 1) / K + eps)
    acc = tl.zeros([M_TILE, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        xt = _input_tile(x_ptr, r_ptr, nw_ptr, rows, row_ok, k0, ks, k_ok, stride_xm, rstds, K, PRE, HAS_RES)
        acc = tl.dot(xt.to(w.dtype), tl.trans(w), acc, input_precision=PRECISION)
    store_rows(acc, out_ptr, b_ptr, rows, row_ok, cols, col_ok, M, N, stride_om, HAS_BIAS, SPLIT)


def rows_dot(x2: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, new_residual: torch.Tensor,
             weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, k_per_split: int, eps: float,
             pre: int, split: int, block_n: int, tile: tuple[int, int, int], prefetch: int,
             launch: dict[str, bool]) -> None:
    """Launch :func:`_rows_dot_kernel` over ``x2``'s rows into ``target`` (the output, or the
    ``[split, M, N]`` float32 workspace); the arguments as ``kernels.gemv._launch`` works them out."""
    m, (n, k) = x2.shape[0], weight.shape
    block_k, num_warps, num_stages = tile
    _rows_dot_kernel[(triton.cdiv(n, block_n), split)](
        x2, residual if residual is not None else x2, norm_weight, new_residual, weight,
        bias if bias is not None else weight, target, m, n, k, k_per_split, x2.stride(0), weight.stride(0),
        target.stride(-2), eps, M_TILE=max(16, triton.next_power_of_2(m)), HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, BLOCK_K=block_k, PRE=pre, HAS_RES=residual is not None, PREFETCH=prefetch,
        LINE=pdl.LINE_BYTES // weight.element_size(), PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages, **launch)
