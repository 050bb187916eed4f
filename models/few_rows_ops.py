"""The few-rows op set: the Triton set with the GPU runner's fused kernels for steps of a few
rows (a decode step at small batch; an MTP draft), chosen by its ``skinny_gemv`` option."""

from __future__ import annotations

import torch

from .ops import (ForwardContext, LatentAttentionShape, TritonOps, _composed_norm_linear, _composed_norm_moe,
                  route_options)


class FewRowsOps(TritonOps):
    """The Triton set, plus a decoder layer's norm and the projection after it, and a gated MLP's
    activation and down projection, each in one kernel in a step of a few rows (``kernels.gemv``'s
    ``routed_rows()``; the GPU runner's ``skinny_gemv`` and ``skinny_rows`` options), a mixture of
    experts with the norm before it in three (the router's product with the routing,
    ``kernels.moe_route.router_route``; ``kernels.skinny_moe``'s two), and latent attention at one
    token in three (``kernels.latent_heads``: the rotary and cache write beside ``W_UK``'s product,
    the attention, its splits merged inside ``W_UV``'s product): at batch 1 the step is a few
    hundred small kernels, and each one less saves its launch gap inside the CUDA graph."""

    name = "triton-few-rows"

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.nn.Module,
                    linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if _few_rows(x, linear):
            from specloop.kernels.gemv import skinny_norm_linear

            return skinny_norm_linear(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
        return _composed_norm_linear(self, x, residual, norm, linear)

    def gated_linear(self, gate_up: torch.Tensor, linear: torch.nn.Module) -> torch.Tensor:
        if _few_rows(gate_up, linear):
            from specloop.kernels.gemv import skinny_gated_linear

            return skinny_gated_linear(gate_up, linear.weight, linear.bias)
        return linear(self.silu_and_mul(gate_up))

    def norm_moe(self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.nn.Module,
                 moe: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        from specloop.kernels.gemv import MOE_ROUTED_ROWS

        w13 = moe.experts.w13
        if (residual is None or not 0 < x.shape[0] <= MOE_ROUTED_ROWS or x.dtype not in (torch.bfloat16, torch.float16)
                or w13.dtype != x.dtype):
            return _composed_norm_moe(self, x, residual, norm, moe)
        from specloop.kernels import moe_route, skinny_moe
        from specloop.kernels.gemv import skinny_norm_linear

        cfg, bias = moe.config, moe.gate.e_score_correction_bias

        # The norm runs inside the router's product (float32 weights and logits, which also writes
        # the residual sum) and again inside the experts' gate/up kernel, from that sum; at one
        # token the routing runs in the router's launch too.
        def route() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if x.shape[0] == 1 and moe_route.fused():
                return moe_route.router_route(x, residual, norm.weight, norm.eps, moe.gate.weight, bias, cfg.top_k,
                                              cfg.num_shared_experts, **route_options(cfg))
            logits, summed = skinny_norm_linear(x, residual, norm.weight, norm.eps, moe.gate.weight, split=1,
                                                out_dtype=torch.float32)
            return (*self.moe_route(logits, bias, cfg), summed)

        if cfg.num_shared_experts and x.shape[0] == 1 and skinny_moe.shared_stream():
            # the shared experts' gate/up beside the router and the routing (which it does not need)
            return skinny_moe.shared_beside_routing(x, residual, (norm.weight, norm.eps), w13, moe.experts.w2,
                                                    cfg.top_k, cfg.num_shared_experts, route)
        weights, ids, summed = route()
        return skinny_moe.skinny_moe(summed, w13, moe.experts.w2, weights, ids, norm=(norm.weight, norm.eps)), summed

    def mla_attention(self, attn: LatentAttentionShape, q: torch.Tensor, latent: torch.Tensor,
                      positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        from specloop.kernels import latent_heads

        unmerged = getattr(ctx.backend, "attend_latent_unmerged", None)
        if not (_one_token(q, attn.w_uk) and unmerged is not None and latent_heads.fused()):
            return super().mla_attention(attn, q, latent, positions, ctx)
        heads, nope = attn.num_heads, attn.qk_nope_head_dim
        q = q.unflatten(-1, (heads, -1))
        q_rope, kv_cache, norm = q[:, :, nope:], ctx.kv_caches[attn.layer_idx], attn.kv_a_layernorm
        q_latent = latent_heads.rope_cache_uk(q[:, :, :nope], q_rope, latent, positions, attn.rotary.cos,
                                              attn.rotary.sin, norm.weight, norm.eps, kv_cache,
                                              ctx.metadata.slot_mapping, attn.w_uk)
        out = unmerged(q_latent, q_rope, kv_cache, ctx.metadata, attn.scale)  # one split: merged already
        return latent_heads.head_gemv(out[0] if isinstance(out, torch.Tensor) else out, attn.w_uv_t).view(1, -1)

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if _one_token(x, w):
            from specloop.kernels.latent_heads import head_gemv

            return head_gemv(x[0], w).unsqueeze(0)
        return super().head_matmul(x, w)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        from specloop.kernels.gemv import MOE_ROUTED_ROWS

        if 0 < x.shape[0] <= MOE_ROUTED_ROWS and x.dtype in (torch.bfloat16, torch.float16) and w13.dtype == x.dtype:
            from specloop.kernels.skinny_moe import skinny_moe

            return skinny_moe(x, w13, w2, topk_weights, topk_ids)
        return super().fused_moe(x, w13, w2, topk_weights, topk_ids)


def _one_token(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype


def _few_rows(x: torch.Tensor, linear: torch.nn.Module) -> bool:
    """A step the few-rows kernels take: up to ``kernels.gemv.routed_rows()`` rows in half precision,
    on one rank."""
    from specloop.kernels.gemv import routed_rows

    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (0 < rows <= routed_rows() and x.dtype in (torch.bfloat16, torch.float16) and linear.weight.dtype == x.dtype
            and getattr(getattr(linear, "tp", None), "size", 1) == 1)


FEW_ROWS_OPS = FewRowsOps()
