"""Paged attention: the interface every attention backend implements, and the torch reference.

Whoever runs a model (the model runner, or a proposer running a draft model over its own cache)
packs the step's tokens into a ragged batch (``T`` tokens of ``B`` requests, request ``i`` owning
rows ``query_start_loc[i]:query_start_loc[i+1]``), builds one :class:`AttentionMetadata` for it,
and passes a ``ForwardContext`` (:mod:`.context`) to the model. Each attention layer, through the context's
ops, then

1. writes the step's new K/V rows into the paged cache at ``slot_mapping`` (slot = block id *
   block_size + offset), and
2. attends each query over its request's whole context read back from the cache through the
   request's block table: query ``j`` of request ``i`` sits at position
   ``seq_lens[i] - query_len_i + j`` and sees keys ``0 .. that position`` (causal within the new
   tokens, everything before them).

This is correct for any mix of prefills, chunked prefills, prefix-cache hits (the context was
written by another request), decodes and speculative verification (several new tokens per request).
The torch backend is the CPU path and the oracle for faster backends (the ``"triton"`` backend of
the GPU runner shares its cache layout, so either reads a cache the other wrote).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch

# [2, num_blocks, block_size, num_kv_heads, head_dim]: K then V, each slot a [heads, dim] row; and
# for MLA [num_blocks, block_size, latent_dim], each slot one [c_kv | k_rope] row.
PAGED_KV_LAYOUT = "paged_nhd"


@dataclass(slots=True)
class AttentionMetadata:
    """Where one forward pass's tokens go and what they see. Set by the model runner's input
    preparation; read by every attention layer of that forward."""

    query_start_loc: torch.Tensor  # [B + 1] int32: request i's tokens are rows qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor  # [B] int32: context length of request i after this step (cached + new)
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32: request i's physical blocks (0-padded)
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends that loop over requests need no device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(cls, query_start_loc: list[int], seq_lens: list[int], slot_mapping: Sequence[int],
              block_tables: Sequence[Sequence[int]], device: torch.device) -> AttentionMetadata:
        """From host lists: ``block_tables[i]`` is request ``i``'s block ids (rows are 0-padded)."""
        table = np.zeros((len(block_tables), max((len(b) for b in block_tables), default=1) or 1), dtype=np.int32)
        for i, blocks in enumerate(block_tables):
            table[i, :len(blocks)] = blocks
        return cls(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32).to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(device, non_blocking=True),
            block_tables=torch.from_numpy(table).to(device, non_blocking=True),
            max_query_len=max((query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))),
                              default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=list(query_start_loc),
            seq_lens_cpu=list(seq_lens),
        )


class AttentionBackend(Protocol):
    """What a backend provides. One instance serves every layer; the KV cache of each layer is a
    tensor the runner allocates with :meth:`kv_cache_shape` and passes back on every call."""

    name: str
    # PAGED_KV_LAYOUT when the caches are laid out like the torch backend's; fused kernels that write
    # K/V (or latents) themselves (``ops.TritonOps``) only do so for that layout, then call
    # :meth:`attend` (or ``attend_latent``).
    kv_layout: str
    # Whether it reads context lengths only from ``meta.seq_lens`` (the device's), never from the
    # host's lists: the GPU runner may then prepare a step before the host knows how many drafts
    # the previous one accepted (the device corrects the lengths). Optional; absent means False.
    device_lengths: bool

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write ``k``/``v`` ([T, Hkv, D]) into ``kv_cache`` at ``meta.slot_mapping``, then return
        attention of ``q`` ([T, Hq, D], Hq a multiple of Hkv) over the cached context, [T, Hq, D]."""

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """:meth:`forward` for a cache that already holds this step's K/V."""


class LatentAttentionBackend(Protocol):
    """What a backend adds for multi-head latent attention (DeepSeek's MLA), in its absorbed form:
    every query head attends over one shared row per token, ``[c_kv | k_rope]`` (``latent_dim``
    values), which serves as the key, and whose first ``kv_lora_rank`` values serve as the value."""

    def latent_cache_shape(self, num_blocks: int, block_size: int, latent_dim: int) -> tuple[int, ...]:
        """Shape of one layer's latent cache."""

    def forward_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write ``latent`` ([T, latent_dim]) at ``meta.slot_mapping``, then :meth:`attend_latent`."""

    def attend_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """``q_nope`` [T, H, kv_lora_rank] (W_UK already folded in) and ``q_rope`` [T, H, rope dim]
        against each request's cached latents (causal as :meth:`AttentionBackend.forward`);
        returns [T, H, kv_lora_rank], still to be multiplied by W_UV."""


class TorchAttentionBackend:
    """Reference paged attention in plain PyTorch, one request at a time.

    Cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
    """

    name = "torch"
    kv_layout = PAGED_KV_LAYOUT
    device_lengths = False  # reads meta.seq_lens_cpu

    def __init__(self, config: Any = None) -> None:
        if getattr(config, "batch_invariant", False):
            raise ValueError("batch_invariant=True needs the GPU model runner and the 'triton' attention backend "
                             "(model_runner='gpu'); the torch reference attention is not batch-invariant")
        self.config = config

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        block_size = key_cache.shape[1]
        group = q.shape[1] // key_cache.shape[2]
        out = torch.empty_like(q)
        for start, end, seq_len, blocks in _requests(meta, block_size):
            keys = key_cache[blocks].flatten(0, 1)[:seq_len]
            values = value_cache[blocks].flatten(0, 1)[:seq_len]
            out[start:end] = _attend(q[start:end], keys, values, seq_len - (end - start), group, scale)
        return out

    def latent_cache_shape(self, num_blocks: int, block_size: int, latent_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, latent_dim)

    def forward_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, meta.slot_mapping, latent.to(kv_cache.dtype))
        return self.attend_latent(q_nope, q_rope, kv_cache, meta, scale)

    def attend_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
        block_size, rank = kv_cache.shape[1], q_nope.shape[-1]
        q = torch.cat([q_nope, q_rope], dim=-1)
        out = torch.empty_like(q_nope)
        for start, end, seq_len, blocks in _requests(meta, block_size):
            rows = kv_cache[blocks].flatten(0, 1)[:seq_len, None, :]  # one "KV head" for every query head
            out[start:end] = _attend(q[start:end], rows, rows[..., :rank], seq_len - (end - start), q.shape[1],
                                     scale)
        return out


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into the paged cache: row ``t`` goes to slot ``slot_mapping[t]``."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _requests(meta: AttentionMetadata, block_size: int) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """Per request with query tokens this step: its query rows ``[start, end)``, its context length
    and the ids of the cache blocks that hold it."""
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        if end > start:
            yield start, end, seq_len, meta.block_tables[i, : (seq_len + block_size - 1) // block_size].long()


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int, group: int,
            scale: float) -> torch.Tensor:
    """One request: ``q`` [n, Hq, D] at positions ``context_len .. context_len + n - 1`` over
    ``keys``/``values`` [context_len + n, Hkv, D]."""
    n, total = q.shape[0], keys.shape[0]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = (q.transpose(0, 1) @ keys.transpose(0, 1).transpose(1, 2).to(q.dtype)).float() * scale
    if n > 1:  # a single query is the newest position and sees everything
        visible = torch.arange(total, device=q.device)[None, :] <= (
            context_len + torch.arange(n, device=q.device))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    out = scores.softmax(dim=-1).to(q.dtype) @ values.transpose(0, 1).to(q.dtype)
    return out.transpose(0, 1)
