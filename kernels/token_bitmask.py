"""Structured output's grammar mask: set the logits of the tokens a packed bitmask forbids to -inf.

``bitmask[m]`` holds one bit per vocabulary id, 32 to an int32 word (bit ``v % 32`` of word
``v // 32``; set: allowed), and applies to logits row ``indices[m]``. One program masks one block of
one row, so rows without a grammar are never read. Ids past the mask's ``32 * words`` (a model
vocabulary padded beyond the tokenizer's) are forbidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, stride_l, bitmask_ptr, stride_b, indices_ptr, V, W,
                                BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    row = tl.load(indices_ptr + m).to(tl.int64)
    ids = block * BLOCK + tl.arange(0, BLOCK)
    in_vocab = ids < V
    words = tl.load(bitmask_ptr + m * stride_b + ids // 32, mask=in_vocab & (ids // 32 < W), other=0)
    allowed = ((words >> (ids % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + ids, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor,
                        block: int = 1024) -> None:
    """In place: ``logits[indices[m], v] = -inf`` where bit ``v`` of ``bitmask[m]`` is clear.

    :param logits: ``[R, V]`` float, last dimension contiguous.
    :param bitmask: ``[M, W]`` int32, on the logits' device.
    :param indices: ``[M]`` int32/int64 rows of ``logits``, each at most once.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be a 2-D tensor with a contiguous last dimension")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[0] != indices.shape[0]:
        raise ValueError(f"bitmask must be int32 [M, W] with M = len(indices), got {tuple(bitmask.shape)} "
                         f"{bitmask.dtype} for {indices.shape[0]} indices")
    if bitmask.device != logits.device or indices.device != logits.device:
        raise ValueError("logits, bitmask and indices must be on one device")
    if indices.shape[0] == 0:
        return
    bitmask = bitmask.contiguous()
    vocab = logits.shape[1]
    grid = (indices.shape[0], triton.cdiv(vocab, block))
    _apply_token_bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), indices.contiguous(),
                                      vocab, bitmask.shape[1], BLOCK=block)
