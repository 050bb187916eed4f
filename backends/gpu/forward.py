"""The Llama-family forward pass on fused Triton kernels, reading the reference model's weights.

Same math as ``LlamaForCausalLM.forward`` (Llama, Qwen2, Qwen3), rounded the same way up to what
the GPU compiler keeps in float32 (equal in float32; in bf16 greedy outputs agree up to near-ties),
with fewer passes over memory:

* the residual add is fused into the following RMSNorm (``residual += x; h = norm(residual)``),
  so the stream is carried as ``(x, residual)`` and summed only where a layer's input is needed
  whole (the final norm, and the ``aux_layers`` EAGLE-3 reads);
* Qwen3's per-head q/k norms, the rotary embedding and the KV write are one kernel on the fused qkv
  projection (``kernels/qk_rope_cache.py``) when the attention backend is ``triton``; with another
  backend they run as separate in-place kernels and the backend writes the KV;
* SiLU-and-mul is one kernel. The projections stay cuBLAS matmuls (``nn.Linear``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from specloop.backends.attention import ForwardContext
from specloop.backends.gpu.attention import TritonAttentionBackend
from specloop.kernels.activation import silu_and_mul
from specloop.kernels.qk_rope_cache import qk_rope_cache
from specloop.kernels.rms_norm import rms_norm
from specloop.kernels.rotary import rotary_embedding


@dataclass(slots=True)
class RopeTables:
    """cos/sin of every position up to ``max_len``, float32 ``[max_len, head_dim // 2]``, computed
    with the same float32 ops as ``RotaryEmbedding.forward``."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(cls, inv_freq: torch.Tensor, max_len: int, device: torch.device) -> RopeTables:
        freqs = torch.arange(max_len, device=device).float()[:, None] * inv_freq.to(device).float()[None, :]
        return cls(freqs.cos().contiguous(), freqs.sin().contiguous())


def supports(model: nn.Module) -> bool:
    """Whether :func:`fused_forward` knows this model's layer structure."""
    from specloop.plugins.models.llama import LlamaForCausalLM

    return isinstance(model, LlamaForCausalLM)


def fused_forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                  rope: RopeTables, aux_layers: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``model.forward``'s contract: final normed hidden states [T, hidden] and the residual
    stream entering each of ``aux_layers``."""
    x = model.embed(input_ids)
    residual: torch.Tensor | None = None
    aux: list[torch.Tensor] = []
    for i, layer in enumerate(model.layers):
        if i in aux_layers:
            aux.append(x if residual is None else x + residual)
        norm = layer.input_layernorm
        if residual is None:
            residual = x
            h = rms_norm(x, norm.weight, norm.eps)
        else:
            h = rms_norm(x, norm.weight, norm.eps, residual=residual)
        x = _attention(layer.self_attn, h, positions, ctx, rope)
        norm = layer.post_attention_layernorm
        h = rms_norm(x, norm.weight, norm.eps, residual=residual)
        mlp = layer.mlp
        x = mlp.down_proj(silu_and_mul(mlp.gate_up_proj(h)))
    if len(model.layers) in aux_layers:
        aux.append(x + residual)
    return rms_norm(x, model.norm.weight, model.norm.eps, residual=residual), aux


def _attention(attn: nn.Module, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
               rope: RopeTables) -> torch.Tensor:
    qkv = attn.qkv_proj(h)
    tokens = qkv.shape[0]
    if isinstance(ctx.backend, TritonAttentionBackend):
        # q/k norms, rotary and the KV write in one kernel; attention then reads the cache.
        kv_cache = ctx.kv_caches[attn.layer_idx]
        norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
        q = qk_rope_cache(qkv, attn.num_heads, attn.num_kv_heads, positions, rope.cos, rope.sin, kv_cache[0],
                          kv_cache[1], ctx.metadata.slot_mapping, *norms,
                          eps=attn.q_norm.eps if attn.q_norm is not None else 0.0)
        out = ctx.backend.attend(q, kv_cache, ctx.metadata, attn.scale)
        return attn.o_proj(out.view(tokens, attn.q_size))
    q = qkv[:, :attn.q_size].view(tokens, attn.num_heads, attn.head_dim)
    k = qkv[:, attn.q_size:attn.q_size + attn.kv_size].view(tokens, attn.num_kv_heads, attn.head_dim)
    v = qkv[:, attn.q_size + attn.kv_size:].view(tokens, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        rms_norm(q, attn.q_norm.weight, attn.q_norm.eps, out=q)
        rms_norm(k, attn.k_norm.weight, attn.k_norm.eps, out=k)
    rotary_embedding(q, k, positions, rope.cos, rope.sin)
    out = ctx.attention(attn.layer_idx, q, k, v, attn.scale)
    return attn.o_proj(out.view(tokens, attn.q_size))
