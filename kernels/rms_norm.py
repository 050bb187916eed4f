"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Rounding follows the Hugging Face modules exactly: the residual sum is rounded to the activation
dtype, the statistics are taken in float32, the normalised row is rounded to the activation dtype
before the weight multiplies it (as ``weight * hidden.to(input_dtype)`` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o,
    eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Normalise the rows of ``x`` (any leading shape, last dim = ``weight.numel()``).

    With ``residual``: ``residual += x`` in place (rounded to its dtype), then the sum is
    normalised. ``out`` may alias ``x`` (the row is read before it is written).
    """
    n = weight.numel()
    if x.shape[-1] != n:
        raise ValueError(f"last dim {x.shape[-1]} does not match weight size {n}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        raise ValueError("x needs a unit stride on its last dim")
    if out is None:
        out = torch.empty_like(x)
    o2 = out.view(-1, n)
    r2 = x2
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        r2 = residual.view(-1, n)
    rows = x2.shape[0]
    if rows == 0:
        return out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x2, r2, weight, o2, x2.stride(0), r2.stride(0), o2.stride(0), eps,
        N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)),
    )
    return out
