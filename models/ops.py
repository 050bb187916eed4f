"""The ops a model's layers call, in two interchangeable sets: the torch reference and fused Triton
kernels. A model has one forward; whoever runs it picks the set through
``ForwardContext.ops``, so the same module runs on a CPU, on a GPU with plain PyTorch, or on a GPU
with the fused kernels, and the torch set stays the oracle for the Triton one.

The residual stream is carried as ``(x, residual)``: a block's output ``x`` is added to the
residual only inside the next norm (:meth:`Ops.add_rms_norm`), which the Triton set does in the
norm's kernel. Rounding follows Hugging Face's layers in both sets (float32 statistics, the
normalised value rounded to the activation dtype before its weight multiplies it); the GPU compiler
may keep some products in float32, so in bf16 the sets agree up to near-ties, in float32 exactly.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .attention import PAGED_KV_LAYOUT, AttentionBackend, AttentionMetadata
from .config import MoEConfig
from .layers import RotaryEmbedding, rms_norm


class ForwardContext(Protocol):
    """What the attention op reads of ``models.context.ForwardContext``."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]

    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor: ...


class AttentionShape(Protocol):
    """What the attention op reads from an attention layer."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_size: int
    kv_size: int
    scale: float
    q_norm: torch.nn.Module | None  # per-head RMSNorm of q and k (Qwen3), or None
    k_norm: torch.nn.Module | None
    rotary: RotaryEmbedding


class LatentAttentionShape(Protocol):
    """What the MLA op reads from an MLA layer (``models.mla.MLAttention``)."""

    layer_idx: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float
    kv_a_layernorm: torch.nn.Module
    rotary: RotaryEmbedding

    @property
    def w_uk(self) -> torch.Tensor: ...

    @property
    def w_uv_t(self) -> torch.Tensor: ...


class Ops(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` [rows, N] normalised and scaled by ``weight``."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` normalised, and that sum (the new residual). May update ``residual`` in
        place."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x = [gate | up]`` [rows, 2I] -> [rows, I]."""

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (int64, ties to the lowest index): a proposer's greedy drafts."""

    def attention(self, attn: AttentionShape, qkv: torch.Tensor, positions: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        """From the fused qkv projection [T, (Hq + 2 Hkv) D] to the attention output [T, Hq D]: the
        optional q/k norms, the rotary embedding, the KV write and attention over the cache."""

    def mla_attention(self, attn: LatentAttentionShape, q: torch.Tensor, latent: torch.Tensor,
                      positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Multi-head latent attention from the query [T, H (nope + rope)] and the latent projection
        [T, kv_lora_rank + rope] to the heads' outputs [T, H v]: the latent's norm, the rotary
        embedding, the latent cache write, W_UK folded into q, attention over the cached latents
        (``LatentAttentionBackend``), W_UV. ``q`` may be rotated in place."""

    def moe_route(self, logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts each token picks from its router logits [T, E] (float32), and their weights:
        ([T, top_k + S] float32, [T, top_k + S] int32), the last ``S`` columns being the shared
        experts ``E .. E + S - 1`` with weight 1 (see ``models.moe``)."""

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        """Routed experts: ``sum_k topk_weights[t, k] * (silu(x w13_e[:I]^T) * (x w13_e[I:]^T)) w2_e^T`` with
        ``e = topk_ids[t, k]``; ``x`` [T, H], ``w13`` [E, 2I, H], ``w2`` [E, H, I]."""


class TorchOps:
    """The reference: plain PyTorch, any device."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def attention(self, attn: AttentionShape, qkv: torch.Tensor, positions: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(-1, attn.num_heads, attn.head_dim)
        k = k.view(-1, attn.num_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q = rms_norm(q, attn.q_norm.weight, attn.q_norm.eps)
            k = rms_norm(k, attn.k_norm.weight, attn.k_norm.eps)
        q, k = attn.rotary(positions, q, k)
        out = ctx.attention(attn.layer_idx, q, k, v, attn.scale)
        return out.reshape(-1, attn.q_size)

    def mla_attention(self, attn: LatentAttentionShape, q: torch.Tensor, latent: torch.Tensor,
                      positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens, heads, nope, rank = q.shape[0], attn.num_heads, attn.qk_nope_head_dim, attn.kv_lora_rank
        q_nope, q_rope = q.unflatten(-1, (heads, -1)).split([nope, attn.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = latent.split([rank, attn.qk_rope_head_dim], dim=-1)
        c_kv = rms_norm(c_kv, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps)
        q_rope, k_rope = attn.rotary(positions, q_rope, k_rope[:, None, :])
        q_latent = torch.bmm(q_nope.transpose(0, 1), attn.w_uk).transpose(0, 1)
        out = ctx.backend.forward_latent(q_latent, q_rope, torch.cat([c_kv, k_rope[:, 0]], dim=-1),
                                         ctx.kv_caches[attn.layer_idx], ctx.metadata, attn.scale)
        return torch.bmm(out.transpose(0, 1), attn.w_uv_t).transpose(0, 1).reshape(tokens, heads * attn.v_head_dim)

    def moe_route(self, logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + bias if bias is not None else scores
        if moe.topk_method != "greedy" and moe.topk_groups < moe.num_groups:
            grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
            v3 = moe.topk_method == "noaux_tc"  # groups ranked by their top-2 sum, else by their best
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if v3 else grouped.amax(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(moe.topk_groups, dim=-1)[1], 1.0)
            choice = grouped.masked_fill(keep[:, :, None] == 0, float("-inf") if v3 else 0.0).flatten(1)
        ids = choice.topk(moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * moe.routed_scaling_factor
        shared = torch.arange(moe.num_experts, moe.num_experts + moe.num_shared_experts, device=ids.device)
        ids = torch.cat([ids, shared.expand(ids.shape[0], -1)], dim=1).to(torch.int32)
        return torch.cat([weights, torch.ones(ids.shape[0], moe.num_shared_experts, device=ids.device)], dim=1), ids

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in topk_ids.unique().tolist():  # the experts some token picked
            token, slot = (topk_ids == e).nonzero(as_tuple=True)
            h = F.linear(self.silu_and_mul(F.linear(x[token], w13[e])), w2[e])
            out.index_add_(0, token, (h * topk_weights[token, slot, None]).to(out.dtype))
        return out


class TritonOps:
    """Fused Triton kernels (``specloop.kernels``): RMSNorm with the residual add, SiLU-and-mul,
    and, for a cache in the standard paged layout, q/k norms + rotary + KV write in one kernel before
    the backend's attention. Any torch device the kernels run on (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``)."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from specloop.kernels.rms_norm import rms_norm

        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        from specloop.kernels.rms_norm import rms_norm

        return rms_norm(x, weight, eps, residual=residual), residual

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 2 or logits.stride(-1) != 1:
            return logits.argmax(dim=-1)
        from specloop.kernels.sampling import argmax_rows

        return argmax_rows(logits)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        from specloop.kernels.activation import silu_and_mul

        return silu_and_mul(x)

    def attention(self, attn: AttentionShape, qkv: torch.Tensor, positions: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        tokens = qkv.shape[0]
        rope = attn.rotary
        norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
        eps = attn.q_norm.eps if attn.q_norm is not None else 0.0
        if getattr(ctx.backend, "kv_layout", None) == PAGED_KV_LAYOUT:
            from specloop.kernels.qk_rope_cache import qk_rope_cache

            kv_cache = ctx.kv_caches[attn.layer_idx]
            attend_rope = getattr(ctx.backend, "attend_rope", None)  # a decode step, in one kernel
            out = attend_rope(attn, qkv, positions, kv_cache, ctx.metadata) if attend_rope is not None else None
            if out is not None:
                return out.view(tokens, attn.q_size)
            q = qk_rope_cache(qkv, attn.num_heads, attn.num_kv_heads, positions, rope.cos, rope.sin, kv_cache[0],
                              kv_cache[1], ctx.metadata.slot_mapping, *norms, eps=eps)
            out = ctx.backend.attend(q, kv_cache, ctx.metadata, attn.scale)
            return out.view(tokens, attn.q_size)
        from specloop.kernels.rms_norm import rms_norm
        from specloop.kernels.rotary import rotary_embedding

        q = qkv[:, :attn.q_size].view(tokens, attn.num_heads, attn.head_dim)
        k = qkv[:, attn.q_size:attn.q_size + attn.kv_size].view(tokens, attn.num_kv_heads, attn.head_dim)
        v = qkv[:, attn.q_size + attn.kv_size:].view(tokens, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            rms_norm(q, norms[0], eps, out=q)
            rms_norm(k, norms[1], eps, out=k)
        rotary_embedding(q, k, positions, rope.cos, rope.sin)
        return ctx.attention(attn.layer_idx, q, k, v, attn.scale).view(tokens, attn.q_size)

    def mla_attention(self, attn: LatentAttentionShape, q: torch.Tensor, latent: torch.Tensor,
                      positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if getattr(ctx.backend, "kv_layout", None) != PAGED_KV_LAYOUT:
            return TORCH_OPS.mla_attention(attn, q, latent, positions, ctx)
        from specloop.kernels.mla_rope_cache import mla_rope_cache

        tokens, heads, nope = q.shape[0], attn.num_heads, attn.qk_nope_head_dim
        q = q.unflatten(-1, (heads, -1))
        q_rope = q[:, :, nope:]
        kv_cache, norm = ctx.kv_caches[attn.layer_idx], attn.kv_a_layernorm
        mla_rope_cache(q_rope, latent, positions, attn.rotary.cos, attn.rotary.sin, norm.weight, norm.eps, kv_cache,
                       ctx.metadata.slot_mapping)
        q_latent = self.head_matmul(q[:, :, :nope], attn.w_uk)
        out = ctx.backend.attend_latent(q_latent, q_rope, kv_cache, ctx.metadata, attn.scale)
        return self.head_matmul(out, attn.w_uv_t).reshape(tokens, heads * attn.v_head_dim)

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per-head products: ``x`` ``[T, H, K]``, ``w`` ``[H, K, N]`` -> ``[T, H, N]``."""
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)

    def moe_route(self, logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        from specloop.kernels.moe_route import moe_route

        return moe_route(logits, bias, moe.top_k, moe.num_shared_experts, **route_options(moe))

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        from specloop.kernels.fused_moe import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids)


def add_norm(ops: Ops, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.nn.Module
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm(residual + x)`` and the new residual (``x`` itself when ``residual`` is None)."""
    if residual is None:
        return ops.rms_norm(x, norm.weight, norm.eps), x
    return ops.add_rms_norm(x, residual, norm.weight, norm.eps)


def _composed_norm_linear(ops: Ops, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.nn.Module,
                          linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    h, residual = add_norm(ops, x, residual, norm)
    return linear(h), residual


def norm_linear(ops: Ops, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.nn.Module,
                linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(norm(residual + x))`` and the new residual (``x`` itself when ``residual`` is None),
    through ``ops.norm_linear`` when the set fuses them, else its norm then ``linear``."""
    fused = getattr(ops, "norm_linear", None)
    return fused(x, residual, norm, linear) if fused is not None else _composed_norm_linear(ops, x, residual, norm,
                                                                                           linear)


def route_options(moe: MoEConfig) -> dict[str, object]:
    """``kernels.moe_route``'s keyword arguments for ``moe``'s router."""
    return dict(softmax=moe.scoring == "softmax", num_groups=moe.num_groups if moe.topk_method != "greedy" else 1,
                topk_groups=moe.topk_groups, group_by_top2=moe.topk_method == "noaux_tc",
                renormalize=moe.norm_topk_prob, scale=moe.routed_scaling_factor)


def _composed_norm_moe(ops: Ops, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.nn.Module,
                       moe: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    h, residual = add_norm(ops, x, residual, norm)
    return moe(h, ops), residual


def norm_moe(ops: Ops, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.nn.Module,
             moe: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe(norm(residual + x))`` (a ``models.moe.MoE``) and the new residual, through
    ``ops.norm_moe`` when the set fuses the norm into the experts' kernels."""
    fused = getattr(ops, "norm_moe", None)
    return fused(x, residual, norm, moe) if fused is not None else _composed_norm_moe(ops, x, residual, norm, moe)


def gated_linear(ops: Ops, gate_up: torch.Tensor, linear: torch.nn.Module) -> torch.Tensor:
    """``linear(silu(gate) * up)``, through ``ops.gated_linear`` when the set fuses them."""
    fused = getattr(ops, "gated_linear", None)
    return fused(gate_up, linear) if fused is not None else linear(ops.silu_and_mul(gate_up))


TORCH_OPS = TorchOps()
TRITON_OPS = TritonOps()
