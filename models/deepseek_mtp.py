"""DeepSeek's multi-token-prediction (MTP) layers, stored in the target's own checkpoint at
``model.layers.{num_hidden_layers + j}`` (``num_nextn_predict_layers`` of them).

Layer ``j`` at position ``i`` reads the embedding of token ``i + 1`` (zeroed at position 0: there
the target's hidden state already says everything) through ``enorm``, a hidden state through
``hnorm`` (the target's final, post-norm state at ``i`` for a first draft), projects their
concatenation with ``eh_proj``, runs one decoder block (MLA + MoE, with its own latent cache) and
returns the block's output stream; ``shared_head.norm`` then the target's head give the logits of
token ``i + 2``. The embedding and ``shared_head.head`` are the target's (the checkpoint repeats
them under each layer; they are not loaded twice).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import torch
from torch import nn

from .config import ModelLoadError, parse_hf_config
from .deepseek_v3 import build_layer, check_config, load_layer_weight
from .layers import RMSNorm, RotaryEmbedding
from .llama import DEFAULT_MAX_POSITIONS
from .parallel import ReplicatedLinear
from .weights import WeightLoader

if TYPE_CHECKING:
    from .context import ForwardContext

class _RMSNorm(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...


# Tensors under each MTP layer that are the target's and stay shared.
SHARED = ("embed_tokens.weight", "shared_head.head.weight")


class MTPLayer(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = ReplicatedLinear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head = nn.ModuleDict({"norm": RMSNorm(hidden_size, eps)})


class DeepSeekMTP(nn.Module):
    """The MTP layers of a DeepSeek-V3 (or V2-layout) checkpoint. Layer ``j`` reads cache ``j`` of
    the forward context."""

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        cfg = self.config = parse_hf_config(hf_config)
        check_config(cfg)
        assert cfg.mla is not None
        if cfg.num_mtp_layers < 1:
            raise ModelLoadError(f"{cfg.architecture} checkpoint has no MTP layer (num_nextn_predict_layers is 0)")
        self.rotary = RotaryEmbedding(cfg.rope, cfg.mla.qk_rope_head_dim,
                                      cfg.max_position_embeddings or DEFAULT_MAX_POSITIONS)
        self.layers = nn.ModuleList(
            MTPLayer(build_layer(cfg, cfg.num_layers + j, j, self.rotary), cfg.hidden_size, cfg.rms_norm_eps)
            for j in range(cfg.num_mtp_layers))

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                ctx: ForwardContext, layer: int = 0, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs_embeds`` [T, H]: embeddings of the tokens one past ``positions``; ``hidden_states``
        [T, H]: the states to continue from. Returns layer ``layer``'s output stream [T, H] (what
        a further draft step reads as its hidden state; :meth:`logits_input` normalises it), or
        with ``rows`` that of those rows only: the others write their cache entries and stop after
        attention (the experts read only what the kept rows route to)."""
        mtp, ops = self.layers[layer], ctx.ops
        embeds = inputs_embeds.masked_fill((positions == 0)[:, None], 0.0)
        x = mtp.eh_proj(torch.cat([ops.rms_norm(embeds, mtp.enorm.weight, mtp.enorm.eps),
                                   ops.rms_norm(hidden_states, mtp.hnorm.weight, mtp.hnorm.eps)], dim=-1))
        x, residual = mtp.block(x, None, positions, ctx, rows=rows)
        return x + residual

    def logits_input(self, hidden: torch.Tensor, ops: _RMSNorm, layer: int = 0) -> torch.Tensor:
        """``shared_head.norm`` of layer ``layer``'s output: what the target's head turns into logits."""
        norm = self.layers[layer].shared_head["norm"]
        return ops.rms_norm(hidden, norm.weight, norm.eps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """From the whole checkpoint's tensors, those under ``model.layers.{num_hidden_layers + j}``."""
        cfg = self.config
        loader = WeightLoader(self, cfg.architecture)
        for hf_name, tensor in weights:
            match = re.match(r"model\.layers\.(\d+)\.(.*)", hf_name)
            if match is None or int(match[1]) < cfg.num_layers:
                continue
            j, name = int(match[1]) - cfg.num_layers, match[2]
            if j >= len(self.layers) or name in SHARED:
                continue
            if name.startswith(("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")):
                load_layer_weight(loader, self.layers[j].block, f"layers.{j}.block.", name, hf_name, tensor)
            else:
                loader.copy(hf_name, f"layers.{j}.{name}", None, tensor)
        loader.check_complete()
