"""Paged attention over a ragged batch: one launch for prefill, chunked prefill, prefix hits, decode
and draft verification alike.

Every sequence ``s`` brings ``q_len = qsl[s+1] - qsl[s]`` new query tokens whose keys and values
are already written into the paged cache (see :mod:`.kv_write`); its context is ``seq_lens[s]``
tokens, the new ones last. New token ``i`` therefore sits at position ``seq_lens[s] - q_len + i``
and attends to keys ``0..position`` (causal within the new tokens, full over the cached prefix).

The grid is ``(q_blocks, kv_heads, splits)``. A program owns ``BLOCK_Q`` query tokens of one
sequence times all ``G = Hq / Hkv`` query heads that share one KV head (GQA), so each KV tile is read
once for the whole group. Sequence ``s`` owns q-blocks starting at ``qsl[s] // BLOCK_Q + s``; this
over-counts by at most one block per sequence, which lets the grid be sized from host-known totals
(``num_tokens // BLOCK_Q + num_seqs``) and stay fixed under CUDA graphs; spare programs exit. A
decode batch (every sequence one new token) uses ``BLOCK_Q = 1``: program ``s`` is sequence ``s``,
with no search (sequences with no new token, e.g. CUDA-graph padding, exit).
With ``splits > 1`` (flash-decoding) each program covers one slice of the KV range and writes a
partial result that ``kernels.splits``' reduction kernel merges (or, in a decode step with
``kernels.last_sums`` on, the last split of each sequence's KV head to finish); this keeps the chip
busy when few sequences decode over long contexts.
"""

from __future__ import annotations

import inspect
import math

import torch
import triton
import triton.language as tl

from . import last_sums, pdl
from .last_sums import arrive
from .pdl import wait_previous
from .qk_rope_cache import DecodeRope, rope_heads
from .splits import _reduce_splits_kernel, _unused_parts, prefill_splits


