"""Mixture-of-experts routing in one kernel, one program per token: scores from the router logits
(sigmoid or softmax, float32), the optional group limit, the top-k picks and their weights, and
the shared experts appended as always-picked experts of weight 1.

Written as DeepSeek's routers are: picks use ``score + bias`` (V3's correction bias), weights use
``score``; with groups, the best ``topk_groups`` of ``num_groups`` groups are kept, ranked by the
sum of their two best choices (``group_by_top2``, V3) or by their best one (V2), the others masked
to -inf (V3) or 0 (V2); weights are renormalised over the picks (``renormalize``, plus 1e-20) and
scaled. Picks are made by repeated argmax (lowest index on ties), in descending order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_previous


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
    tl.store(weights_ptr + t * stride_o + k, picked_w, mask=out)
    tl.store(ids_ptr + t * stride_o + k, picked_id, mask=out)


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, num_shared: int = 0, *,
              softmax: bool = False, num_groups: int = 1, topk_groups: int = 1, group_by_top2: bool = True,
              renormalize: bool = True, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` float32 ``[T, E]`` (unit last stride); ``bias`` float32 ``[E]`` or None. Returns
    (weights float32 ``[T, top_k + num_shared]``, expert ids int32 ``[T, top_k + num_shared]``)."""
    tokens, experts = logits.shape
    if logits.stride(-1) != 1 or (bias is not None and bias.shape != (experts,)):
        raise ValueError(f"logits {tuple(logits.shape)} need a unit last stride, bias [{experts}]")
    if experts % num_groups or top_k > experts:
        raise ValueError(f"{experts} experts in {num_groups} groups, top {top_k}: not possible")
    picks = top_k + num_shared
    weights = torch.empty(tokens, picks, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, picks, dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    grouped = num_groups > 1 and topk_groups < num_groups
    _moe_route_kernel[(tokens,)](
        logits, bias if bias is not None else logits, weights, ids, logits.stride(0), picks, scale,
        NUM_EXPERTS=experts, EXPERTS_PAD=triton.next_power_of_2(experts), NUM_GROUPS=num_groups if grouped else 1,
        GROUPS_PAD=triton.next_power_of_2(num_groups), TOPK_GROUPS=topk_groups, TOP_K=top_k, NUM_SHARED=num_shared,
        PICKS_PAD=triton.next_power_of_2(picks), SOFTMAX=softmax, HAS_BIAS=bias is not None,
        GROUP_BY_TOP2=group_by_top2, RENORMALIZE=renormalize, num_warps=4 if experts >= 128 else 1,
        **pdl.launch_options(logits.device),
    )
    return weights, ids
