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
its token's statistics, reading the row from L2), rounded as the norm kernel rounds it, and so can
the residual add before it. :func:`shared_beside_routing` runs the shared experts' gate/up, which
needs no routing, on a second stream while the router and the routing run.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from . import last_sums, pdl
from .last_sums import arrive
from .pdl import wait_previous

MAX_TOKENS = 4


@triton.jit
def _token_row(x_ptr, r_ptr, offs, mask, HAS_RES: tl.constexpr):
    """The token's inputs ``offs``, in float32: ``x``, or ``x + r`` rounded to their dtype (the
    residual sum as ``ops.add_rms_norm`` rounds it)."""
    v = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        v = (v.to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
    return v.to(tl.float32)


@triton.jit
def _gate_up_kernel(x_ptr, r_ptr, nw_ptr, w13_ptr, ids_ptr, h_ptr, first_pair, first_expert, I, H, eps,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                    HAS_RES: tl.constexpr, IDS: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)
    # Program i runs pair first_pair + i, whose expert is ids[i] (IDS), else first_expert + i (the
    # shared experts, known before the routing).
    pair = first_pair + tl.program_id(0)
    token = pair // TOP_K
    if IDS:
        expert = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    else:
        expert = (first_expert + tl.program_id(0)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    dtype = h_ptr.dtype.element_ty
    rstd = 0.0
    if NORM:  # RMSNorm of the token's row: every program reads it whole (from L2)
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            v = _token_row(x_ptr, r_ptr, token * H + k0 + ks, (k0 + ks) < H, HAS_RES)
            ss += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / H + eps)
    gate_rows = w13_ptr + expert * 2 * I * H + cols[:, None].to(tl.int64) * H
    up_rows = gate_rows + I * H
    gate = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + ks) < H
        x = _token_row(x_ptr, r_ptr, token * H + k0 + ks, k_ok, HAS_RES)
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
_shared_stream = True  # the GPU runner's moe_shared_stream option


def set_shared_stream(on: bool) -> None:
    """Whether the few-rows op set runs a one-token MoE's shared experts beside its routing
    (:func:`shared_beside_routing`; the GPU runner's ``moe_shared_stream`` option)."""
    global _shared_stream
    _shared_stream = bool(on)


def shared_stream() -> bool:
    return _shared_stream


