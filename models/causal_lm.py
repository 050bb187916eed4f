"""The model around a decoder's layers, which every architecture here shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from .context import ForwardContext


class CausalLM(nn.Module):
    """A decoder-only model's interface, around what a subclass builds: ``embed_tokens``, ``rotary``,
    ``layers`` (each ``layer(x, residual, positions, ctx) -> (x, residual)``, the residual stream
    carried as ``x + residual`` and updated in place by the fused ops), ``norm`` and ``lm_head``.

    ``forward`` takes packed ragged rows and returns the final (post-norm) hidden states of every
    row plus, on request, the residual stream *entering* chosen layers (``aux_layers``;
    ``num_layers`` means the stream after the last layer, before the final norm): EAGLE-3 reads
    three of them. ``compute_logits`` is applied by the caller only to the rows that need logits.
    """

    @property
    def max_positions(self) -> int:
        """How many positions the rotary tables cover."""
        return self.rotary.max_positions

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext,
                aux_layers: Sequence[int] = (), inputs_embeds: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.clone()
        residual: torch.Tensor | None = None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:  # a copy: the fused ops update the residual stream in place
                aux.append(x.clone() if residual is None else x + residual)
            x, residual = layer(x, residual, positions, ctx)
        if len(self.layers) in aux_layers:
            aux.append(x + residual)
        h, _ = ctx.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return h, aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
