"""A linear layer for a few rows: ``x @ w.T (+ b)`` when ``x`` has at most ``MAX_ROWS`` rows (a
decode step of a few requests; a verification of a few drafts at batch 1).

Such a product reads every weight once for a handful of multiply-adds per weight, so it is bound by
memory bandwidth, and what matters is keeping enough of the weight matrix in flight on every SM.
Each program owns ``BLOCK_N`` output features (rows of ``w``: 16, or 8 or 4 for a narrow layer, so
that the outputs give the chip enough programs) and one of ``split`` slices of ``K``, streams its
weight tile in ``BLOCK_K`` chunks through a software pipeline of ``num_stages``, and multiplies it
with the few input rows in registers, accumulating in float32 (no tensor cores: at one row they
would idle 15 of their 16 lanes). When even 4 features a program leave SMs idle, ``K`` is split:
each slice writes its partial sums to a float32 workspace and a second pass adds the slices in
order, so the result is the same from run to run (no atomics).

The tile (``BLOCK_K``, warps, stages) is a parameter, ``DEFAULT_TILE`` unless given, and so are
``BLOCK_N`` and the split; ``benchmarks/gemv.py`` times the choices against cuBLAS at model shapes. The GPU runner uses this
kernel for its linear layers when asked (``plugin_options={"gpu": {"skinny_gemv": True}}``), for the
steps of at most ``MAX_ROWS`` rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .matmul import linear_rows

MAX_ROWS = 4
DEFAULT_TILE = (256, 4, 3)  # BLOCK_K, num_warps, num_stages (BLOCK_N: :func:`choose_block_n`)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
                 M_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(M_PAD):  # one row at a time: the tile stays [BLOCK_N, BLOCK_K]
            xm = tl.load(x_ptr + m * stride_xm + k0 + ks, mask=k_ok & (ks * 0 + m < M), other=0.0).to(tl.float32)
            acc = tl.where(rows[:, None] == m, acc + tl.sum(w * xm[None, :], axis=1)[None, :], acc)
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:  # the workspace: [SPLIT, M, N] float32, slice pid_k
        offs = (pid_k * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(out_ptr + offs, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(ws_ptr, b_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT):  # in order: the same sum every run
        acc += tl.load(ws_ptr + (s * M + row).to(tl.int64) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def choose_block_n(n: int, num_sms: int) -> int:
    """Output features a program: 16 when that still gives two programs a SM, else 8, else 4 (a
    narrow layer is covered by more, thinner programs before ``K`` is split)."""
    for block_n in (16, 8):
        if triton.cdiv(n, block_n) >= 2 * num_sms:
            return block_n
    return 4


def choose_split(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """Slices of ``K``: enough programs for one a SM when the outputs alone give fewer, each slice
    at least two ``BLOCK_K`` chunks, at most 8; a power of two (a second pass adds the slices)."""
    programs = triton.cdiv(n, block_n)
    split = 1
    while split < 8 and programs * split < num_sms and k // (2 * split) >= 2 * block_k:
        split *= 2
    return split


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tile: tuple[int, int, int] = DEFAULT_TILE, block_n: int | None = None, split: int | None = None,
                  num_sms: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of at most ``MAX_ROWS`` rows (``[..., K]``), ``weight``
    ``[N, K]`` with a unit last stride; the result has ``x``'s dtype. ``tile``: ``(BLOCK_K, warps,
    stages)``; ``block_n`` and ``split`` (slices of ``K``) default to :func:`choose_block_n` and
    :func:`choose_split`."""
    x2, n, k = linear_rows(x, weight)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    block_k, num_warps, num_stages = tile
    num_sms = num_sms or _num_sms(x.device)
    block_n = block_n or choose_block_n(n, num_sms)
    if split is None:
        split = choose_split(n, k, block_n, block_k, num_sms)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    m_pad = triton.next_power_of_2(m)
    has_bias = bias is not None
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n), split)](
        x2, weight, bias if has_bias else weight, target, m, n, k, k_per_split, x2.stride(0), weight.stride(0),
        out.stride(0), M_PAD=m_pad, HAS_BIAS=has_bias, SPLIT=split, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(m, triton.cdiv(n, block))](target, bias if has_bias else target, out, m, n, out.stride(0),
                                                       HAS_BIAS=has_bias, SPLIT=split, BLOCK=block)
    return out.reshape(*x.shape[:-1], n)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`skinny_linear` for inputs of at most ``MAX_ROWS`` rows in half precision, ``F.linear``
    for anything else (a layer's ``matmul``: the GPU runner's ``skinny_gemv`` option)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 0 < rows <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
