"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Rounding is written the Hugging Face modules' way: the residual sum is rounded to the activation
dtype, the statistics are taken in float32, the normalised row is rounded to the activation dtype
before the weight multiplies it (as ``weight * hidden.to(input_dtype)`` does). The GPU compiler may
keep such intermediates in float32; results then differ from the reference by rounding only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    inner, stride_x0, stride_x1, stride_r0, stride_r1, stride_o0, stride_o1,
    eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    # Row r is (r // inner, r % inner) of a [rows, inner, N] view: per-head norms work in place on
    # the q/k slices of a fused projection without a copy.
    r = tl.program_id(0).to(tl.int64)
    r0 = r // inner
    r1 = r % inner
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + r0 * stride_x0 + r1 * stride_x1 + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + r0 * stride_r0 + r1 * stride_r1 + cols
        x = (x.to(tl.float32) + tl.load(res_ptrs, mask=ok, other=0.0).to(tl.float32))
        x = x.to(residual_ptr.dtype.element_ty)
        tl.store(res_ptrs, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r0 * stride_o0 + r1 * stride_o1 + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Normalise the rows of ``x`` (``[rows, N]`` or ``[rows, heads, N]``, any strides with a unit
    last stride; N = ``weight.numel()``).

    With ``residual``: ``residual += x`` in place (rounded to its dtype), then the sum is
    normalised. ``out`` may be ``x`` itself (each row is read before it is written).
    """
    n = weight.numel()
    if x.shape[-1] != n or x.dim() not in (2, 3):
        raise ValueError(f"x must be [rows, {n}] or [rows, heads, {n}], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a unit stride on its last dim")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must match x {tuple(x.shape)} with a unit last stride")
    x3, o3 = (x, out) if x.dim() == 3 else (x.unsqueeze(1), out.unsqueeze(1))
    r3 = x3
    if residual is not None:
        if residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        r3 = residual if residual.dim() == 3 else residual.unsqueeze(1)
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x3, r3, weight, o3, x3.shape[1],
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), o3.stride(0), o3.stride(1), eps,
        N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)),
        **pdl.launch_options(x.device),
    )
    return out
