"""Expand one step's per-request schedule into per-token inputs on the device.

The persistent batch keeps every live request's token ids and block table in device buffers
(one row per request slot). Each step the host sends only, per scheduled request ``i``: its slot,
its first computed position ``start[i]`` and the packed prefix sums ``qsl``. This kernel then
writes, for every packed token ``t`` of request ``i`` at position ``p = start[i] + t - qsl[i]``:
``input_ids[t] = tokens[slot, p]``, ``positions[t] = p`` and ``slot_mapping[t]`` (block table
lookup), so no per-token array crosses PCIe.

A step planned before the previous verification's outcome reached the host assumed every draft
accepted: each request flagged ``lagged[i]`` first pulls its start and context length (and, when a
decode graph draws, where it stores the token) back by its slot's rejected count ``lag[slot]``,
which the verification wrote on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prepare_inputs_kernel(
    token_buf_ptr, stride_tok, block_table_ptr, stride_bt,
    req_slot_ptr, start_ptr, qsl_ptr,
    input_ids_ptr, positions_ptr, slot_mapping_ptr,
    lag_ptr, lagged_ptr, seq_lens_ptr, write_at_ptr,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, LAG: tl.constexpr, WRITE_AT: tl.constexpr,
):
    i = tl.program_id(0)
    req = tl.load(req_slot_ptr + i).to(tl.int64)
    start = tl.load(start_ptr + i)
    if LAG:
        back = tl.load(lagged_ptr + i) * tl.load(lag_ptr + req)
        start -= back
        tl.store(start_ptr + i, start)
        tl.store(seq_lens_ptr + i, tl.load(seq_lens_ptr + i) - back)
        if WRITE_AT:
            tl.store(write_at_ptr + i, tl.load(write_at_ptr + i) - back)
    first = tl.load(qsl_ptr + i)
    n = tl.load(qsl_ptr + i + 1) - first
    for off in range(0, n, BLOCK):
        j = off + tl.arange(0, BLOCK)
        ok = j < n
        pos = start + j
        token = tl.load(token_buf_ptr + req * stride_tok + pos, mask=ok, other=0)
        page = tl.load(block_table_ptr + req * stride_bt + pos // PAGE_SIZE, mask=ok, other=0)
        tl.store(input_ids_ptr + first + j, token.to(tl.int64), mask=ok)
        tl.store(positions_ptr + first + j, pos.to(tl.int64), mask=ok)
        tl.store(slot_mapping_ptr + first + j, page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE, mask=ok)


def prepare_inputs(token_buf: torch.Tensor, block_table: torch.Tensor, req_slots: torch.Tensor,
                   starts: torch.Tensor, query_start_loc: torch.Tensor, page_size: int,
                   input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                   lag: torch.Tensor | None = None, lagged: torch.Tensor | None = None,
                   seq_lens: torch.Tensor | None = None, write_at: torch.Tensor | None = None) -> None:
    """Fill ``input_ids``, ``positions`` and ``slot_mapping`` (int64, at least ``qsl[-1]`` long).

    :param token_buf: int32 ``[max_reqs, max_len]``, each slot's known tokens (plus drafts).
    :param block_table: int32 ``[max_reqs, max_blocks]``, each slot's physical blocks.
    :param req_slots: int32 ``[B]`` slot of each scheduled request; ``starts`` int32 ``[B]`` its
        first computed position; ``query_start_loc`` int32 ``[B + 1]``.
    :param lag: int32 ``[max_reqs]``, each slot's rejected count; with ``lagged`` (int32 ``[B]``,
        0 or 1) and ``seq_lens`` (int32 ``[B]``), both pulled back in place with ``starts`` (and
        ``write_at``, int32 ``[B]``, when given) for the flagged requests.
    """
    num_reqs = req_slots.shape[0]
    if starts.shape[0] != num_reqs or query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError("req_slots, starts and query_start_loc disagree on the batch size")
    if token_buf.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("token_buf and block_table need a unit last stride")
    if num_reqs == 0:
        return
    has_lag = lag is not None
    if has_lag and (lagged is None or seq_lens is None):
        raise ValueError("lag needs lagged and seq_lens")
    _prepare_inputs_kernel[(num_reqs,)](
        token_buf, token_buf.stride(0), block_table, block_table.stride(0),
        req_slots, starts, query_start_loc, input_ids, positions, slot_mapping,
        lag if has_lag else starts, lagged if has_lag else starts, seq_lens if has_lag else starts,
        write_at if write_at is not None else starts,
        PAGE_SIZE=page_size, BLOCK=256, LAG=has_lag, WRITE_AT=has_lag and write_at is not None, num_warps=4,
    )
