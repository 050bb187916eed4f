"""A uniform greedy verification's bookkeeping on the device, one program per request.

Request ``i`` computed ``q`` rows at positions ``first[i] ..``: its newest token, then ``q - 1``
drafts (``input_ids[i*q + 1 ..]``); ``top[i*q + j]`` is the target's greedy token after row ``j``.
:func:`accept` finds how many rows it accepted (its drafts up to the first the target disagreed
with, plus one), writes the target's own token after them (``top[i*q + accepted - 1]``) into the
request's device token row at ``first + accepted`` and the number of drafts it rejected into the
slot's ``lag``; :func:`write_drafts` then writes the ``K`` drafts proposed after it at
``first + accepted + 1 ..``. The next step reads both there, so no token crosses to the device
(``backends.gpu.persistent_batch``). Each replaces a dozen small torch ops and their host dispatch.
Writes past a token row's end are dropped: the padding rows of a CUDA graph (their slot the spare
one) may hold any position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_kernel(input_ids_ptr, top_ptr, positions_ptr, req_slots_ptr, tokens_ptr, row_len, lag_ptr,
                   accepted_ptr, Q: tl.constexpr, BLOCK_Q: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_Q)
    # Draft j + 1 against the target's token after row j.
    drafts = tl.load(input_ids_ptr + i * Q + 1 + j, mask=j < Q - 1, other=0)
    target = tl.load(top_ptr + i * Q + j, mask=j < Q - 1, other=0)
    rejected_at = tl.min(tl.where((j < Q - 1) & (drafts != target), j, Q - 1), axis=0)
    accepted = rejected_at + 1
    newest = tl.load(top_ptr + i * Q + accepted - 1)
    slot = tl.load(req_slots_ptr + i).to(tl.int64)
    first = tl.load(positions_ptr + i * Q)
    tl.store(tokens_ptr + slot * row_len + first + accepted, newest.to(tl.int32), mask=first + accepted < row_len)
    tl.store(lag_ptr + slot, (Q - accepted).to(tl.int32))
    tl.store(accepted_ptr + i, accepted.to(tl.int64))


@triton.jit
def _write_drafts_kernel(drafts_ptr, accepted_ptr, positions_ptr, req_slots_ptr, tokens_ptr, row_len,
                         Q: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    drafts = tl.load(drafts_ptr + i * K + k, mask=k < K, other=0)
    slot = tl.load(req_slots_ptr + i).to(tl.int64)
    start = tl.load(positions_ptr + i * Q) + tl.load(accepted_ptr + i) + 1
    tl.store(tokens_ptr + slot * row_len + start + k, drafts.to(tl.int32), mask=(k < K) & (start + k < row_len))


def accept(input_ids: torch.Tensor, top: torch.Tensor, positions: torch.Tensor, q: int, req_slots: torch.Tensor,
           tokens: torch.Tensor, lag: torch.Tensor) -> torch.Tensor:
    """The rows each of ``len(req_slots)`` requests accepted (int64 ``[n]``); see the module
    docstring. ``input_ids``, ``top``, ``positions``: int64 ``[n * q]``; ``req_slots``: int32
    ``[n]``; ``tokens``: int32 ``[slots, row_len]``; ``lag``: int32 ``[slots]``."""
    n = req_slots.shape[0]
    if input_ids.shape[0] < n * q or top.shape[0] < n * q or positions.shape[0] < n * q:
        raise ValueError(f"{n} requests of {q} rows need {n * q} input ids, tokens and positions")
    if tokens.stride(-1) != 1:
        raise ValueError("the token rows need a unit last stride")
    accepted = torch.empty(n, dtype=torch.int64, device=top.device)
    if n:
        _accept_kernel[(n,)](input_ids, top, positions, req_slots, tokens, tokens.stride(0), lag, accepted,
                             Q=q, BLOCK_Q=max(2, triton.next_power_of_2(q)), num_warps=1)
    return accepted


def write_drafts(drafts: torch.Tensor, accepted: torch.Tensor, positions: torch.Tensor, q: int,
                 req_slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Request ``i``'s drafts ``drafts[i]`` (int64 ``[n, K]``) into its token row after its
    newest token (``positions[i * q] + accepted[i]``)."""
    n, k = drafts.shape
    if accepted.shape[0] != n or req_slots.shape[0] < n:
        raise ValueError(f"{n} rows of drafts for {accepted.shape[0]} accepted counts")
    if n and k:
        _write_drafts_kernel[(n,)](drafts.contiguous(), accepted, positions, req_slots, tokens, tokens.stride(0),
                                   Q=q, K=k, BLOCK_K=max(2, triton.next_power_of_2(k)), num_warps=1)
