"""SiLU-and-mul, the gated MLP's activation: ``silu(x[..., :d]) * x[..., d:]``.

Rounding is written as ``F.silu(gate) * up`` in the activation dtype (the SiLU result rounded before
the product); the GPU compiler may keep it in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=ok, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x``: ``[..., 2 * d]`` (gate then up); returns ``[..., d]``."""
    d = x.shape[-1] // 2
    if x.shape[-1] != 2 * d:
        raise ValueError(f"last dim must be even, got {x.shape[-1]}")
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        raise ValueError("x needs a unit stride on its last dim")
    if out is None:
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, d)
    if x2.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, o2, x2.stride(0), o2.stride(0), d,
                                                             BLOCK=block, num_warps=4)
    return out
