"""EAGLE-1 and EAGLE-3 proposers: a one-layer head drafts K tokens from the target's hidden states.

``speculative_config={"method": "eagle" | "eagle3", "model": HEAD_DIR, "num_speculative_tokens": K}``
(layouts in ``proposers.heads``). Position ``p`` of the head pairs the token at ``p + 1`` with a
hidden state for position ``p``: the target's (EAGLE-1: its final state; EAGLE-3: ``fc`` over the
residual streams entering three target layers, tapped during the target's own forward) for every
position the target computed, the head's own output for the positions it drafts.

Cache. The head's paged KV cache has the target's blocks and is indexed by the target's block
table, so it is allocated, preempted, freed and prefix-cached with the target's. Its entry for
position ``p`` needs only the target's state at ``p`` and the token after it, so the proposer
records the target's states as the target computes them (``record``, inside the target's forward
and its CUDA graphs: one row per KV slot, the head's input after EAGLE-3's ``fc``) and feeds the
head lazily: a proposal first feeds each request every position its cache lacks below the newest
token, from that record (``catches_up``). A request proposed for in every step lacks exactly the
step's rows; after steps the speculation policy drafted nothing for (which then cost the head
nothing) it lacks those steps' positions too, and a new request its whole prompt, prefix-cache hits
included (their record is the target's; rewriting a shared entry writes the value it holds, since
the last block of a hit, whose last entry pairs with this request's next token, is recomputed:
``SpeculativeConfig.reads_target_hidden_states``). Rows of rejected drafts leave entries past the
newest token, rewritten before anything reads them, so the cache below the newest token always
holds target-fed entries.

Drafting (``proposers.recording``, shared with MTP). Step 1 is that feed: its output at the last
accepted position gives draft 1. Each further step feeds one draft at the next position with the
previous step's output as its hidden state; on CUDA a plain greedy proposal replays graphs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specloop.kernel.config import EngineConfig
from specloop.models.context import ForwardContext
from specloop.models.loader import resolve_dtype

from .base import ProposerContext
from .draft_vocab import DraftHead
from .heads import Eagle3Head, load_head
from .recording import RecordingProposer


class EagleProposer(RecordingProposer):
    """EAGLE-1 (``"eagle"``); :class:`Eagle3Proposer` is EAGLE-3. The drafting is
    :class:`RecordingProposer`'s; this class gives it the head."""
    config_fields = frozenset({"model", "draft_dtype", "token_map"})

    version = 1

    def __init__(self, config: EngineConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        spec = config.speculative_config
        if not spec.model:
            raise ValueError(f"speculative_config.method={spec.method!r} needs 'model' (a local head checkpoint path)")
        self.device = context.device
        self.dtype = resolve_dtype(spec.draft_dtype, context.device) if spec.draft_dtype else context.dtype
        self.head, self.head_config, layers = load_head(spec.model, self.version, context, self.dtype)
        # The forward taps each layer once, in layer order; the head's fc reads them in its own order.
        self.hidden_state_layers = tuple(sorted(set(layers)))
        self.aux_order = [self.hidden_state_layers.index(i) for i in layers]
        self.target_head = DraftHead(context, spec.token_map)  # EAGLE-1 drafts through the target's head
        # Recorded: the head's input states of the target's rows (after EAGLE-3's fc).
        self._setup(context, self.head_config.hidden_size, self.head_config)

    def record(self, hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor],
               slot_mapping: torch.Tensor) -> None:
        rows = min(len(slot_mapping), len(hidden_states))
        self.recorded.write(self._head_input(hidden_states[:rows], [a[:rows] for a in aux_hidden_states]),
                            slot_mapping[:rows])

    def _head_input(self, hidden: torch.Tensor, aux: Sequence[torch.Tensor]) -> torch.Tensor:
        """The head's state input for target rows: EAGLE-3's ``fc`` over the tapped streams, else
        the target's final state."""
        head = self.head
        if isinstance(head, Eagle3Head) and head.fc is not None:
            return head.fc(torch.cat([aux[k] for k in self.aux_order], dim=-1).to(self.dtype))
        return hidden.to(self.dtype)

    def _feed(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
              rows: torch.Tensor | None = None) -> torch.Tensor:
        # Every row through the head's MLP: a dense MLP over a feed's few rows reads its weights
        # once either way, and the rows' values stay those of every other path's feed.
        out = self.head(embeds, states, positions, ctx)
        return out if rows is None else out.index_select(0, rows)

    def _draft(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
               step: int) -> torch.Tensor:
        return self.head(embeds, hidden, positions, ctx)

    def _argmax(self, out: torch.Tensor, step: int) -> torch.Tensor:
        if isinstance(self.head, Eagle3Head):
            return self.head.argmax(out, self.ops)
        return self.target_head.argmax(out, self.ops)

    def _logits(self, out: torch.Tensor, step: int) -> torch.Tensor:
        if isinstance(self.head, Eagle3Head):
            return self.head.logits(out, self.ops)
        return self.target_head.logits(out)


class Eagle3Proposer(EagleProposer):
    """EAGLE-3 (``"eagle3"``): reads the residual streams entering three target layers."""

    config_fields = frozenset({"model", "draft_dtype"})  # its head has a vocabulary of its own (d2t)
    version = 3