@triton.jit
def _find_seq(qsl_ptr, num_seqs, pid_q, BLOCK_Q: tl.constexpr):
    # The largest s with qsl[s] // BLOCK_Q + s <= pid_q (binary search over a monotone sequence).
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= pid_q:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def query_block(qsl_ptr, num_seqs, pid_q, BLOCK_Q: tl.constexpr, DECODE: tl.constexpr):
    """What q-block program ``pid_q`` owns: (sequence, q-block within it, the sequence's first new
    token, its new tokens). In a decode step (``DECODE``: one new token a sequence) program ``s`` is
    sequence ``s``, with no search; a q-block past the sequence's new tokens has nothing to do."""
    if DECODE:
        seq = pid_q
    else:
        seq = _find_seq(qsl_ptr, num_seqs, pid_q, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if DECODE:
        q_block = 0
    else:
        q_block = pid_q - (q_start // BLOCK_Q + seq)
    return seq, q_block, q_start, q_len


# Triton compiles a variant per divisibility of an integer argument and per 16-byte alignment of
# a pointer. Eager callers (a proposer catching up, a mixed prefill step) pass batch sizes,
# block-table widths and metadata slices that vary from step to step, so those are not
# specialized on: one compile serves them all, none lands mid-serving.
_UNSPECIALIZED = dict(do_not_specialize=["num_seqs", "stride_bt"])
if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
    _UNSPECIALIZED["do_not_specialize_on_alignment"] = ["qsl_ptr", "seq_lens_ptr", "block_table_ptr"]


@triton.jit(**_UNSPECIALIZED)
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, slot_ptr, eps, count_ptr,
    scale, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, DECODE: tl.constexpr,
    ROPE: tl.constexpr, HAS_NORM: tl.constexpr, NUM_KV_HEADS: tl.constexpr, LAST_SUMS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # (in a decode step BLOCK_M pads the group of q heads up to a dot tile)
    seq, q_block, q_start, q_len = query_block(qsl_ptr, num_seqs, pid_q, BLOCK_Q, DECODE)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys before the first new token

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP_PAD  # index among this sequence's new tokens
    head_in_group = rows % GROUP_PAD
    q_head = kv_head * GROUP + head_in_group
    row_ok = (rows // GROUP_PAD < BLOCK_Q) & (q_idx < q_len) & (head_in_group < GROUP)
    q_pos = context_len + q_idx
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_offs = (q_start + q_idx)[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :]
    qk_scale = scale * 1.4426950408889634  # softmax in base 2

    # Keys this q-block can see: up to the last new token in it.
    last_q = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_len = context_len + last_q + 1
    num_tiles = tl.cdiv(kv_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    if ROPE:
        # q_ptr is the raw q/k/v projection: the group's q heads normed and rotated here, and, by
        # the split whose keys end at the new token, its k and v into the cache, read back below.
        token = q_start + q_idx
        pos = tl.load(pos_ptr + token, mask=row_ok, other=0).to(tl.int64)
        q = rope_heads(q_ptr, q_offs, token * stride_qt + q_head * stride_qh, pos, cos_ptr, sin_ptr, q_w_ptr,
                        eps, row_ok, dims, HEAD_DIM, HAS_NORM)
        if split == (num_tiles - 1) // tiles_per_split:
            t = q_start + last_q
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:
                t_pos = tl.load(pos_ptr + t).to(tl.int64)
                one = dims[None, :] < HEAD_DIM
                first = tl.zeros([1], tl.int64)
                k_base = t * stride_qt + (NUM_Q_HEADS + kv_head) * stride_qh
                k = rope_heads(q_ptr, k_base + dims[None, :], k_base + first, t_pos + first, cos_ptr, sin_ptr,
                                k_w_ptr, eps, first == 0, dims, HEAD_DIM, HAS_NORM)
                page = slot // PAGE_SIZE
                in_page = slot % PAGE_SIZE
                tl.store(k_cache_ptr + page * stride_kb + in_page * stride_ks + kv_head * stride_kh + dims[None, :],
                         k, mask=one)
                v = tl.load(q_ptr + k_base + NUM_KV_HEADS * stride_qh + dims[None, :], mask=one)
                tl.store(v_cache_ptr + page * stride_vb + in_page * stride_vs + kv_head * stride_vh + dims[None, :],
                         v, mask=one)
        tl.debug_barrier()  # the new key and value, written by this program's threads, are read below
    else:
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + seq * stride_bt
    for tile in range(tile_lo, tile_hi):
        key = tile * BLOCK_N + cols
        key_ok = key < kv_len
        page = tl.load(bt_row + key // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)  # caches pass 2^31 elements
        in_page = key % PAGE_SIZE
        k_offs = page[None, :] * stride_kb + in_page[None, :] * stride_ks + kv_head * stride_kh + dims[:, None]
        k = tl.load(k_cache_ptr + k_offs, mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        visible = key_ok[None, :] & (key[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no visible key yet keep m = -inf; shift them by 0 to avoid NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offs = page[:, None] * stride_vb + in_page[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        v = tl.load(v_cache_ptr + v_offs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    token = q_start + q_idx
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = token[:, None] * stride_ot + q_head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # Partial results, laid out [token, q_head, split, ...] contiguous. A split past the keys
        # (a graph's split count is fixed for any context) stores only l = 0: its sums go unread.
        # (Its rows masked as a vector: Triton's interpreter takes no scalar in a mask.)
        part = (token * NUM_Q_HEADS + q_head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc,
                 mask=row_ok[:, None] & (rows < BLOCK_M * (tile_hi - tile_lo))[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        if LAST_SUMS:  # (decode) the last split of the sequence's KV head to finish merges them all
            if arrive(count_ptr, seq * NUM_KV_HEADS + kv_head, NUM_SPLITS):
                first = (token * NUM_Q_HEADS + q_head) * NUM_SPLITS
                m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
                for s in range(NUM_SPLITS):
                    m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (first + s) * 2, mask=row_ok,
                                                      other=float("-inf"), cache_modifier=".cg"))
                m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
                denom = tl.zeros([BLOCK_M], tl.float32)
                total = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
                for s in range(NUM_SPLITS):  # in order, as _reduce_splits_kernel weighs them
                    m_s = tl.load(part_ml_ptr + (first + s) * 2, mask=row_ok, other=0.0, cache_modifier=".cg")
                    l_s = tl.load(part_ml_ptr + (first + s) * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
                    w = tl.where(l_s > 0.0, tl.math.exp2(m_s - m_max), 0.0)
                    denom += l_s * w
                    total += tl.load(part_acc_ptr + (first + s)[:, None] * HEAD_DIM_PAD + dims[None, :],
                                     mask=(row_ok & (l_s > 0.0))[:, None], other=0.0,
                                     cache_modifier=".cg") * w[:, None]
                out = total / tl.where(denom == 0.0, 1.0, denom)[:, None]
                o_offs = token[:, None] * stride_ot + q_head[:, None] * stride_oh + dims[None, :]
                tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    decode_config: tuple[int, int, int] | None = None,
    invariant: bool = False,
    rope: DecodeRope | None = None,
) -> torch.Tensor:
    """Attention for a packed ragged batch.

    :param q: ``[num_tokens, num_q_heads, head_dim]``, the new tokens of all sequences, packed.
    :param k_cache: ``[num_blocks, page_size, num_kv_heads, head_dim]`` (any strides with a unit
        last stride); ``v_cache`` likewise. The new tokens' keys and values must be written already.
    :param query_start_loc: int32 ``[num_seqs + 1]``, prefix sums of the new-token counts.
    :param seq_lens: int32 ``[num_seqs]``, context length including the new tokens.
    :param block_table: int32 ``[num_seqs, max_blocks]``, physical block of each page.
    :param max_query_len: the largest new-token count (host-side; picks the tile shape). Under CUDA
        graphs pass the captured bound, not the live value.
    :param num_splits: KV splits per q-block (a power of two); 1 writes the output directly.
    :param decode_config: ``(keys per tile, warps, pipeline stages)`` for decode batches
        (``max_query_len == 1``), e.g. chosen by timing on the device; default ``(64, 4, 2)``.
    :param invariant: batch-invariant: one tile shape for every batch (a program per new token,
        ``(64, 4, 2)``, ``num_splits`` 1), so a token's output is the same sum in the same order
        whether it decodes alone, verifies drafts or prefills among others.
    :param rope: a decode step (``max_query_len == 1``) whose q/k norms, rotary embedding and KV
        write run here (:class:`DecodeRope`): ``q`` is then the q/k/v projection viewed
        ``[num_tokens, num_q_heads + 2 num_kv_heads, head_dim]``, raw, and the new keys and values
        are not in the cache yet.
    :returns: ``out``, ``[num_tokens, num_q_heads, head_dim]`` in ``q``'s dtype.
    """
    num_blocks, page_size, num_kv_heads, kv_dim = k_cache.shape
    num_tokens, num_q_heads, head_dim = q.shape
    if rope is not None:
        num_q_heads -= 2 * num_kv_heads
        if max_query_len != 1 or invariant:
            raise ValueError("rotary inside attention is for decode steps (max_query_len 1), not invariant mode")
        if head_dim & (head_dim - 1) or rope.cos.shape[-1] * 2 != head_dim or rope.cos.dtype != torch.float32:
            raise ValueError(f"rotary inside attention needs a power-of-two head_dim and float32 cos/sin of "
                             f"{head_dim // 2} columns")
        if (rope.q_norm_weight is None) != (rope.k_norm_weight is None):
            raise ValueError("give both q and k norm weights or neither")
    if kv_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not match "
                         f"head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a unit stride on head_dim")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    # tl.dot wants at least 16 rows; prefill-heavy batches get taller tiles for reuse of each K/V tile.
    # float32 (for exactness tests) spills registers at 128 rows, so it stops at 64.
    rows = 128 if max_query_len * group_pad >= 128 and q.dtype != torch.float32 else (
        64 if max_query_len * group_pad >= 64 else 16)
    # Decode batches (one new token each) map programs to sequences directly. A wide GQA group can
    # make a multi-token tile one token tall too, but that still needs the search by q-block.
    decode = max_query_len == 1
    block_q = 1 if decode or invariant else max(1, rows // group_pad)
    rows = max(16, group_pad) if invariant else max(rows, block_q * group_pad)
    block_n, num_warps, num_stages = 64, 8 if rows >= 128 else 4, 2
    if decode and decode_config is not None and not invariant:
        block_n, num_warps, num_stages = decode_config
    if invariant and num_splits != 1:
        raise ValueError(f"invariant attention runs one split, got num_splits={num_splits}")
    num_q_blocks = num_seqs if decode else num_tokens // block_q + num_seqs
    num_splits = prefill_splits(num_splits, num_seqs, num_tokens, block_q)
    if num_splits > 1:
        part_acc = torch.empty(num_tokens * num_q_heads * num_splits * head_dim_pad, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_tokens * num_q_heads * num_splits * 2, dtype=torch.float32, device=q.device)
    else:  # unused; float32 like the real ones, so that both run one compile
        part_acc = part_ml = _unused_parts(q.device)
    # A decode step's splits merged by the last of each sequence's KV head to finish (kernels.last_sums).
    by_last = decode and num_splits > 1 and last_sums.enabled() and num_seqs * num_kv_heads <= last_sums.MAX_COUNTS
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_ml,
        query_start_loc, seq_lens, block_table,
        *((rope.positions, rope.cos, rope.sin,
           rope.q_norm_weight if rope.q_norm_weight is not None else rope.cos,
           rope.k_norm_weight if rope.k_norm_weight is not None else rope.cos, rope.slot_mapping, rope.eps)
          if rope is not None else (seq_lens, part_ml, part_ml, part_ml, part_ml, seq_lens, 0.0)),
        last_sums.counts(q.device) if by_last else seq_lens,
        scale, num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_table.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=page_size,
        BLOCK_Q=block_q, BLOCK_M=rows, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DECODE=decode,
        ROPE=rope is not None, HAS_NORM=rope is not None and rope.q_norm_weight is not None,
        NUM_KV_HEADS=num_kv_heads, LAST_SUMS=by_last,
        num_warps=num_warps, num_stages=num_stages,
        **pdl.launch_options(q.device),
    )
    if num_splits > 1 and not by_last:
        # Every (token, head, split) slot of a real token is written, with l = 0 for empty splits;
        # tokens past query_start_loc[-1] (CUDA-graph padding) get undefined rows nobody reads.
        _reduce_splits_kernel[(num_tokens, num_q_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
            **pdl.launch_options(q.device),
        )
    return out
