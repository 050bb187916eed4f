"""Mixture-of-experts routing in one kernel, one program per token: scores from the router logits
(sigmoid or softmax, float32), the optional group limit, the top-k picks and their weights, and
the shared experts appended as always-picked experts of weight 1.

Written as DeepSeek's routers are: picks use ``score + bias`` (V3's correction bias), weights use
``score``; with groups, the best ``topk_groups`` of ``num_groups`` groups are kept, ranked by the
sum of their two best choices (``group_by_top2``, V3) or by their best one (V2), the others masked
to -inf (V3) or 0 (V2); weights are renormalised over the picks (``renormalize``, plus 1e-20) and
scaled. Picks are made by repeated argmax (lowest index on ties), in descending order.

At one token (a decode step at batch 1, an MTP draft) :func:`router_route` runs the router too,
in the same launch: the norm before the layer (with the residual add), the router's float32
product over many small programs (the router is a fraction of a MB, read by a few programs it
is a chain of latencies), and the routing by the last program to finish (``kernels.last_sums``'
count), which adds the programs' partial logits in order; one kernel where there were two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import last_sums, pdl
from .gemv import _input_chunk, prefetch_lines
from .last_sums import arrive
from .pdl import wait_previous
from .rows_dot import program_slice

_FUSED = True  # the GPU runner's fused_routing option


def set_fused(on: bool) -> None:
    """Whether ``models.few_rows_ops`` routes a one-token MoE in the router's kernel
    (:func:`router_route`; else the router's product and :func:`moe_route`, two kernels)."""
    global _FUSED
    _FUSED = bool(on)


def fused() -> bool:
    return _FUSED


@triton.jit
def _route(x, e, ok, bias_ptr, weights_ptr, ids_ptr, scale,
           NUM_EXPERTS: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
           TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, PICKS_PAD: tl.constexpr,
           SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_BY_TOP2: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One token's picks from its logits ``x`` (float32 over ``e``, -inf where not ``ok``), stored
    at ``weights_ptr`` / ``ids_ptr``."""
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, 0))
        score = p / tl.sum(p, 0)
    else:
        score = tl.where(ok, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    choice = score
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=ok, other=0.0)
    # A NaN score (a padding row's garbage) ranks below every number, above the padding experts: the
    # picks stay distinct experts that exist, whatever the row holds.
    choice = tl.where(ok, tl.where(choice == choice, choice, -3.0e38), float("-inf"))
    if NUM_GROUPS > 1:
        g = tl.arange(0, GROUPS_PAD)
        member = (e[None, :] // (NUM_EXPERTS // NUM_GROUPS)) == g[:, None]  # [groups, experts]
        grid = tl.where(member, choice[None, :], float("-inf"))
        best = tl.max(grid, 1)
        if GROUP_BY_TOP2:
            first = tl.argmax(grid, 1)
            best += tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), grid), 1)
        best = tl.where(g < NUM_GROUPS, best, float("-inf"))
        keep = tl.zeros([GROUPS_PAD], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            pick = tl.argmax(best, 0)
            keep = keep | (g == pick)
            best = tl.where(g == pick, float("-inf"), best)
        allowed = tl.max(tl.where(member & keep[:, None], 1, 0), 0) > 0
        choice = tl.where(allowed | ~ok, choice, float("-inf") if GROUP_BY_TOP2 else 0.0)
    k = tl.arange(0, PICKS_PAD)
    picked_w = tl.zeros([PICKS_PAD], dtype=tl.float32)
    picked_id = tl.zeros([PICKS_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        pick = tl.argmax(choice, 0)
        picked_w = tl.where(k == j, tl.sum(tl.where(e == pick, score, 0.0), 0), picked_w)
        picked_id = tl.where(k == j, pick, picked_id)
        choice = tl.where(e == pick, float("-inf"), choice)
    if RENORMALIZE:
        picked_w = picked_w / (tl.sum(picked_w, 0) + 1e-20)
    picked_w = picked_w * scale
    shared = (k >= TOP_K) & (k < TOP_K + NUM_SHARED)
    picked_w = tl.where(shared, 1.0, picked_w)
    picked_id = tl.where(shared, NUM_EXPERTS + k - TOP_K, picked_id)
    out = k < TOP_K + NUM_SHARED
    tl.store(weights_ptr + k, picked_w, mask=out)
    tl.store(ids_ptr + k, picked_id, mask=out)


@triton.jit
def _moe_route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, stride_o, scale,
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, PICKS_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_BY_TOP2: tl.constexpr, RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EXPERTS_PAD)
    ok = e < NUM_EXPERTS
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    _route(x, e, ok, bias_ptr, weights_ptr + t * stride_o, ids_ptr + t * stride_o, scale, NUM_EXPERTS, NUM_GROUPS,
           GROUPS_PAD, TOPK_GROUPS, TOP_K, NUM_SHARED, PICKS_PAD, SOFTMAX, HAS_BIAS, GROUP_BY_TOP2, RENORMALIZE)


@triton.jit
def _router_kernel(
    x_ptr, r_ptr, nw_ptr, new_r_ptr, w_ptr, part_ptr, count_ptr, bias_ptr, weights_ptr, ids_ptr, K, k_per_split, eps,
    scale,
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, PICKS_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_BY_TOP2: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_RES: tl.constexpr, SPLIT: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STATS_BLOCK: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr,
):
    # A few-rows program (kernels.gemv's) over BLOCK_N experts and one of SPLIT slices of the
    # inputs, its norm prologue rounded as the norm kernel rounds it; then the routing by the last.
    cols, col_ok, k_start, k_end = program_slice(w_ptr, NUM_EXPERTS, K, k_per_split, K, BLOCK_N, PREFETCH, LINE, PDL)
    sk = tl.arange(0, STATS_BLOCK)
    ss = tl.zeros([STATS_BLOCK], tl.float32)
    for k0 in range(0, K, STATS_BLOCK):  # the row's statistics: every program reads it whole (from L2)
        k_ok = (k0 + sk) < K
        v = tl.load(x_ptr + k0 + sk, mask=k_ok, other=0.0)
        if HAS_RES:
            v = (v.to(tl.float32) + tl.load(r_ptr + k0 + sk, mask=k_ok, other=0.0).to(tl.float32)
                 ).to(x_ptr.dtype.element_ty)
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(new_r_ptr + k0 + sk, v, mask=k_ok)
        vf = v.to(tl.float32)
        ss += vf * vf
    rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + (k0 + ks)[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        xm = _input_chunk(x_ptr, r_ptr, nw_ptr, 0, k0, ks, k_ok, 0, rstd, 1, K, 1, HAS_RES)
        acc += tl.sum(w * xm[None, :], axis=1)
    tl.store(part_ptr + tl.program_id(1) * NUM_EXPERTS + cols, acc, mask=col_ok)
    if arrive(count_ptr, 0, PROGRAMS):  # every slice of every logit is stored: the last program routes
        e = tl.arange(0, EXPERTS_PAD)
        ok = e < NUM_EXPERTS
        x = tl.zeros([EXPERTS_PAD], tl.float32)
        for s in tl.static_range(SPLIT):  # in order: the same logits every run
            x += tl.load(part_ptr + s * NUM_EXPERTS + e, mask=ok, other=0.0, cache_modifier=".cg")
        _route(tl.where(ok, x, float("-inf")), e, ok, bias_ptr, weights_ptr, ids_ptr, scale, NUM_EXPERTS, NUM_GROUPS,
               GROUPS_PAD, TOPK_GROUPS, TOP_K, NUM_SHARED, PICKS_PAD, SOFTMAX, HAS_BIAS, GROUP_BY_TOP2, RENORMALIZE)


def _route_constants(experts: int, top_k: int, num_shared: int, softmax: bool, num_groups: int, topk_groups: int,
                     group_by_top2: bool, renormalize: bool, has_bias: bool) -> dict[str, object]:
    if experts % num_groups or top_k > experts:
        raise ValueError(f"{experts} experts in {num_groups} groups, top {top_k}: not possible")
    grouped = num_groups > 1 and topk_groups < num_groups
    return dict(NUM_EXPERTS=experts, EXPERTS_PAD=triton.next_power_of_2(experts),
                NUM_GROUPS=num_groups if grouped else 1, GROUPS_PAD=triton.next_power_of_2(num_groups),
                TOPK_GROUPS=topk_groups, TOP_K=top_k, NUM_SHARED=num_shared,
                PICKS_PAD=triton.next_power_of_2(top_k + num_shared), SOFTMAX=softmax, HAS_BIAS=has_bias,
                GROUP_BY_TOP2=group_by_top2, RENORMALIZE=renormalize)


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, num_shared: int = 0, *,
              softmax: bool = False, num_groups: int = 1, topk_groups: int = 1, group_by_top2: bool = True,
              renormalize: bool = True, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` float32 ``[T, E]`` (unit last stride); ``bias`` float32 ``[E]`` or None. Returns
    (weights float32 ``[T, top_k + num_shared]``, expert ids int32 ``[T, top_k + num_shared]``)."""
    tokens, experts = logits.shape
    if logits.stride(-1) != 1 or (bias is not None and bias.shape != (experts,)):
        raise ValueError(f"logits {tuple(logits.shape)} need a unit last stride, bias [{experts}]")
    constants = _route_constants(experts, top_k, num_shared, softmax, num_groups, topk_groups, group_by_top2,
                                 renormalize, bias is not None)
    picks = top_k + num_shared
    weights = torch.empty(tokens, picks, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, picks, dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    _moe_route_kernel[(tokens,)](
        logits, bias if bias is not None else logits, weights, ids, logits.stride(0), picks, scale, **constants,
        num_warps=4 if experts >= 128 else 1, **pdl.launch_options(logits.device),
    )
    return weights, ids


# The router's launch, ``(BLOCK_N, split, BLOCK_K, warps, stages, STATS_BLOCK)``: experts a program,
# slices of the inputs, the product's chunk and warps and stages, the norm statistics' chunk. The
# fastest of 96 timed on an H100 for V2-Lite's router (64 experts x 2,048, with PDL; ``benchmarks/
# gemv.py --router-shapes deepseek-v2-lite --pdl``): 4.6 us a call, against 5.9 at (2, 2, 512, 4,
# 3, 2048) and 6.9 us for the router's few-rows product and the routing kernel after it.
ROUTER_TILE = (2, 8, 512, 2, 2, 2048)


def router_route(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, num_shared: int = 0, *,
                 softmax: bool = False, num_groups: int = 1, topk_groups: int = 1, group_by_top2: bool = True,
                 renormalize: bool = True, scale: float = 1.0, tile: tuple[int, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's router and routing in one launch: :func:`moe_route` of the router's logits
    ``F.linear(rms_norm(x + residual), weight)`` (float32, the norm rounded as ``ops.add_rms_norm``
    rounds it). ``x`` and ``residual`` ``[1, H]``, ``weight`` ``[E, H]`` contiguous (float32, as
    ``models.moe`` keeps it). The product runs ``tile[0]`` experts a program over ``tile[1]``
    slices of the inputs (:data:`ROUTER_TILE`), the slices' float32 sums added in order by the
    program that finishes last, which then routes. Returns (weights, ids, the residual sum ``x +
    residual``, or ``x`` itself without one)."""
    experts, hidden = weight.shape
    if x.shape != (1, hidden) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"one token of {hidden} features and its residual, got x {tuple(x.shape)} and residual "
                         f"{None if residual is None else tuple(residual.shape)}")
    if norm_weight.shape != (hidden,) or not weight.is_contiguous() or (bias is not None and bias.shape != (experts,)):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)}, a contiguous router {tuple(weight.shape)} and "
                         f"bias {None if bias is None else tuple(bias.shape)} disagree")
    constants = _route_constants(experts, top_k, num_shared, softmax, num_groups, topk_groups, group_by_top2,
                                 renormalize, bias is not None)
    block_n, split, block_k, warps, stages, stats_block = tile or ROUTER_TILE
    k_per_split = triton.cdiv(triton.cdiv(hidden, split), block_k) * block_k
    split = triton.cdiv(hidden, k_per_split)
    x = x.contiguous()
    summed = torch.empty_like(x) if residual is not None else x
    picks, device = top_k + num_shared, x.device
    weights = torch.empty(1, picks, dtype=torch.float32, device=device)
    ids = torch.empty(1, picks, dtype=torch.int32, device=device)
    parts = torch.empty(split, experts, dtype=torch.float32, device=device)
    launch = pdl.launch_options(device)
    prefetch = prefetch_lines(weight, k_per_split, block_n, launch)
    grid = (triton.cdiv(experts, block_n), split)
    _router_kernel[grid](
        x, residual.contiguous() if residual is not None else x, norm_weight, summed, weight, parts,
        last_sums.counts(device), bias if bias is not None else parts, weights, ids, hidden, k_per_split, eps, scale,
        **constants, HAS_RES=residual is not None, SPLIT=split, PROGRAMS=grid[0] * split, BLOCK_N=block_n,
        BLOCK_K=block_k, STATS_BLOCK=min(stats_block, triton.next_power_of_2(hidden)), PREFETCH=prefetch,
        LINE=pdl.LINE_BYTES // weight.element_size(), num_warps=warps, num_stages=stages, **launch,
    )
    return weights, ids, summed
