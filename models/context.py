"""What a model's forward needs besides its tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import AttentionBackend, AttentionMetadata
from .ops import TORCH_OPS, Ops


@dataclass(slots=True)
class ForwardContext:
    """Everything a model's layers need for one forward pass besides the tokens: the attention
    backend and metadata, the per-layer KV caches, and the ops the layers call (the torch reference
    or fused Triton kernels). Built by whoever runs the model."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per layer
    ops: Ops = field(default=TORCH_OPS)

    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.kv_caches[layer_idx], self.metadata, scale)
