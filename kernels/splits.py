"""Flash-decoding's split-K, shared by the dense and latent attention kernels: how many splits a
step gets, and the merge of their partial results (each split's running max ``m``, base 2, its
softmax denominator ``l`` and its unnormalised sums), in a fixed order so the result is the same
from run to run.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .pdl import wait_previous


@triton.jit
def split_weights(part_ml_ptr, part):
    """The merge of splits ``part`` (a vector of partial-result indices): each split's softmax
    denominator ``l``, its weight, and the merged denominator (1 where no split saw a key). Splits
    past the end of a short context saw no key: l = 0, m = -inf; they weigh nothing, and their sums
    (never stored) are not read."""
    m = tl.load(part_ml_ptr + part * 2)
    l = tl.load(part_ml_ptr + part * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(l > 0.0, tl.math.exp2(m - m_max), 0.0)
    denom = tl.sum(l * w, 0)
    return l, w, tl.where(denom == 0.0, 1.0, denom)


@triton.jit
def _reduce_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr,
    stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    part = (token * NUM_Q_HEADS + head) * NUM_SPLITS + splits
    l, w, denom = split_weights(part_ml_ptr, part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=(l > 0.0)[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


_UNUSED_PARTS: dict[torch.device, torch.Tensor] = {}


def _unused_parts(device: torch.device) -> torch.Tensor:
    if device not in _UNUSED_PARTS:
        _UNUSED_PARTS[device] = torch.empty(4, dtype=torch.float32, device=device)
    return _UNUSED_PARTS[device]


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132,
                      block_n: int = 64, min_keys: int | None = None, fill: int = 4) -> int:
    """Flash-decoding splits: when few sequences decode, enough programs to fill the chip ``fill``
    times over, never slices shorter than ``min_keys`` keys (two ``block_n`` tiles unless given).
    A program's keys are a chain of dependent tiles, so one program an SM leaves it waiting on
    memory: on the H200, 16 qwen3-0.6b sequences over ~1,024 keys took 38.4 us in two splits (the
    chip filled twice) and 29.4 us in four (``benchmarks/gemv.py --attention-batches``)."""
    min_keys = min_keys or 2 * block_n
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= num_sms or max_seq_len <= 2 * min_keys:
        return 1
    want = min(triton.cdiv(fill * num_sms, programs), max_seq_len // min_keys)
    return max(1, min(32, 1 << int(math.log2(max(want, 1)))))


def prefill_splits(num_splits: int, num_seqs: int, num_tokens: int, block_q: int) -> int:
    """The split count for a step of ``num_tokens`` queries in tiles of ``block_q``, given one sized
    for one program per sequence along the queries (decode): a step with at least two query tiles
    a sequence has that many more programs already, so it gets proportionally fewer splits, and a
    prompt none. Every split count is a kernel compile of its own, so this also keeps prompts on
    the variant every prefill runs: a prompt arriving alone would otherwise compile one
    mid-serving."""
    q_tiles = -(-num_tokens // block_q)
    if num_splits > 1 and q_tiles >= 2 * num_seqs:
        return 1 << int(math.log2(max(1, num_splits * num_seqs // q_tiles)))
    return num_splits
