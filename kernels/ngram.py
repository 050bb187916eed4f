"""Prompt lookup on the device, one program per request: the n-gram proposer's search
(``proposers.ngram``) over the token rows the GPU runner keeps, right after a greedy verification's
:func:`kernels.verify.accept` wrote each request's next token there.

Request ``i`` (token row ``req_slots[i]``) knows ``L = positions[i * q] + accepted[i] + 1``
tokens. Its candidate ends are the earlier occurrences of its newest token; each is extended
backwards while it agrees with the suffix, up to ``max_n`` tokens. The longest match of at least
``min_n`` tokens wins, the earliest among equals; the drafts are the tokens after it, repeating that
continuation when it runs into the end of the sequence. With no match every draft is the newest
token (what a padded draft would be), since a launched proposal has ``K`` drafts per request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ngram_kernel(tokens_ptr, row_len, req_slots_ptr, positions_ptr, accepted_ptr, drafts_ptr, q, min_n,
                  MAX_N: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tokens_ptr + tl.load(req_slots_ptr + i).to(tl.int64) * row_len
    known = tl.load(positions_ptr + i * q) + tl.load(accepted_ptr + i) + 1
    known = tl.minimum(tl.maximum(known, 1), row_len)  # a padding row may hold any position
    newest = tl.load(row + known - 1)
    best = known * 0
    best_end = best - 1
    for start in range(0, known - 1, BLOCK):
        ends = start + tl.arange(0, BLOCK)
        extending = (ends < known - 1) & (tl.load(row + ends, mask=ends < known - 1, other=-1) == newest)
        length = extending.to(tl.int64)
        for m in tl.static_range(1, MAX_N):
            extending = extending & (ends >= m)  # and so m < known - 1
            suffix = tl.load(row + tl.maximum(known - 1 - m, 0))
            extending = extending & (tl.load(row + ends - m, mask=extending, other=-1) == suffix)
            length += extending.to(tl.int64)
        block_best = tl.max(length, axis=0)
        block_end = tl.min(tl.where((length == block_best) & (length > 0), ends, row_len), axis=0)
        better = block_best > best
        best_end = tl.where(better, block_end, best_end)
        best = tl.maximum(best, block_best)
    found = best >= min_n
    period = tl.maximum(known - 1 - best_end, 1)
    k = tl.arange(0, BLOCK_K)
    drafts = tl.load(row + best_end + 1 + k % period, mask=k < K, other=0)  # inside the row, found or not
    drafts = tl.where(found, drafts, newest)
    tl.store(drafts_ptr + i * K + k, drafts.to(tl.int64), mask=k < K)


BLOCK = 1024  # candidate ends a program compares at once: a 32k-token row is 32 dependent rounds


def ngram_drafts(tokens: torch.Tensor, req_slots: torch.Tensor, positions: torch.Tensor, accepted: torch.Tensor,
                 q: int, min_n: int, max_n: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``k`` drafts (int64 ``[n, k]``) of each of ``n = len(accepted)`` requests; see the
    module docstring. ``tokens``: int32 ``[slots, row_len]``; ``req_slots``: int32 ``[>= n]``;
    ``positions``: int64, request ``i``'s first row at ``i * q``; ``accepted``: int64 ``[n]``."""
    n = accepted.shape[0]
    if req_slots.shape[0] < n or positions.shape[0] < (n - 1) * q + 1:
        raise ValueError(f"{n} requests of {q} rows need as many slots and positions")
    if tokens.stride(-1) != 1:
        raise ValueError("the token rows need a unit last stride")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    if out is None:
        out = torch.empty((n, k), dtype=torch.int64, device=tokens.device)
    if n and k:
        _ngram_kernel[(n,)](tokens, tokens.stride(0), req_slots, positions, accepted, out, q, min_n,
                            MAX_N=max_n, K=k, BLOCK=BLOCK, BLOCK_K=max(2, triton.next_power_of_2(k)), num_warps=4)
    return out
