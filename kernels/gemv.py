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

Two prologues fuse the op before a decoder layer's projections into the same kernel, rounded as the
unfused ops round: RMSNorm with the residual add (:func:`skinny_norm_linear`: every program
recomputes its rows' statistics, reading them whole from L2; the first also writes the residual
sum) and SiLU-and-mul (:func:`skinny_gated_linear`).

The tile (``BLOCK_K``, warps, stages) is a parameter, ``DEFAULT_TILE`` (``DOT_TILE`` for the
tensor-core kernel below) unless given, and so are
``BLOCK_N`` and the split; ``benchmarks/gemv.py`` times the choices against cuBLAS at model shapes. The GPU runner uses this
kernel for its linear layers in steps of up to :func:`routed_rows` rows (the ``skinny_gemv``
option, on by default; ``plugin_options={"gpu": {"skinny_gemv": False}}`` turns it off; its
``skinny_rows`` option sets the rows).

From ``DOT_ROWS`` rows a second kernel (``kernels.rows_dot``) pads the rows to 16 and multiplies
a weight chunk with all of them on tensor cores (``tl.dot``), with the same prologues, split and
second pass: the one-row-at-a-time kernel reduces every row of every chunk across its tile, which
from three rows on costs more than the weight loads.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import last_sums, pdl
from .last_sums import arrive
from .matmul import linear_rows
from .pdl import wait_previous
from .rows_dot import program_slice, rows_dot, store_rows

MAX_ROWS = 16
ROW_LOOP_ROWS = 4  # the one-row-at-a-time kernel's most rows
# From this many rows the tensor-core kernel is the default: at two rows the one-row-at-a-time
# kernel timed 20.6 us over qwen3-0.6b's four projections against 21.7 (H200, benchmarks/gemv.py).
DOT_ROWS = 3
# The steps the runner routes to the kernels by default: one row. On the H200 the one-row kernel
# runs a decode projection of qwen3-0.6b or llama3-8b in 0.85-1.07x cuBLAS's time (0.48x at
# qwen3-0.6b's o_proj), and fusing a layer's norm and activation into it makes batch-1 decode 14%
# faster. Two rows (``SMALL_ROUTED_ROWS``) for a model of small projections, whose step is launch
# and latency bound (the GPU runner's rule, ``backends.gpu.platform.default_skinny_rows``): at batch
# 2 qwen3-0.6b decoded 1,754-1,757 tok/s so against cuBLAS's 1,401-1,464, but llama3-8b 292 against
# 415, its long projections bound by the row loop's reductions. From three rows the tensor-core
# kernel would take them, slower than cuBLAS inside the model. The GPU runner's ``skinny_rows``
# option routes steps of up to that many rows (at most ``MAX_ROWS``; :func:`set_routed_rows`). A mixture of experts routes one row (``MOE_ROUTED_ROWS``):
# its few-tokens kernels time as the grouped GEMMs do from two tokens on.
ROUTED_ROWS = 1
SMALL_ROUTED_ROWS = 2
MOE_ROUTED_ROWS = 1
_routed_rows = ROUTED_ROWS


def routed_rows() -> int:
    """The most rows a step of the dense linear layers the runner routes to these kernels."""
    return _routed_rows


def set_routed_rows(rows: int) -> None:
    """Route steps of up to ``rows`` rows (the process's, as a CUDA graph captures what it is at
    capture)."""
    global _routed_rows
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the few-rows kernels take 1 to {MAX_ROWS} rows, not {rows}")
    _routed_rows = rows


DEFAULT_TILE = (512, 4, 3)  # BLOCK_K, num_warps, num_stages (BLOCK_N: :func:`choose_block_n`)
# The same for the tensor-core kernel, whose programs own DOT_BLOCK_N features: on the H200 the
# fastest over qwen3-0.6b's four projections at 2 to 16 rows (21.6-22.6 us a layer against cuBLAS's
# 23.5-30.4; 16 features a program 25.6-26.1, 128 or 512-wide chunks 23-27).
DOT_TILE = (256, 4, 3)
DOT_BLOCK_N = 32


