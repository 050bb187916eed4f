"""A batch-invariant matmul: ``x @ w.T (+ b)`` whose every output row depends on its input row alone.

cuBLAS picks its kernel (tile shape, split-K) from the problem size, so one token's projection can
round differently when 1, 4 or 200 tokens share the step. This kernel has one tile shape for every
``M`` (``BLOCK_M x BLOCK_N``, stepping through ``K`` in ``BLOCK_K`` chunks in order, accumulating in
float32) and is compiled once for every ``M`` (``M`` is not specialised), so each output element is
the same sum in the same order whatever else is in the batch. It is slower than cuBLAS for large
``M``; ``batch_invariant=True`` pays that for bit-identical logits (see docs/speculative.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_offs = rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A linear kernel's operands checked: ``x`` ``[..., K]`` as ``[M, K]`` rows with a unit last
    stride, and ``weight``'s ``(N, K)`` (a unit stride on ``K`` required)."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    if weight.stride(-1) != 1:
        raise ValueError("weight needs a unit stride on its last dimension")
    x2 = x.reshape(-1, k)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), n, k


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, batch-invariant (module docstring). ``x``: ``[..., K]``;
    ``weight``: ``[N, K]`` with a unit last stride; the result has ``x``'s dtype."""
    x2, n, k = linear_rows(x, weight)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _matmul_kernel[grid](x2, weight, bias if bias is not None else weight, out, m, n, k,
                             x2.stride(0), weight.stride(0), out.stride(0),
                             HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3)
    return out.reshape(*x.shape[:-1], n)
