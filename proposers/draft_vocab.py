"""The target's head as a proposer drafts with it: over the whole vocabulary, or over a token map's.

A proposer that drafts through the target's own head (MTP, EAGLE-1) reads that head once per draft:
on a large vocabulary it is most of a draft step's bytes (DeepSeek-V2's 102,400 x 2,048 head is
~70% of an MTP step's weights at batch 1). ``speculative_config["token_map"]`` names a file of
token ids, the frequent ones (a frequency-ranked draft vocabulary, as SGLang's
``speculative_token_map`` takes it): a JSON list of ids, or a 1-D integer tensor saved with
``torch.save`` (``.pt``); ``specloop token-map`` counts one from local text. The proposer then
keeps a copy of those rows of the head and drafts only those tokens, reading ``len(ids) / vocab``
of the head's bytes. Verification is unchanged: greedy output stays the target's, and a sampled
draft's distribution (over the map's tokens) is what the rejection sampler corrects, so sampled
output still follows the target; what a map costs is the drafts it cannot make, where the target
picks a token outside it.
"""

from __future__ import annotations

import json
import os

import torch

from .base import ProposerContext


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The sorted distinct token ids of the file at ``path`` (int64, CPU). Raises ``ValueError`` on
    a missing or malformed file, or an id outside ``[0, vocab_size)``."""
    where = f"speculative_config.token_map {path!r}"
    if not os.path.isfile(path):
        raise ValueError(f"{where} is not a file")
    try:
        if path.endswith(".json"):
            with open(path) as f:
                ids = torch.tensor(json.load(f))
        else:
            ids = torch.load(path, map_location="cpu", weights_only=True)
            ids = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids)
    except Exception as e:  # noqa: BLE001 - any parse failure is the file's fault
        raise ValueError(f"{where} is neither a JSON list of token ids nor a saved tensor of them ({e})") from None
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{where} must hold a non-empty list of integer token ids, got {ids.dtype} of "
                         f"shape {list(ids.shape)}")
    ids = torch.unique(ids.long())  # sorted: ties break to the lower id, as over the whole vocabulary
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"{where} holds ids outside the target's vocabulary [0, {vocab_size})")
    return ids


class DraftHead:
    """``logits`` and ``argmax`` of the target's head for a proposer's hidden states (in the
    target's dtype): the whole head, or the rows of a token map (``ids``), copied once."""

    def __init__(self, context: ProposerContext, token_map: str | None) -> None:
        self.compute_logits = context.lm_head
        self.dtype = context.dtype
        self.vocab_size = context.vocab_size
        self.ids: torch.Tensor | None = None
        if token_map is None:
            return
        head = getattr(context.target, "lm_head", None)
        if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
            raise ValueError("speculative_config.token_map needs a target whose head is a weight matrix (lm_head)")
        if context.tp is not None and context.tp.size > 1:
            raise ValueError("speculative_config.token_map is not supported with tensor_parallel_size > 1 (each rank "
                             "holds only a slice of the head)")
        ids = load_token_map(token_map, context.vocab_size)
        self.head = head  # its ``matmul`` at call time: the GPU runner may have switched it to its kernels
        self.ids = ids.to(head.weight.device)
        self.weight = head.weight.detach().index_select(0, self.ids).contiguous()

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.matmul(hidden.to(self.dtype), self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[rows, vocab]``; ``-inf`` outside the token map."""
        if self.ids is None:
            return self.compute_logits(hidden.to(self.dtype)).float()
        rows = self._rows(hidden).float()
        out = rows.new_full((rows.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.ids, rows)

    def argmax(self, hidden: torch.Tensor, ops) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """The most likely drafted token id of each row (int64); device work only (graphs capture it)."""
        if self.ids is None:
            return ops.argmax(self.compute_logits(hidden.to(self.dtype)))
        return self.ids[ops.argmax(self._rows(hidden))]