def set_down_groups(groups: int) -> None:
    """The down kernel's programs over a token's picks when a call's ``down_tile`` does not say
    (the GPU runner's ``moe_down_groups`` option)."""
    global _down_groups
    _down_groups = int(groups)


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> None:
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    if tokens > MAX_TOKENS:
        raise ValueError(f"the few-tokens MoE takes at most {MAX_TOKENS} tokens, got {tokens}")
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} disagree")
    if x.stride(-1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("x needs a unit last stride, the expert weights must be contiguous")
    if top_k > num_experts:
        raise ValueError(f"{top_k} picks a token of {num_experts} experts")


def _gate_up(x: torch.Tensor, w13: torch.Tensor, h: torch.Tensor, top_k: int, pairs: int, first_pair: int,
             ids: torch.Tensor | None, first_expert: int, norm: tuple[torch.Tensor, float] | None,
             residual: torch.Tensor | None, tile: tuple[int, int, int, int]) -> None:
    """The gate/up kernel over ``pairs`` pairs from ``first_pair`` (of ``top_k`` a token), their
    experts ``ids`` (int32, one a pair) or ``first_expert`` on, into ``h``."""
    inter = w13.shape[1] // 2
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    block_n, block_k, warps, stages = tile
    _gate_up_kernel[(pairs, triton.cdiv(inter, block_n))](
        x, residual if residual is not None else x, norm_weight, w13, ids if ids is not None else x, h, first_pair,
        first_expert, inter, x.shape[1], eps, TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm is not None,
        HAS_RES=residual is not None, IDS=ids is not None, num_warps=warps, num_stages=stages,
        **pdl.launch_options(x.device))


def _down(h: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
          down_tile: tuple[int, ...]) -> torch.Tensor:
    """The down kernel (and the sums of its groups) over every pick of every token, into ``out``."""
    tokens, hidden = out.shape
    top_k, inter = ids.shape[1], w2.shape[2]
    block_n, block_k, warps, stages, *rest = down_tile
    picks = triton.cdiv(top_k, rest[0] if rest else _down_groups)
    groups = triton.cdiv(top_k, picks)
    part = out if groups == 1 else torch.empty(tokens, groups, hidden, dtype=torch.float32, device=out.device)
    by_last = groups > 1 and last_sums.enabled() and tokens * triton.cdiv(hidden, block_n) <= last_sums.MAX_COUNTS
    _down_kernel[(tokens, triton.cdiv(hidden, block_n), groups)](
        h, w2, ids, weights, part, out, last_sums.counts(out.device) if by_last else part, inter, hidden, TOP_K=top_k,
        PICKS=picks, GROUPS=groups, BLOCK_N=block_n, BLOCK_K=block_k, LAST_SUMS=by_last, num_warps=warps,
        num_stages=stages, **pdl.launch_options(out.device))
    if groups > 1 and not by_last:
        _sum_groups_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](
            part, out, hidden, GROUPS=groups, BLOCK=SUM_BLOCK, num_warps=4, **pdl.launch_options(out.device))
    return out


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
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"routing weights {tuple(topk_weights.shape)} and ids {tuple(topk_ids.shape)} disagree")
    _check(x, w13, w2, topk_ids.shape[1])
    tokens, top_k = x.shape[0], topk_ids.shape[1]
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    x, ids = x.contiguous(), topk_ids.contiguous()
    h = torch.empty(tokens * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    _gate_up(x, w13, h, top_k, tokens * top_k, 0, ids, 0, norm, None, gate_up_tile)
    return _down(h, w2, ids, topk_weights.float().contiguous(), out, down_tile)


def shared_beside_routing(x: torch.Tensor, residual: torch.Tensor, norm: tuple[torch.Tensor, float],
                          w13: torch.Tensor, w2: torch.Tensor, top_k: int, num_shared: int,
                          route: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                          gate_up_tile: tuple[int, int, int, int] = GATE_UP_TILE,
                          down_tile: tuple[int, ...] = DOWN_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer of one token with the norm before it, :func:`skinny_moe` with its shared
    experts' gate/up kernel beside the routing. ``route()`` runs the router and the routing on the
    current stream and returns (weights, ids, the residual sum ``x + residual``): ``[1, top_k +
    num_shared]``, the ``top_k`` routed picks followed by the shared experts (``w13``'s last
    ``num_shared``), as :func:`skinny_moe` takes them. Meanwhile a second stream (on CUDA) runs the
    shared experts' gate/up kernel, which adds the residual and norms the row itself, so it waits
    for nothing the routing computes: at one token the router's product and the routing are two
    short kernels that leave most of the chip idle, and the shared experts' weights (two of
    V2-Lite's eight picks) stream meanwhile. The same bits as the router, then :func:`skinny_moe`
    with ``norm`` over the sum. Returns (the layer's output, the residual sum)."""
    picks = top_k + num_shared
    _check(x, w13, w2, picks)
    if x.shape[0] != 1 or residual.shape != x.shape or num_shared < 1 or top_k < 1:
        raise ValueError(f"one token, its residual, a routed and a shared expert; got x {tuple(x.shape)}, residual "
                         f"{tuple(residual.shape)}, top_k {top_k}, {num_shared} shared")
    x, residual = x.contiguous(), residual.contiguous()
    h = torch.empty(picks, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    shared = (x, w13, h, picks, num_shared, top_k, None, w13.shape[0] - num_shared, norm, residual, gate_up_tile)
    side = _side_stream(x.device)
    if side is not None:
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _gate_up(*shared)
    else:
        _gate_up(*shared)
    try:
        weights, ids, summed = route()
        if ids.shape != (1, picks) or weights.shape != ids.shape or summed.shape != x.shape:
            raise ValueError(f"route() gave weights {tuple(weights.shape)}, ids {tuple(ids.shape)} and a sum "
                             f"{tuple(summed.shape)} for one token of {picks} picks")
        ids = ids.contiguous()
        _gate_up(summed.contiguous(), w13, h, picks, top_k, 0, ids, 0, norm, None, gate_up_tile)
    finally:  # joined whatever happens: a graph capture must not end with the second stream forked
        if side is not None:
            main.wait_stream(side)
    return _down(h, w2, ids, weights.float().contiguous(), torch.empty_like(x), down_tile), summed


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The second stream of ``device`` (None off CUDA), created once: the first call is an eager
    warm-up before any CUDA graph captures this layer."""
    if device.type != "cuda":
        return None
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]
