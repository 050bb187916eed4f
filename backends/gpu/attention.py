"""The ``"triton"`` attention backend: the paged-attention interface of
``specloop.backends.attention`` on the Triton kernels (KV write by slot mapping, then one ragged
paged-attention launch for the whole batch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specloop.backends.attention import AttentionMetadata
from specloop.kernels.kv_write import kv_write
from specloop.kernels.paged_attention import choose_num_splits, paged_attention


@dataclass(slots=True)
class GpuAttentionMetadata(AttentionMetadata):
    """The reference metadata plus the flash-decoding split count. Set by the GPU runner's input
    preparation; a CUDA graph fixes it at capture, when ``max_seq_len`` is not known yet."""

    num_splits: int = 0  # 0: chosen per call from num_reqs and max_seq_len


class TritonAttentionBackend:
    """Cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V),
    the torch backend's, so either backend reads a cache the other wrote."""

    name = "triton"

    def __init__(self, config: Any = None) -> None:
        self.config = config
        self.num_sms = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                        if torch.cuda.is_available() else 132)

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def num_splits(self, meta: AttentionMetadata, num_kv_heads: int) -> int:
        if isinstance(meta, GpuAttentionMetadata) and meta.num_splits:
            return meta.num_splits
        return choose_num_splits(meta.num_reqs, num_kv_heads, meta.max_seq_len, self.num_sms)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kv_write(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention over a cache that already holds this step's K/V (written by a fused kernel)."""
        return paged_attention(q, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               scale=scale, max_query_len=meta.max_query_len,
                               num_splits=self.num_splits(meta, kv_cache.shape[3]))
