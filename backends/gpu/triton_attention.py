"""The ``"triton"`` attention backend: the paged-attention interface of
``specloop.models.attention`` on the Triton kernels (KV write by slot mapping, then one ragged
paged-attention launch for the whole batch), and its latent (MLA) counterpart over the latent
cache."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from specloop.models.attention import PAGED_KV_LAYOUT, AttentionMetadata
from specloop.models.config import ModelConfig
from specloop.kernels.kv_write import kv_write
from specloop.kernels.latent_heads import SplitParts
from specloop.kernels.mla_attention import head_blocks, mla_attention
from specloop.kernels.paged_attention import DecodeRope, paged_attention
from specloop.kernels.splits import choose_num_splits

logger = logging.getLogger("specloop")


@dataclass(slots=True)
class GpuAttentionMetadata(AttentionMetadata):
    """The reference metadata plus the flash-decoding split count. Set by the GPU runner's input
    preparation; a CUDA graph fixes it at capture, when ``max_seq_len`` is not known yet."""

    num_splits: int = 0  # 0: chosen per call from num_reqs and max_seq_len


class TritonAttentionBackend:
    """Cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V),
    the torch backend's, so either backend reads a cache the other wrote."""

    name = "triton"
    kv_layout = PAGED_KV_LAYOUT
    device_lengths = True

    TUNE_RUNS = 10  # launches of a candidate timed together by :meth:`tune_decode`
    # (keys per tile, warps, pipeline stages) tried for decode batches by :meth:`tune_decode`.
    DECODE_CONFIGS = ((64, 4, 2), (128, 4, 2), (32, 4, 2), (128, 8, 2))

    def __init__(self, config: Any = None) -> None:
        self.config = config
        self.num_sms = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                        if torch.cuda.is_available() else 132)
        # batch_invariant: one tile and one split for every batch (kernels.paged_attention)
        self.invariant = bool(getattr(config, "batch_invariant", False))
        self.decode_config: tuple[int, int, int] | None = None
        self.rope_in_attention = False  # decode steps' rotary and KV write inside attention (attend_rope)
        self.decode_tuning: dict[str, float] = {}  # config -> median microseconds, from tune_decode

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def decode_splits(self, model_config: ModelConfig, num_seqs: int, max_seq_len: int) -> int:
        """Flash-decoding splits for ``num_seqs`` sequences of up to ``max_seq_len`` tokens of this model."""
        if self.invariant:
            return 1
        if model_config.mla is not None:
            return choose_latent_splits(num_seqs, model_config.num_heads, max_seq_len, self.num_sms)
        return choose_num_splits(num_seqs, model_config.num_kv_heads, max_seq_len, self.num_sms)

    def long_decode_splits(self, model_config: ModelConfig, num_seqs: int, fill: int = 16) -> int:
        """Splits for a decode graph of ``num_seqs`` sequences replayed over long contexts only:
        enough programs to fill the chip ``fill`` times over, however many sequences there are (1, no
        such graph, for latent attention and in batch-invariant mode). On the H200 32 qwen3-0.6b
        sequences over ~1,024 keys took 67.0 us a layer in one split (what :meth:`decode_splits`
        gives 256 programs) and 47.4 in eight; over 160 keys eight lost, hence a graph of its own."""
        if self.invariant or model_config.mla is not None:
            return 1
        want = -(-fill * self.num_sms // max(1, num_seqs * model_config.num_kv_heads))
        return max(1, min(32, 1 << int(math.log2(want))))

    def num_splits(self, meta: AttentionMetadata, num_kv_heads: int) -> int:
        if self.invariant:
            return 1
        if isinstance(meta, GpuAttentionMetadata) and meta.num_splits:
            return meta.num_splits
        return choose_num_splits(meta.num_reqs, num_kv_heads, meta.max_seq_len, self.num_sms)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kv_write(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)

    def attend_rope(self, attn: Any, qkv: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor | None:
        """A decode step's q/k norms, rotary embedding, KV write and attention in one kernel
        (``kernels.paged_attention.DecodeRope``), when the ``rope_in_attention`` option is on (the
        GPU runner's; off by default) and the step is one; ``attn`` the layer's
        ``models.ops.AttentionShape``, ``qkv`` its raw projection. None otherwise: the caller runs
        the separate kernel, then :meth:`attend`."""
        if not self.rope_in_attention or self.invariant or meta.max_query_len != 1:
            return None
        norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.q_norm is not None else ()
        rope = DecodeRope(positions, attn.rotary.cos, attn.rotary.sin, meta.slot_mapping, *norms)
        qkv = qkv.view(qkv.shape[0], attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
        return paged_attention(qkv, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               scale=attn.scale, max_query_len=1, num_splits=self.num_splits(meta, kv_cache.shape[3]),
                               decode_config=self.decode_config, rope=rope)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention over a cache that already holds this step's K/V (written by a fused kernel)."""
        return paged_attention(q, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               scale=scale, max_query_len=meta.max_query_len,
                               num_splits=self.num_splits(meta, kv_cache.shape[3]), decode_config=self.decode_config,
                               invariant=self.invariant)

    def latent_cache_shape(self, num_blocks: int, block_size: int, latent_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, latent_dim)

    def latent_num_splits(self, meta: AttentionMetadata, num_heads: int) -> int:
        if isinstance(meta, GpuAttentionMetadata) and meta.num_splits:
            return meta.num_splits
        return choose_latent_splits(meta.num_reqs, num_heads, meta.max_seq_len, self.num_sms)

    def forward_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, meta.slot_mapping, latent.to(kv_cache.dtype))
        return self.attend_latent(q_nope, q_rope, kv_cache, meta, scale)

    def attend_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return mla_attention(q_nope, q_rope, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                             scale=scale, max_query_len=meta.max_query_len,
                             num_splits=self.latent_num_splits(meta, q_nope.shape[1]))

    def attend_latent_unmerged(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                               meta: AttentionMetadata, scale: float) -> torch.Tensor | SplitParts:
        """:meth:`attend_latent` for one token, its flash-decoding splits left unmerged
        (``kernels.latent_heads``: W_UV's product merges them)."""
        return mla_attention(q_nope, q_rope, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                             scale=scale, max_query_len=1, num_splits=self.latent_num_splits(meta, q_nope.shape[1]),
                             merge=False)

    def tune_decode(self, kv_cache: torch.Tensor, num_q_heads: int, num_seqs: int, context: int) -> None:
        """Time each of :attr:`DECODE_CONFIGS` on a synthetic decode batch (``num_seqs`` sequences of
        ``context`` tokens over random blocks of ``kv_cache``; reads only) and keep the fastest.
        The best tile depends on the chip and the head shape, so it is measured, not assumed."""
        k_cache = kv_cache[0]
        num_blocks, page_size, num_kv_heads, head_dim = k_cache.shape
        pages = min(-(-context // page_size), num_blocks)
        context = min(context, pages * page_size)
        num_seqs = max(1, min(num_seqs, num_blocks // pages))
        device = k_cache.device
        gen = torch.Generator(device=device).manual_seed(0)
        table = torch.randperm(num_blocks, device=device, generator=gen)[:num_seqs * pages]
        table = table.view(num_seqs, pages).to(torch.int32)
        q = torch.randn(num_seqs, num_q_heads, head_dim, device=device, dtype=k_cache.dtype, generator=gen)
        qsl = torch.arange(num_seqs + 1, device=device, dtype=torch.int32)
        seq_lens = torch.full((num_seqs,), context, device=device, dtype=torch.int32)
        runs = {}
        for config in self.DECODE_CONFIGS:
            def run(config: tuple[int, int, int] = config) -> None:
                paged_attention(q, k_cache, kv_cache[1], qsl, seq_lens, table, scale=head_dim ** -0.5,
                                max_query_len=1, decode_config=config)
            try:
                run()
                torch.cuda.synchronize(device)
            except Exception as e:  # e.g. a tile the chip lacks shared memory for
                logger.warning("decode attention tile %s failed: %s", config, e)
                continue
            runs[config] = run
        # A kernel of a few microseconds is quicker than its launch from the host: timed one launch
        # at a time it measures the host. The device first sleeps while the host queues the
        # launches, which then run back to back as in a CUDA graph; the candidates take turns over
        # a few rounds (a slow spell of the machine hits them all) and keep their fastest round.
        timings = {config: float("inf") for config in runs}
        for _ in range(3):
            for config, run in runs.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(2_000_000)
                start.record()
                for _ in range(self.TUNE_RUNS):
                    run()
                end.record()
                end.synchronize()
                timings[config] = min(timings[config], start.elapsed_time(end) * 1e3 / self.TUNE_RUNS)
        if timings:
            self.decode_config = min(timings, key=timings.get)
        self.decode_tuning = {f"block_n={c[0]} warps={c[1]} stages={c[2]}": t for c, t in timings.items()}


def choose_latent_splits(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Split-K for MLA decoding: programs are sequences x head blocks. A program's keys are a chain
    of dependent 36 KiB tiles that every head shares, so a few programs run far below the memory's
    rate even over a short context: on the H200 one V2-Lite token over 160 keys took 16.1 us unsplit
    and 7.5 us in eight splits, over 1,024 keys 91 and 8.0 us unsplit and in 32
    (``benchmarks/gemv.py --mla-shapes``). So, when the programs leave the chip idle, the keys are
    split until the programs fill it twice over or a split holds 16 keys (dense attention stops at
    two 64-key tiles a split: more lost 4% at batch 4 on qwen3-0.6b)."""
    return choose_num_splits(num_seqs, head_blocks(num_heads), max_seq_len, num_sms, min_keys=16, fill=2)
