"""The Llama decoder (Llama 2 and 3), shared by every architecture that differs from it only by flags
(Qwen2: q/k/v bias; Qwen3: per-head q/k RMSNorm).

The model works on packed ragged batches: ``input_ids`` and ``positions`` are [T], and attention,
norms and activations run through the :class:`~specloop.models.attention.ForwardContext`'s ops
(the torch reference or fused Triton kernels), so the model knows nothing about requests, the
scheduler, the paged cache layout or the device. The residual stream is carried as
``(x, residual)`` and added inside the next norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn

from .config import ModelConfig, ModelLoadError, parse_hf_config
from .causal_lm import CausalLM
from .layers import GatedMLP, RMSNorm, RotaryEmbedding
from .ops import gated_linear, norm_linear
from .parallel import (SINGLE, CheckpointSource, ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                       TensorParallel, VocabParallelEmbedding, head_shard, load_parameter)

if TYPE_CHECKING:
    from .context import ForwardContext

# Rotary tables cover max_position_embeddings; a config without it gets this many positions.
DEFAULT_MAX_POSITIONS = 32768


class Attention(nn.Module):
    """Grouped-query attention over this rank's heads (all of them at tensor-parallel size 1)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        q = head_shard(cfg.num_heads, cfg.head_dim, tp)
        kv = head_shard(cfg.num_kv_heads, cfg.head_dim, tp)
        self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = q.size // cfg.head_dim, kv.size // cfg.head_dim
        self.q_size, self.kv_size = q.size, kv.size
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, (q, kv, kv), bias=qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(q.full, cfg.hidden_size, bias=o_bias, tp=tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.__dict__["rotary"] = rotary  # shared with the other layers, owned by the model

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), positions, ctx)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """From the fused q/k/v projection on: the attention op, then the output projection."""
        return self.o_proj(ctx.ops.attention(self, qkv, positions, ctx))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, mlp_bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, rotary, qkv_bias, o_bias, qk_norm, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, mlp_bias, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` is the stream entering the layer (``residual`` None: ``x`` alone);
        returns the block's output and the stream it is to be added to."""
        ops, attn, mlp = ctx.ops, self.self_attn, self.mlp
        qkv, residual = norm_linear(ops, x, residual, self.input_layernorm, attn.qkv_proj)
        x = attn.attend(qkv, positions, ctx)
        gate_up, residual = norm_linear(ops, x, residual, self.post_attention_layernorm, mlp.gate_up_proj)
        return gated_linear(ops, gate_up, mlp.down_proj), residual


# HF checkpoint names of the projections that specloop stores fused: original -> (fused, part).
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaForCausalLM(CausalLM):
    """Decoder-only transformer with pre-norm blocks, GQA, RoPE and a SwiGLU MLP (the interface:
    :class:`~.causal_lm.CausalLM`).

    With ``tp`` (tensor parallelism) each rank builds its shard of the same model: its heads and MLP
    slice, its rows of the vocabulary; the residual stream and the logits are whole on every rank.
    """

    def __init__(self, hf_config: dict[str, Any], tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        cfg = self.config = parse_hf_config(hf_config)
        flags = self.flags(hf_config)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings or DEFAULT_MAX_POSITIONS)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary, **flags, tp=tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def flags(cls, hf: dict[str, Any]) -> dict[str, bool]:
        """Architecture switches read from ``config.json``; subclasses override."""
        bias = bool(hf.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "mlp_bias": bool(hf.get("mlp_bias", False))}

    def load_weights(self, weights: Iterable[tuple[str, CheckpointSource]]) -> None:
        """Copy HF-named tensors into the parameters, fusing q/k/v and gate/up on the way; under
        tensor parallelism each parameter takes only its rank's slice. Raises
        :class:`ModelLoadError` naming any parameter the checkpoint lacks, any unexpected tensor or
        any tensor of the wrong shape."""
        if self.config.tie_word_embeddings:  # materialising from the meta device unties them
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        filled: dict[str, set[int]] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, part = name, None
            for original, (fused, index) in _FUSED.items():
                if f".{original}." in name:
                    target, part = name.replace(original, fused), index
                    break
            if target not in params:
                raise ModelLoadError(f"unexpected tensor {hf_name!r} in the checkpoint for {self.config.architecture}")
            module, _, param = target.rpartition(".")
            try:
                load_parameter(modules[module], param, tensor, part)
            except ModelLoadError as e:
                raise ModelLoadError(f"tensor {hf_name!r} {e}") from None
            filled.setdefault(target, set()).add(-1 if part is None else part)
        expected = {n: {i for f, i in _FUSED.values() if f".{f}." in n} or {-1}
                    for n in params if not (n == "lm_head.weight" and self.config.tie_word_embeddings)}
        missing = sorted(n for n, parts in expected.items() if filled.get(n, set()) != parts)
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensor(s) of "
                                 f"{self.config.architecture}: {', '.join(missing[:5])}")
