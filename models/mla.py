"""DeepSeek's multi-head latent attention (MLA): the weights of one attention layer, and how a
checkpoint's tensors map onto them.

Per token the layer projects the hidden state to a query (directly, or through a low-rank ``q_a`` /
``q_b`` pair with a norm between) and to one latent row ``[c_kv | k_rope]``: ``c_kv`` (``kv_lora_rank``
values, normalised) stands for every head's key and value, ``k_rope`` (``qk_rope_head_dim``) is the
rotary part of the key, shared by all heads. The paged cache keeps only that row (576 values a
token for DeepSeek-V3, against 2 x 128 heads x 192 for the expanded K/V).

Attention runs in the absorbed form: ``W_UK`` (the key half of ``kv_b_proj``) is folded into each
head's query, so scores are ``q_nope W_UK . c_kv + q_rope . k_rope`` against the cached rows, the
softmax-weighted sum of ``c_kv`` is taken, and ``W_UV`` (the value half) turns it into the head's
output. This is one form for prefill, chunked prefill, prefix hits, decode and verification alike;
the math lives in the op sets (``ops.mla_attention``), the cache layout in the attention backend.

Interleaved rotary (``rope_interleave``: dims paired as (x0, x1), (x2, x3), ...) is turned into the
half-split layout at load time by permuting the rows that produce the rotary dims; q and k move
together, so every score is unchanged and one rotary kernel serves all models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding
from .ops import norm_linear
from .parallel import ReplicatedLinear

if TYPE_CHECKING:
    from .context import ForwardContext


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, bias: bool) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.layer_idx = layer_idx  # index of this layer's cache in ForwardContext.kv_caches
        self.num_heads = cfg.num_heads
        self.q_lora_rank = mla.q_lora_rank
        self.kv_lora_rank = mla.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.v_head_dim = mla.v_head_dim
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.scale = mla.softmax_scale(cfg.rope)
        self.rope_interleave = mla.rope_interleave  # the checkpoint's layout; applied at load time
        hidden, heads = cfg.hidden_size, cfg.num_heads
        # q (or q's low-rank half) and the latent read the same input: one matmul, unless only the
        # latent's projection has a bias.
        self.q_a_size = mla.q_lora_rank or heads * self.qk_head_dim
        self.fused_qkv_a = mla.q_lora_rank is not None or not bias
        if self.fused_qkv_a:
            self.qkv_a_proj = ReplicatedLinear(hidden, self.q_a_size + mla.latent_dim, bias=bias)
        else:
            self.q_proj = ReplicatedLinear(hidden, self.q_a_size, bias=False)
            self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.latent_dim, bias=bias)
        if mla.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = ReplicatedLinear(mla.q_lora_rank, heads * self.qk_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = ReplicatedLinear(heads * mla.v_head_dim, hidden, bias=bias)
        self.__dict__["rotary"] = rotary  # shared with the other layers, owned by the model

    @property
    def w_uk(self) -> torch.Tensor:
        """[H, qk_nope_head_dim, kv_lora_rank]: q_nope @ w_uk[h] is head h's query in latent space."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim]

    @property
    def w_uv_t(self) -> torch.Tensor:
        """[H, kv_lora_rank, v_head_dim]: a head's attended latent @ w_uv_t[h] is its output."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, self.qk_nope_head_dim:].transpose(1, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.fused_qkv_a:
            return self.attend(self.qkv_a_proj(x), positions, ctx)
        return self._attend(self.q_proj(x), self.kv_a_proj_with_mqa(x), positions, ctx)

    def attend(self, qkv_a: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The layer from ``qkv_a_proj``'s output on (``fused_qkv_a``): for a decoder layer that runs
        its input norm and that projection as one op (``ops.norm_linear``)."""
        q, latent = qkv_a.split([self.q_a_size, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
        return self._attend(q, latent, positions, ctx)

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
                ) -> torch.Tensor:
        if self.q_lora_rank is not None:
            q, _ = norm_linear(ctx.ops, q, None, self.q_a_layernorm, self.q_b_proj)
        return self.o_proj(ctx.ops.mla_attention(self, q, latent, positions, ctx))


def mla_weight_target(name: str, attn: MLAttention) -> tuple[str, int | None]:
    """Where the checkpoint tensor ``self_attn.<name>`` goes: (parameter name under ``self_attn.``,
    shard of the fused ``qkv_a_proj`` or None)."""
    if attn.fused_qkv_a:
        for shard, original in enumerate(("q_a_proj." if attn.q_lora_rank is not None else "q_proj.",
                                          "kv_a_proj_with_mqa.")):
            if name.startswith(original):
                return "qkv_a_proj." + name.removeprefix(original), shard
    return name, None


def deinterleave_rope_rows(tensor: torch.Tensor, name: str, attn: MLAttention) -> torch.Tensor:
    """The checkpoint tensor for ``self_attn.<name>`` with its rotary output rows reordered from
    interleaved pairs to halves (even dims first, then odd ones); other tensors unchanged."""
    def halves(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([rows[..., 0::2, :], rows[..., 1::2, :]], dim=-2) if rows.dim() > 1 else \
            torch.cat([rows[0::2], rows[1::2]])

    rope, rank = attn.qk_rope_head_dim, attn.kv_lora_rank
    if name.startswith(("q_proj.", "q_b_proj.")):
        t = tensor.view(attn.num_heads, attn.qk_head_dim, *tensor.shape[1:])
        return torch.cat([t[:, :attn.qk_nope_head_dim], halves(t[:, attn.qk_nope_head_dim:])], dim=1) \
            .view(tensor.shape)
    if name.startswith("kv_a_proj_with_mqa."):
        return torch.cat([tensor[:rank], halves(tensor[rank:rank + rope])])
    return tensor