@triton.jit
def _input_chunk(x_ptr, r_ptr, nw_ptr, m, k0, ks, k_ok, stride_xm, rstd, M, K,
                 PRE: tl.constexpr, HAS_RES: tl.constexpr):
    """Row ``m``'s inputs ``k0 + ks`` to the product, in float32, rounded as the unfused ops round
    them: ``x``; RMSNorm of ``x (+ r)`` (``rstd`` its row's); or ``silu(gate) * up`` of
    ``x = [gate | up]`` (``K`` wide each)."""
    mask = k_ok & (ks * 0 + m < M)
    v = tl.load(x_ptr + m * stride_xm + k0 + ks, mask=mask, other=0.0)
    if PRE == 1:
        if HAS_RES:
            v = (v.to(tl.float32) + tl.load(r_ptr + m * stride_xm + k0 + ks, mask=mask, other=0.0).to(tl.float32)
                 ).to(x_ptr.dtype.element_ty)
        normed = (v.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        v = (normed * tl.load(nw_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
    elif PRE == 2:
        gate = v.to(tl.float32)
        up = tl.load(x_ptr + m * stride_xm + K + k0 + ks, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
        v = (act * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return v.to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, new_r_ptr, w_ptr, b_ptr, out_ptr, final_ptr, count_ptr, M, N, K, k_per_split,
                 stride_xm, stride_wn, stride_om, eps,
                 M_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr, HAS_RES: tl.constexpr,
                 PREFETCH: tl.constexpr, LINE: tl.constexpr, LAST_SUMS: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # While the kernel before still runs: this program's weights into L2 (PREFETCH).
    cols, col_ok, k_start, k_end = program_slice(w_ptr, N, K, k_per_split, stride_wn, BLOCK_N, PREFETCH, LINE, PDL)
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    # RMSNorm's statistics: every program reads its rows whole (from L2: a few KB each); the first
    # also writes the residual sum, which the layer carries on.
    rstds = tl.zeros([M_PAD], tl.float32)
    if PRE == 1:
        for m in tl.static_range(M_PAD):
            ss = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = (k0 + ks) < K
                mask = k_ok & (ks * 0 + m < M)
                v = tl.load(x_ptr + m * stride_xm + k0 + ks, mask=mask, other=0.0)
                if HAS_RES:
                    v = (v.to(tl.float32) + tl.load(r_ptr + m * stride_xm + k0 + ks, mask=mask, other=0.0
                                                     ).to(tl.float32)).to(x_ptr.dtype.element_ty)
                    if (pid_n == 0) & (pid_k == 0):
                        tl.store(new_r_ptr + m * K + k0 + ks, v, mask=mask)
                vf = v.to(tl.float32)
                ss += vf * vf
            rstds = tl.where(rows == m, 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps), rstds)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(M_PAD):  # one row at a time: the tile stays [BLOCK_N, BLOCK_K]
            rstd = tl.sum(tl.where(rows == m, rstds, 0.0), 0)
            xm = _input_chunk(x_ptr, r_ptr, nw_ptr, m, k0, ks, k_ok, stride_xm, rstd, M, K, PRE, HAS_RES)
            acc = tl.where(rows[:, None] == m, acc + tl.sum(w * xm[None, :], axis=1)[None, :], acc)
    store_rows(acc, out_ptr, b_ptr, rows, row_ok, cols, col_ok, M, N, stride_om, HAS_BIAS, SPLIT)
    if SPLIT > 1:
        if LAST_SUMS:  # the column block's last slice to arrive adds them all, in order
            if arrive(count_ptr, pid_n, SPLIT):
                total = tl.zeros([M_PAD, BLOCK_N], tl.float32)
                for s in tl.static_range(SPLIT):
                    total += tl.load(out_ptr + (s * M + rows[:, None]).to(tl.int64) * N + cols[None, :],
                                     mask=row_ok[:, None] & col_ok[None, :], other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(final_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                         total.to(final_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(ws_ptr, b_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)
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
    """Output features a program: 16 when that still gives four programs a SM, else 8, else 4.
    Programs are what keeps bytes in flight: a projection of a few MB at one row is done in a few
    microseconds, and more, thinner programs beat fewer, wider ones there (on the H200 with
    programmatic dependent launch, qwen3-0.6b's gate/up projection took 5.2 us at 4 features a
    program against 6.1 us at 16). With :func:`choose_split`'s four programs a SM, batch-1 decode
    of qwen3-0.6b went from 975 to 1,048 tok/s against two a SM for both."""
    for block_n in (16, 8):
        if triton.cdiv(n, block_n) >= 4 * num_sms:
            return block_n
    return 4


def choose_split(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """Slices of ``K``: doubled while the programs stay under four a SM and each slice keeps two
    ``BLOCK_K`` chunks, at most 8 (a second pass adds the slices). qwen3-0.6b's output and down
    projections (1,024 features over 2,048 and 3,072 inputs) run four slices: the down projection
    took 4.3 us on the H200 so (8 features a program) against 5.9 us whole."""
    programs = triton.cdiv(n, block_n)
    split = 1
    while split < 8 and programs * split < 4 * num_sms and k // (2 * split) >= block_k:
        split *= 2
    return split


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def prefetch_lines(weight: torch.Tensor, k_per_split: int, block_n: int, launch: dict[str, bool]) -> int:
    """``program_slice``'s ``PREFETCH`` for a launch of ``launch``'s options over ``weight``: the L2
    lines of a program's slice of a weight row it asks for before its wait, a power of two, at
    most 2,048 requests a program; 0 without PDL or for weights past the prefetch budget."""
    if not launch["PDL"] or weight.numel() * weight.element_size() > pdl.prefetch_budget(weight.device):
        return 0
    line = pdl.LINE_BYTES // weight.element_size()
    return min(triton.next_power_of_2(triton.cdiv(k_per_split, line)), max(1, 2048 // block_n))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tile: tuple[int, int, int] | None = None, block_n: int | None = None, split: int | None = None,
                  num_sms: int | None = None, dot: bool | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of at most ``MAX_ROWS`` rows (``[..., K]``), ``weight``
    ``[N, K]`` with a unit last stride; the result has ``x``'s dtype. ``dot``: the tensor-core
    kernel (by default from ``DOT_ROWS`` rows) or the one-row-at-a-time one (up to
    ``ROW_LOOP_ROWS`` rows). ``tile``: ``(BLOCK_K, warps, stages)``, ``DOT_TILE`` or
    ``DEFAULT_TILE`` by default; ``block_n`` defaults to ``DOT_BLOCK_N`` or :func:`choose_block_n`,
    ``split`` (slices of ``K``) to :func:`choose_split`."""
    x2, n, k = linear_rows(x, weight)
    out = _launch(x2, weight, bias, 0, tile, block_n, split, num_sms, dot=dot)
    return out.reshape(*x.shape[:-1], n)


def skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, **kwargs: object
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's RMSNorm and the projection after it in one kernel: ``F.linear(rms_norm(x +
    residual), weight, bias)`` and the new residual ``x + residual`` (``x`` itself without one), both
    rounded as ``ops.add_rms_norm`` rounds them. ``x`` and ``residual``: ``[rows, K]``, at most
    ``MAX_ROWS`` rows. ``out_dtype`` (a keyword) sets the product's dtype, ``x``'s by default: a MoE
    router's float32 weight and logits (the products are float32 either way)."""
    x2, n, k = linear_rows(x, weight)
    if norm_weight.shape != (k,):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} does not match {k} features")
    r2 = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        x2, r2 = x2.contiguous(), residual.reshape(-1, k).contiguous()
    new_residual = torch.empty_like(x2) if r2 is not None else x2
    out = _launch(x2, weight, bias, 1, residual=r2, norm=(norm_weight, eps, new_residual), **kwargs)
    return out.reshape(*x.shape[:-1], n), new_residual.reshape(x.shape)


def skinny_gated_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        **kwargs: object) -> torch.Tensor:
    """A gated MLP's activation and down projection in one kernel: ``F.linear(silu(gate) * up,
    weight, bias)`` for ``gate_up = [gate | up]`` (``[rows, 2 K]``, at most ``MAX_ROWS`` rows),
    the product rounded as ``ops.silu_and_mul`` rounds it."""
    n, k = weight.shape
    if gate_up.shape[-1] != 2 * k:
        raise ValueError(f"gate_up has {gate_up.shape[-1]} features, the projection expects 2 x {k}")
    if weight.stride(-1) != 1:
        raise ValueError("weight needs a unit stride on its last dimension")
    x2 = gate_up.reshape(-1, 2 * k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = _launch(x2, weight, bias, 2, **kwargs)
    return out.reshape(*gate_up.shape[:-1], n)


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pre: int,
            tile: tuple[int, int, int] | None = None, block_n: int | None = None, split: int | None = None,
            num_sms: int | None = None, residual: torch.Tensor | None = None,
            norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
            out_dtype: torch.dtype | None = None, dot: bool | None = None) -> torch.Tensor:
    """The product over ``x2``'s rows with prologue ``pre`` (0: none; 1: RMSNorm, ``norm`` = (its
    weight, eps, the new residual's buffer); 2: SiLU-and-mul); ``[M, N]``. ``dot``: the tensor-core
    kernel (``kernels.rows_dot``; by default from ``DOT_ROWS`` rows) or the one-row-at-a-time one;
    ``tile`` defaults to ``DOT_TILE`` or ``DEFAULT_TILE`` accordingly."""
    n, k = weight.shape
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"the few-rows kernel takes at most {MAX_ROWS} rows, got {m}")
    out = torch.empty(m, n, dtype=out_dtype or x2.dtype, device=x2.device)
    if m == 0:
        return out
    dot = m >= DOT_ROWS if dot is None else dot
    if not dot and m > ROW_LOOP_ROWS:
        raise ValueError(f"the one-row-at-a-time kernel takes at most {ROW_LOOP_ROWS} rows, got {m}")
    if tile is None:
        tile = DOT_TILE if dot else DEFAULT_TILE
    block_k, num_warps, num_stages = tile
    num_sms = num_sms or _num_sms(x2.device)
    block_n = block_n or (DOT_BLOCK_N if dot else choose_block_n(n, num_sms))
    if dot and block_n < 16:
        raise ValueError(f"the tensor-core kernel needs at least 16 features a program, got {block_n}")
    if split is None:
        split = choose_split(n, k, block_n, block_k, num_sms)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    has_bias = bias is not None
    norm_weight, eps, new_residual = norm if norm is not None else (weight, 0.0, x2)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x2.device)
    launch = pdl.launch_options(x2.device)
    prefetch = prefetch_lines(weight, k_per_split, block_n, launch)
    by_last = not dot and split > 1 and last_sums.enabled() and triton.cdiv(n, block_n) <= last_sums.MAX_COUNTS
    if dot:
        rows_dot(x2, residual, norm_weight, new_residual, weight, bias, target, k_per_split, eps, pre, split,
                 block_n, tile, prefetch, launch)
    else:
        _gemv_kernel[(triton.cdiv(n, block_n), split)](
            x2, residual if residual is not None else x2, norm_weight, new_residual, weight,
            bias if has_bias else weight, target, out, last_sums.counts(x2.device) if by_last else target,
            m, n, k, k_per_split, x2.stride(0), weight.stride(0), out.stride(0),
            eps, M_PAD=triton.next_power_of_2(m), HAS_BIAS=has_bias, SPLIT=split, BLOCK_N=block_n, BLOCK_K=block_k,
            PRE=pre, HAS_RES=residual is not None, PREFETCH=prefetch, LINE=pdl.LINE_BYTES // weight.element_size(),
            LAST_SUMS=by_last, num_warps=num_warps, num_stages=num_stages, **launch)
    if split > 1 and not by_last:
        block = 1024
        _sum_splits_kernel[(m, triton.cdiv(n, block))](target, bias if has_bias else target, out, m, n, out.stride(0),
                                                       HAS_BIAS=has_bias, SPLIT=split, BLOCK=block, **launch)
    return out


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`skinny_linear` for inputs of at most :func:`routed_rows` rows in half precision,
    ``F.linear`` for anything else (a layer's ``matmul``: the GPU runner's ``skinny_gemv`` option)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 0 < rows <= _routed_rows and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
