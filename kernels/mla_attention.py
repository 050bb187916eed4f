"""Multi-head latent attention (DeepSeek's MLA, absorbed form) over the latent paged cache: one launch
for a ragged batch of prefills, chunks, prefix hits, decodes and draft verifications.

Every cached token is one row ``[c_kv | k_rope]`` (``RANK + ROPE`` values) shared by all query
heads: it is the key (scored against ``[q_nope | q_rope]``, ``q_nope`` already in latent space) and
its first ``RANK`` values are the value. Causality and the ragged layout follow
:mod:`.paged_attention`: sequence ``s`` brings ``qsl[s+1] - qsl[s]`` new tokens, the last of its
``seq_lens[s]`` cached tokens, and new token ``i`` sees keys up to its own position.

The grid is ``(q_blocks, head_blocks, splits)``. A program owns ``BLOCK_Q`` query tokens of one
sequence times ``BLOCK_H`` heads (rows of one ``tl.dot`` tile, padded to 16), so each latent tile is
read once for all those heads; in a decode batch (one new token per sequence) program = sequence. With
``splits > 1`` (split-K flash-decoding) each program covers a slice of the keys and the partial
results are merged by :mod:`.splits`' reduction kernel, which keeps the chip busy when few
sequences decode over long contexts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .latent_heads import SplitParts
from .paged_attention import _UNSPECIALIZED, query_block
from .pdl import wait_previous
from .splits import _reduce_splits_kernel, _unused_parts, prefill_splits

BLOCK_H_MAX = 16  # heads per program
BLOCK_N = 32  # keys per tile: a [RANK, 32] bf16 tile of DeepSeek's 512-wide latent is 32 KiB


@triton.jit(**_UNSPECIALIZED)  # one compile for every batch size, table width and metadata slice
def _mla_attention_kernel(
    qn_ptr, qr_ptr, cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    scale, num_seqs,
    stride_qnt, stride_qnh, stride_qrt, stride_qrh,
    stride_cb, stride_cs, stride_ot, stride_oh, stride_bt,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_previous(PDL)
    pid_q = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_block, q_start, q_len = query_block(qsl_ptr, num_seqs, pid_q, BLOCK_Q, DECODE)
    if q_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_ok = (rows // BLOCK_H < BLOCK_Q) & (q_idx < q_len) & (head < NUM_HEADS)
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)  # offsets below pass 2^31 elements at long prefills
    head = head.to(tl.int64)
    dn = tl.arange(0, RANK_PAD)
    dr = tl.arange(0, ROPE_PAD)
    qn = tl.load(qn_ptr + token[:, None] * stride_qnt + head[:, None] * stride_qnh + dn[None, :],
                 mask=row_ok[:, None] & (dn < RANK)[None, :], other=0.0)
    qr = tl.load(qr_ptr + token[:, None] * stride_qrt + head[:, None] * stride_qrh + dr[None, :],
                 mask=row_ok[:, None] & (dr < ROPE)[None, :], other=0.0)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2

    last_q = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_len = context_len + last_q + 1
    num_tiles = tl.cdiv(kv_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, RANK_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + seq * stride_bt
    for tile in range(tile_lo, tile_hi):
        key = tile * BLOCK_N + cols
        key_ok = key < kv_len
        page = tl.load(bt_row + key // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        key_rows = cache_ptr + page * stride_cb + (key % PAGE_SIZE) * stride_cs
        kn = tl.load(key_rows[None, :] + dn[:, None], mask=key_ok[None, :] & (dn < RANK)[:, None], other=0.0)
        kr = tl.load(key_rows[None, :] + RANK + dr[:, None], mask=key_ok[None, :] & (dr < ROPE)[:, None], other=0.0)
        s = tl.dot(qn, kn, input_precision=PRECISION)
        s = (s + tl.dot(qr, kr, input_precision=PRECISION)) * qk_scale
        s = tl.where(key_ok[None, :] & (key[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kn.dtype), tl.trans(kn), input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + dn[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dn < RANK)[None, :])
    else:
        # Partial results [token, head, split, ...], the layout the reduction kernel reads.
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * RANK_PAD + dn[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


def head_blocks(num_heads: int) -> int:
    """Programs per query token along the heads: what splits the decode work besides sequences."""
    return triton.cdiv(num_heads, min(BLOCK_H_MAX, triton.next_power_of_2(num_heads)))


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    merge: bool = True,
) -> torch.Tensor | SplitParts:
    """Absorbed MLA for a packed ragged batch.

    :param q_nope: ``[num_tokens, num_heads, rank]``, queries in latent space (any strides, unit last).
    :param q_rope: ``[num_tokens, num_heads, rope]``, the rotated rotary part (any strides, unit last).
    :param cache: ``[num_blocks, page_size, rank + rope]`` rows ``[c_kv | k_rope]``; this step's rows
        must be written already.
    :param query_start_loc: int32 ``[num_seqs + 1]``; ``seq_lens``: int32 ``[num_seqs]`` (context
        including the new tokens); ``block_table``: int32 ``[num_seqs, max_blocks]``.
    :param max_query_len: the largest new-token count (host-side; picks the tile shape). Under CUDA
        graphs pass the captured bound.
    :param num_splits: key splits per program (a power of two); 1 writes the output directly.
    :param merge: False (one token only): leave the splits' partial sums unmerged, for
        ``kernels.latent_heads.head_gemv`` to merge in W_UV's product.
    :returns: ``out``, ``[num_tokens, num_heads, rank]`` in ``q_nope``'s dtype: the attention-weighted
        ``c_kv`` of each head, to be multiplied by W_UV; or, unmerged over several splits, their
        :class:`~.latent_heads.SplitParts`.
    """
    num_tokens, num_heads, rank = q_nope.shape
    rope = q_rope.shape[2]
    if q_rope.shape[:2] != q_nope.shape[:2] or cache.dim() != 3 or cache.shape[2] != rank + rope:
        raise ValueError(f"q_nope {tuple(q_nope.shape)}, q_rope {tuple(q_rope.shape)} and cache "
                         f"{tuple(cache.shape)} disagree")
    if q_nope.stride(-1) != 1 or q_rope.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("q_nope, q_rope and the cache need a unit stride on their last dim")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    num_seqs = seq_lens.shape[0]
    if not merge and num_tokens != 1:
        raise ValueError(f"unmerged splits are for one token, got {num_tokens}")
    if out is None:
        out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_h = min(BLOCK_H_MAX, triton.next_power_of_2(num_heads))
    wide = q_nope.dtype != torch.float32 and max_query_len > 1  # float32 tiles spill at 32 rows
    block_q = 1 if max_query_len == 1 else max(1, (32 if wide else 16) // block_h)
    rows = max(16, block_q * block_h)
    rank_pad, rope_pad = max(16, triton.next_power_of_2(rank)), max(16, triton.next_power_of_2(rope))
    decode = max_query_len == 1
    num_q_blocks = num_seqs if decode else num_tokens // block_q + num_seqs
    num_splits = prefill_splits(num_splits, num_seqs, num_tokens, block_q)
    if num_splits > 1:
        parts = num_tokens * num_heads * num_splits
        part_acc = torch.empty(parts * rank_pad, dtype=torch.float32, device=q_nope.device)
        part_ml = torch.empty(parts * 2, dtype=torch.float32, device=q_nope.device)
    else:
        part_acc = part_ml = _unused_parts(q_nope.device)  # unused; float32 like the real ones
    _mla_attention_kernel[(num_q_blocks, triton.cdiv(num_heads, block_h), num_splits)](
        q_nope, q_rope, cache, out, part_acc, part_ml,
        query_start_loc, seq_lens, block_table,
        scale, num_seqs,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), cache.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        NUM_HEADS=num_heads, RANK=rank, RANK_PAD=rank_pad, ROPE=rope, ROPE_PAD=rope_pad, PAGE_SIZE=cache.shape[1],
        BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_M=rows, BLOCK_N=BLOCK_N, DECODE=decode, NUM_SPLITS=num_splits,
        PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        num_warps=8 if rows >= 32 else 4, num_stages=1 if q_nope.dtype == torch.float32 else 2,
        **pdl.launch_options(q_nope.device),
    )
    if num_splits > 1 and not merge:
        return SplitParts(part_acc, part_ml, num_heads, num_splits, rank, rank_pad, q_nope.dtype)
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_heads, HEAD_DIM=rank, HEAD_DIM_PAD=rank_pad, NUM_SPLITS=num_splits,
            **pdl.launch_options(q_nope.device),
        )
    return out
