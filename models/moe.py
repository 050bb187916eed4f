"""DeepSeek's mixture of experts: the router's weights and the experts, stored as fused tensors.

The router scores every expert (``ops.moe_route``: a sigmoid for V3, a softmax for V2, in
float32), picks ``top_k`` of them, optionally only among the best ``topk_group`` of ``n_group``
groups, and weighs each pick by its score (renormalised over the picks when ``norm_topk_prob``,
times ``routed_scaling_factor``). V3's ``e_score_correction_bias`` shifts the scores used to *pick*
experts, never the weights.

The routed experts are ``w13`` ``[E + S, 2I, H]`` (each expert's gate and up projections) and ``w2``
``[E + S, H, I]``, run by ``ops.fused_moe``. The ``S`` shared experts (one MLP of ``S * I`` every
token passes) are stored as the last ``S`` experts: a gated MLP split along its intermediate units
is the sum of the pieces, so every token simply also picks experts ``E .. E + S - 1`` with weight 1,
and one grouped GEMM pair computes the routed and the shared experts together.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig
from .weights import WeightLoader


class _MoEOps(Protocol):
    def moe_route(self, logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
                  ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor: ...


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
        e, i = moe.num_experts + moe.num_shared_experts, moe.intermediate_size
        self.intermediate_size = i
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i))


class MoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.config = moe
        self.gate = Router(hidden_size, moe)
        self.experts = Experts(hidden_size, moe)

    def forward(self, x: torch.Tensor, ops: _MoEOps) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight)
        weights, ids = ops.moe_route(logits, self.gate.e_score_correction_bias, self.config)
        return ops.fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)


_EXPERT_PARTS = {"gate_proj.weight": ("w13", 0), "up_proj.weight": ("w13", 1), "down_proj.weight": ("w2", None)}


def load_expert_weight(loader: WeightLoader, moe: MoE, prefix: str, name: str, hf_name: str, tensor: torch.Tensor
                       ) -> bool:
    """Copy ``mlp.<name>`` of a MoE layer if it is an expert tensor: per-expert names
    (``experts.{e}.gate_proj.weight``, ...), the fused ones transformers keeps in memory
    (``experts.gate_up_proj``, ``experts.down_proj``), or the shared experts' MLP
    (``shared_experts.{gate,up,down}_proj.weight``). ``prefix`` is the MoE module's parameter prefix.
    Returns False for any other tensor."""
    cfg, experts = moe.config, moe.experts
    e, s, i = cfg.num_experts, cfg.num_shared_experts, experts.intermediate_size
    w13, w2 = f"{prefix}experts.w13", f"{prefix}experts.w2"
    if name in ("experts.gate_up_proj", "experts.down_proj"):
        target = w13 if name == "experts.gate_up_proj" else w2
        loader.copy_to(hf_name, target, "routed", loader.params[target][:e], tensor)
        return True
    if name.startswith("shared_experts.") and name.removeprefix("shared_experts.") in _EXPERT_PARTS:
        param, half = _EXPERT_PARTS[name.removeprefix("shared_experts.")]
        if param == "w13":
            dest = loader.params[w13][e:, half * i:(half + 1) * i]
            loader.copy_to(hf_name, w13, ("shared", half), dest, tensor.view(s, i, -1))
        else:  # [H, S * I]: expert e + k takes columns k * I .. (k + 1) * I
            loader.copy_to(hf_name, w2, "shared", loader.params[w2][e:], tensor.view(tensor.shape[0], s, i)
                           .permute(1, 0, 2))
        return True
    expert, _, rest = name.removeprefix("experts.").partition(".")
    if not name.startswith("experts.") or not expert.isdigit() or int(expert) >= e or rest not in _EXPERT_PARTS:
        return False
    param, half = _EXPERT_PARTS[rest]
    target = w13 if param == "w13" else w2
    dest = loader.params[target][int(expert)]
    loader.copy_to(hf_name, target, (int(expert), half), dest if half is None else dest[half * i:(half + 1) * i], tensor)
    return True
