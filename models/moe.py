"""DeepSeek's mixture of experts: the router, the routed experts stored as fused tensors, and the
shared experts.

The router scores every expert (a sigmoid for V3, a softmax for V2) in float32, picks ``top_k`` of
them, optionally only among the best ``topk_group`` of ``n_group`` groups, and weighs each pick by
its score (renormalised over the picks when ``norm_topk_prob``, times ``routed_scaling_factor``). V3's
``e_score_correction_bias`` shifts the scores used to *pick* experts, never the weights. The routed
experts are ``w13`` ``[E, 2I, H]`` (each expert's gate and up projections) and ``w2`` ``[E, H, I]``,
run by the op set's ``fused_moe``; the shared experts are one dense gated MLP every token passes.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig
from .layers import GatedMLP, _SiluAndMul


class _MoEOps(_SiluAndMul, Protocol):
    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor: ...


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] -> (weights [T, top_k] float32, expert ids [T, top_k] int64). Device-side
    only (no host synchronisation), so it runs inside CUDA graphs."""
    logits = F.linear(x.float(), gate_weight.float())
    scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + bias if bias is not None else scores
    if moe.topk_method != "greedy" and moe.topk_groups < moe.num_groups:
        grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if moe.topk_method == "noaux_tc" else grouped.amax(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(moe.topk_groups, dim=-1)[1], 1.0)
        masked = grouped.masked_fill(keep[:, :, None] == 0, float("-inf") if moe.topk_method == "noaux_tc" else 0.0)
        choice = masked.view(-1, moe.num_experts)
    ids = choice.topk(moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class Router(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        # float32 like the reference implementation: near-equal scores must pick the same experts.
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=torch.float32))
        if moe.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None


class Experts(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        self.intermediate_size = i
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i))


class MoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.config = moe
        self.gate = Router(hidden_size, moe)
        self.experts = Experts(hidden_size, moe)
        self.shared_experts = GatedMLP(hidden_size, moe.intermediate_size * moe.num_shared_experts) \
            if moe.num_shared_experts else None

    def forward(self, x: torch.Tensor, ops: _MoEOps) -> torch.Tensor:
        weights, ids = route(x, self.gate.weight, self.gate.e_score_correction_bias, self.config)
        out = ops.fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, ops)
        return out


def expert_weight_target(name: str, moe: MoEConfig) -> tuple[str, tuple[int, ...] | None] | None:
    """Where the checkpoint tensor ``mlp.experts.<name>`` goes: (parameter under ``mlp.experts.``,
    index into it or None for the whole tensor), for per-expert names (``{e}.gate_proj.weight``,
    ``{e}.up_proj.weight``, ``{e}.down_proj.weight``) and the fused ones transformers keeps in memory
    (``gate_up_proj``, ``down_proj``). None: not an expert tensor this model has."""
    if name == "gate_up_proj":
        return "w13", None
    if name == "down_proj":
        return "w2", None
    expert, _, rest = name.partition(".")
    if not expert.isdigit() or int(expert) >= moe.num_experts:
        return None
    e = int(expert)
    return {"gate_proj.weight": ("w13", (e, 0)), "up_proj.weight": ("w13", (e, 1)),
            "down_proj.weight": ("w2", (e,))}.get(rest)
