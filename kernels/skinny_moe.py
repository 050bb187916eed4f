"""A mixture-of-experts layer for a step of a few tokens (a decode step at batch 1; an MTP draft).

:func:`fused_moe` sorts the (token, expert) pairs by expert and runs two grouped GEMMs on tensor
cores: right for many tokens, but at one token it is a dozen kernels (the sort's, the buffers'
zeroing, the activation, the sum over the picks) around two GEMMs whose tiles are 15/16 padding. A
step of a few tokens only has to read the picked experts' weights once, like a GEMV
(``kernels.gemv``), so here it takes two kernels:

* gate/up: one program per (pair, block of ``BLOCK_N`` intermediate units) reads those rows of its
  expert's gate and up projections and writes ``silu(gate) * up`` for the pair;
* down: one program per (token, block of ``BLOCK_N`` hidden units) runs the token's picks in order,
  each pick's product scaled by its routing weight, and writes their sum; or (``down_tile``'s
  ``groups``) several programs share the picks and a small third kernel adds their sums in order.

Every product accumulates in float32 and is rounded where :func:`fused_moe` rounds it (gate and up,
the activation, each pick's weighted output; the sum once), and the picks are added in the same
order every run (no atomics). The shared experts are picks like the others (``models.moe``). The
RMSNorm before the layer can run inside the gate/up kernel (``norm``: every program recomputes
its token's statistics, reading the row from L2), rounded as the norm kernel rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import last_sums, pdl
from .last_sums import arrive
from .pdl import wait_previous

MAX_TOKENS = 4


@triton.jit
def _gate_up_kernel(x_ptr, nw_ptr, w13_ptr, ids_ptr, h_ptr, I, H, eps, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    dtype = h_ptr.dtype.element_ty
    rstd = 0.0
    if NORM:  # RMSNorm of the token's row: every program reads it whole (from L2)
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            v = tl.load(x_ptr + token * H + k0 + ks, mask=(k0 + ks) < H, other=0.0).to(tl.float32)
            ss += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / H + eps)
    gate_rows = w13_ptr + expert * 2 * I * H + cols[:, None].to(tl.int64) * H
    up_rows = gate_rows + I * H
    gate = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + ks) < H
        x = tl.load(x_ptr + token * H + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:  # rounded as the unfused norm rounds
            normed = (x * rstd).to(dtype).to(tl.float32)
            x = (normed * tl.load(nw_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        mask = col_ok[:, None] & k_ok[None, :]
        gate += tl.sum(tl.load(gate_rows + (k0 + ks)[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
        up += tl.sum(tl.load(up_rows + (k0 + ks)[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
    gate = gate.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = act * up.to(dtype).to(tl.float32)
    tl.store(h_ptr + pair * I + cols, h.to(dtype), mask=col_ok)


@triton.jit
def _down_kernel(h_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, final_ptr, count_ptr, I, H, TOP_K: tl.constexpr,
                 PICKS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 LAST_SUMS: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # of GROUPS programs over the token's picks, PICKS each (one group: every bound below is known
    # at compile time, the code the kernel had before groups)
    group = tl.program_id(2) if GROUPS > 1 else 0
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    dtype = h_ptr.dtype.element_ty  # the layer's (``out_ptr`` holds float32 partial sums with GROUPS > 1)
    total = tl.zeros([BLOCK_N], tl.float32)
    for i in tl.static_range(PICKS):  # in order: the same sum every run
        j = group * PICKS + i
        if j < TOP_K:
            pair = token * TOP_K + j
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            rows = w2_ptr + expert * H * I + cols[:, None].to(tl.int64) * I
            acc = tl.zeros([BLOCK_N], tl.float32)
            for k0 in range(0, I, BLOCK_K):
                k_ok = (k0 + ks) < I
                h = tl.load(h_ptr + pair * I + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
                w = tl.load(rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(w * h[None, :], 1)
            total += (acc * tl.load(weights_ptr + pair)).to(dtype).to(tl.float32)
    if GROUPS == 1:
        tl.store(out_ptr + token * H + cols, total.to(dtype), mask=col_ok)
    else:  # float32 partial sums, added in order by _sum_groups_kernel or the block's last group (last_sums)
        tl.store(out_ptr + (token * GROUPS + group) * H + cols, total, mask=col_ok)
        if LAST_SUMS:
            if arrive(count_ptr, token * tl.num_programs(1) + tl.program_id(1), GROUPS):
                total = tl.zeros([BLOCK_N], tl.float32)
                for g in tl.static_range(GROUPS):
                    total += tl.load(out_ptr + (token * GROUPS + g) * H + cols, mask=col_ok, other=0.0,
                                     cache_modifier=".cg")
                tl.store(final_ptr + token * H + cols, total.to(final_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _sum_groups_kernel(part_ptr, out_ptr, H, GROUPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    total = tl.zeros([BLOCK], tl.float32)
    for g in tl.static_range(GROUPS):
        total += tl.load(part_ptr + (token * GROUPS + g) * H + cols, mask=ok, other=0.0)
    tl.store(out_ptr + token * H + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


# Tiles, ``(BLOCK_N, BLOCK_K, warps, stages)``, the fastest of those ``benchmarks/gemv.py --moe-sweep``
# timed on the H200 for a V2-Lite layer at one token: 50.9 us for the pair against 62.0 us with
# (16, 512, 4, 3) / (8, 512, 4, 3). Thin tiles: more programs stream the few picked experts. The
# down kernel's tile may take a fifth entry, its programs over a token's picks (else
# :func:`set_down_groups`'s, 1 unless set: one program runs them all).
GATE_UP_TILE = (4, 128, 2, 3)
DOWN_TILE = (4, 512, 4, 2)
SUM_BLOCK = 512
_down_groups = 1


def set_down_groups(groups: int) -> None:
    """The down kernel's programs over a token's picks when a call's ``down_tile`` does not say
    (the GPU runner's ``moe_down_groups`` option)."""
    global _down_groups
    _down_groups = int(groups)


def skinny_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
               gate_up_tile: tuple[int, int, int, int] = GATE_UP_TILE,
               down_tile: tuple[int, ...] = DOWN_TILE) -> torch.Tensor:
    """:func:`~specloop.kernels.fused_moe.fused_moe` for at most ``MAX_TOKENS`` tokens: ``x`` ``[T, H]``
    (unit last stride), ``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` contiguous, ``topk_weights``
    float32 and ``topk_ids`` int ``[T, top_k]``. With ``norm`` (an RMSNorm's weight and eps) the
    experts read ``rms_norm(x)``, computed inside the gate/up kernel. ``gate_up_tile`` and
    ``down_tile``: each kernel's ``(BLOCK_N, BLOCK_K, warps, stages)``, the down kernel's with an
    optional fifth, ``groups`` (else :func:`set_down_groups`'s): its picks spread over that many
    programs a block of hidden units, whose float32 partial sums a third kernel adds in order (one
    pick a group: the same bits as one group).
    Returns ``[T, H]`` in ``x``'s dtype."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    if tokens > MAX_TOKENS:
        raise ValueError(f"the few-tokens MoE takes at most {MAX_TOKENS} tokens, got {tokens}")
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} and routing "
                         f"{tuple(topk_ids.shape)} disagree")
    if x.stride(-1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("x needs a unit last stride, the expert weights must be contiguous")
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    x = x.contiguous()
    top_k = topk_ids.shape[1]
    ids = topk_ids.contiguous()
    weights = topk_weights.float().contiguous()
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    block_n, block_k, warps, stages = gate_up_tile
    _gate_up_kernel[(tokens * top_k, triton.cdiv(inter, block_n))](
        x, norm_weight, w13, ids, h, inter, hidden, eps, TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k,
        NORM=norm is not None, num_warps=warps, num_stages=stages, **pdl.launch_options(x.device))
    block_n, block_k, warps, stages, *rest = down_tile
    picks = triton.cdiv(top_k, rest[0] if rest else _down_groups)
    groups = triton.cdiv(top_k, picks)
    part = out if groups == 1 else torch.empty(tokens, groups, hidden, dtype=torch.float32, device=x.device)
    by_last = groups > 1 and last_sums.enabled() and tokens * triton.cdiv(hidden, block_n) <= last_sums.MAX_COUNTS
    _down_kernel[(tokens, triton.cdiv(hidden, block_n), groups)](
        h, w2, ids, weights, part, out, last_sums.counts(x.device) if by_last else part, inter, hidden, TOP_K=top_k,
        PICKS=picks, GROUPS=groups, BLOCK_N=block_n, BLOCK_K=block_k, LAST_SUMS=by_last, num_warps=warps,
        num_stages=stages, **pdl.launch_options(x.device))
    if groups > 1 and not by_last:
        _sum_groups_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](
            part, out, hidden, GROUPS=groups, BLOCK=SUM_BLOCK, num_warps=4, **pdl.launch_options(x.device))
    return out
