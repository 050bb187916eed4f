"""DeepSeek-V3 and DeepSeek-V2: decoder layers of multi-head latent attention (``mla.py``) and a
mixture of experts (``moe.py``, dense for the first ``first_k_dense_replace`` layers).

Same interface as the Llama family (``models/llama.py``): packed ragged batches, ops through the
forward context, the residual stream carried as ``(x, residual)``, final post-norm hidden states.
The KV cache is MLA's latent cache (``ModelConfig.kv_cache_shape``). Checkpoint tensors of the
multi-token-prediction layers (``model.layers.{num_hidden_layers}`` and after) are not part of this
model: the ``mtp`` proposer loads them (``models/deepseek_mtp.py``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn

from .config import ModelConfig, ModelLoadError, parse_hf_config
from .causal_lm import CausalLM
from .layers import GatedMLP, RMSNorm, RotaryEmbedding
from .llama import DEFAULT_MAX_POSITIONS
from .mla import MLAttention, deinterleave_rope_rows, mla_weight_target
from .moe import MoE, load_expert_weight
from .ops import add_norm, gated_linear, norm_linear, norm_moe
from .parallel import ReplicatedLinear
from .weights import WeightLoader

if TYPE_CHECKING:
    from .context import ForwardContext


def check_config(cfg: ModelConfig) -> None:
    if cfg.mla is None:
        raise ModelLoadError(f"{cfg.architecture} needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim "
                             "and v_head_dim in config.json")
    if cfg.mla.qk_rope_head_dim % 2:
        raise ModelLoadError("qk_rope_head_dim must be even")


class DeepseekDecoderLayer(nn.Module):
    """``layer_idx`` indexes the forward context's caches; ``moe`` picks the feed-forward."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_idx, rotary, bias=bool(cfg.hf.get("attention_bias", False)))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MoE | GatedMLP = MoE(cfg.hidden_size, cfg.moe) if moe and cfg.moe is not None else \
            GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                ctx: ForwardContext, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` (indices into the step's rows): only those go on past attention, and the
        outputs are theirs; every row still writes its cache entry (a draft layer's feed, whose
        other rows are fed for their entries alone)."""
        # Each norm runs with the projection (or the experts) after it as one op where the op set
        # fuses them (``ops.norm_linear``, ``ops.norm_moe``: the few-rows kernels at one row).
        ops, attn, mlp = ctx.ops, self.self_attn, self.mlp
        if attn.fused_qkv_a:
            qkv_a, residual = norm_linear(ops, x, residual, self.input_layernorm, attn.qkv_a_proj)
            x = attn.attend(qkv_a, positions, ctx)
        else:
            h, residual = add_norm(ops, x, residual, self.input_layernorm)
            x = attn(h, positions, ctx)
        if rows is not None:
            x, residual = x.index_select(0, rows), residual.index_select(0, rows)
        if isinstance(mlp, GatedMLP):
            gate_up, residual = norm_linear(ops, x, residual, self.post_attention_layernorm, mlp.gate_up_proj)
            return gated_linear(ops, gate_up, mlp.down_proj), residual
        return norm_moe(ops, x, residual, self.post_attention_layernorm, mlp)


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 (and V2, whose differences are all in ``config.json``: softmax routing without the
    correction bias, no q LoRA on V2-Lite). The interface: :class:`~.causal_lm.CausalLM`."""

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        cfg = self.config = parse_hf_config(hf_config)
        check_config(cfg)
        assert cfg.mla is not None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.mla.qk_rope_head_dim,
                                      cfg.max_position_embeddings or DEFAULT_MAX_POSITIONS)
        self.layers = nn.ModuleList(build_layer(cfg, i, i, self.rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ReplicatedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters (fusing as :func:`load_layer_weight` does);
        the MTP layers' tensors are skipped. Raises :class:`ModelLoadError` on a missing,
        unexpected or misshapen tensor."""
        cfg = self.config
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        loader = WeightLoader(self, cfg.architecture)
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            match = re.match(r"layers\.(\d+)\.(.*)", name)
            if match is None:
                loader.copy(hf_name, name, None, tensor)
            elif int(match[1]) < cfg.num_layers:
                layer = int(match[1])
                load_layer_weight(loader, self.layers[layer], f"layers.{layer}.", match[2], hf_name, tensor)
        skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        loader.check_complete(skip)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    pass


def build_layer(cfg: ModelConfig, checkpoint_idx: int, cache_idx: int, rotary: RotaryEmbedding
                ) -> DeepseekDecoderLayer:
    """The decoder layer stored as ``model.layers.{checkpoint_idx}`` (which decides dense or MoE),
    reading cache ``cache_idx`` of the forward context."""
    moe = cfg.moe is not None and cfg.moe.is_moe_layer(checkpoint_idx)
    return DeepseekDecoderLayer(cfg, cache_idx, rotary, moe)


_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def load_layer_weight(loader: WeightLoader, layer: DeepseekDecoderLayer, prefix: str, name: str, hf_name: str,
                      tensor: torch.Tensor) -> None:
    """One checkpoint tensor of a decoder layer (``name`` relative to the layer, ``prefix`` the
    layer's parameter prefix): q and kv_a fused into ``qkv_a_proj``, rotary rows de-interleaved,
    gate/up fused, per-expert and shared-expert tensors stacked into the fused expert tensors."""
    attn = layer.self_attn
    if name.startswith("self_attn."):
        rel = name.removeprefix("self_attn.")
        if attn.rope_interleave:
            tensor = deinterleave_rope_rows(tensor, rel, attn)
        target, shard = mla_weight_target(rel, attn)
        split = None if shard is None else [attn.q_a_size, attn.kv_lora_rank + attn.qk_rope_head_dim]
        loader.copy(hf_name, f"{prefix}self_attn.{target}", None if shard is None else (shard,), tensor, split)
        return
    if isinstance(layer.mlp, MoE) and name.startswith("mlp.") and \
            load_expert_weight(loader, layer.mlp, prefix + "mlp.", name.removeprefix("mlp."), hf_name, tensor):
        return
    parts = name.rsplit(".", 2)  # e.g. ["mlp", "gate_proj", "weight"]
    if len(parts) == 3 and parts[1] in _GATE_UP and parts[0] == "mlp":
        loader.copy(hf_name, f"{prefix}{parts[0]}.gate_up_proj.{parts[2]}", (_GATE_UP[parts[1]],), tensor,
                    [tensor.shape[0]] * 2)
        return
    loader.copy(hf_name, prefix + name, None, tensor)
