"""CUDA graphs of a head's ragged feed: the positions a catch-up feeds.

A proposer that records the target's states (EAGLE, MTP) first feeds its cache every position it
lacks: a new request's whole prompt, the steps the speculation policy skipped. Those runs are
ragged (one request a few rows, another hundreds), so they ran eagerly: one forward of the head,
a few dozen kernel launches and their metadata built on the host, about 2 ms of host time on the
H200 in every step that admits a request. :class:`FeedGraphs` captures that forward once per padded
row count (64, 256, 1,024 and 4,096 rows, within the token budget) for up to ``max_seqs`` pieces,
on static buffers: token ids, positions, cache slots, query starts, context lengths, block tables
and each piece's last row, whose output the graph gathers. A call copies the live values in (two
host-to-device copies from pinned buffers used in turn) and replays the smallest graph that fits.
Rows past the live ones write no KV and belong to no piece; pieces past the live ones own no rows.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Sequence

import numpy as np
import torch

from specloop.models.attention import AttentionMetadata

from .step_graphs import StepFn, capture_sizes

ROW_BUCKETS = (64, 256, 1024, 4096)


class FeedGraphs:
    def __init__(self, fn: StepFn, device: torch.device, max_seqs: int, max_rows: int, max_len: int,
                 block_size: int, pool: object = None, selects: bool = False) -> None:
        # ``selects``: ``fn`` takes ``rows=`` (the pieces' last rows) and returns their outputs alone.
        self._fn = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
        self.selects = selects
        self.device, self.block_size, self.max_len = device, block_size, max_len
        self.max_seqs = s = max_seqs
        self.max_blocks = -(-max_len // block_size)
        # A graph's warm-up feeds placeholder pieces of at most max_len - 1 rows each.
        top = min(max_rows, ROW_BUCKETS[-1], s * (max_len - 1))
        self.sizes = sorted({r for r in ROW_BUCKETS if r < top} | {top}) if top > 0 else []
        r = top
        i64 = dict(dtype=torch.int64, device=device)
        self.token_ids = torch.zeros(max(r, 1), **i64)
        self._rows = torch.zeros(2, max(r, 1), **i64)  # positions, slots
        self._seqs = torch.zeros(3, s + 1, **i64)  # query starts, context lengths, last rows
        self.query_start_loc = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(s, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(s, self.max_blocks, dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self._host = [(torch.zeros(3, max(r, 1), dtype=torch.int64, pin_memory=pinned),
                       torch.zeros(3, s + 1, dtype=torch.int64, pin_memory=pinned),
                       torch.zeros(s, self.max_blocks, dtype=torch.int32, pin_memory=pinned)) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_replays = 0
        self.pool = pool

    def capture(self) -> None:
        if self.sizes:
            capture_sizes(self, self._placeholders, self.forward, "ragged draft feeds")

    def forward(self, size: int) -> tuple[torch.Tensor, ...]:
        """What a graph runs: the feed over the first ``size`` rows, and each piece's last row."""
        s = self.max_seqs
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, slot_mapping=self._rows[1, :size],
            block_tables=self.block_tables, max_query_len=size, max_seq_len=self.max_len,
            query_start_loc_cpu=[0] * (s + 1), seq_lens_cpu=[self.max_len] * s)
        last = self._seqs[2, :min(s, size)]  # a piece holds a row at least: no more pieces than rows
        if self.selects:
            return self._fn()(meta, self.token_ids[:size], self._rows[0, :size], rows=last)
        (out,) = self._fn()(meta, self.token_ids[:size], self._rows[0, :size])
        return (out[last],)

    def _placeholders(self, size: int) -> None:
        """Pieces of at most ``max_len - 1`` rows over block 0, writing no KV (a capture's warm-up)."""
        piece = self.max_len - 1
        lengths = [min(piece, size - k) for k in range(0, size, piece)]
        starts = np.concatenate([[0], np.cumsum(lengths)])
        qsl = np.full(self.max_seqs + 1, size, dtype=np.int64)
        qsl[:len(starts)] = starts
        self._rows[0, :size].copy_(torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])))
        self._rows[1, :size].fill_(-1)
        self.query_start_loc.copy_(torch.from_numpy(qsl))
        self.seq_lens.fill_(1)
        self.seq_lens[:len(lengths)].copy_(torch.tensor(lengths))
        self._seqs[2].zero_()
        self.block_tables.zero_()

    def fits(self, num_pieces: int, num_rows: int) -> bool:
        return bool(self.graphs) and num_pieces <= self.max_seqs and num_rows <= self.sizes[-1]

    def feed_into(self, last: torch.Tensor, pieces: Sequence[tuple[int, int, int]], end: np.ndarray,
                  reqs: np.ndarray, inputs: object) -> bool:
        """A proposer's catch-up group (``Recorded.pieces``: ``(k, s, e)`` over requests
        ``reqs[k]`` of ``inputs``, whose runs end at ``end[k]``) fed by a replay, each run's output at
        its end written to ``last[k]``; False, feeding nothing, when no graph fits the group."""
        group = [(int(reqs[k]), s, e) for k, s, e in pieces]
        if not self.fits(len(group), sum(e - s for _, s, e in group)):
            return False
        out = self.run(group, inputs.token_ids, inputs.block_ids)  # each piece's last row
        ends = [j for j, (k, _, e) in enumerate(pieces) if e == end[k]]
        index = torch.as_tensor([pieces[j][0] for j in ends], dtype=torch.int64, device=self.device)
        last[index] = out[torch.as_tensor(ends, dtype=torch.int64, device=self.device)]
        return True

    def run(self, pieces: Sequence[tuple[int, int, int]], token_ids: Sequence[np.ndarray],
            block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Feed piece ``(i, s, e)`` positions ``s .. e - 1`` of request ``i`` (its tokens after them,
        ``token_ids[i][s + 1:e + 1]``, in the request's blocks ``block_ids[i]``). Returns each
        piece's output at its last position, ``[len(pieces), H]`` (a view of a static buffer, valid
        until the next call)."""
        n = len(pieces)
        lengths = np.array([e - s for _, s, e in pieces], dtype=np.int64)
        rows = int(lengths.sum())
        size = self.sizes[bisect.bisect_left(self.sizes, rows)]
        bs, turn = self.block_size, self._turn
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        host_rows_t, host_seqs_t, tables_t = self._host[turn]
        host_rows, host_seqs, tables = host_rows_t.numpy(), host_seqs_t.numpy(), tables_t.numpy()
        qsl = np.concatenate([[0], np.cumsum(lengths)])
        at = 0
        for k, (i, s, e) in enumerate(pieces):
            blocks = block_ids[i]
            if -(-e // bs) > len(blocks) or len(blocks) > self.max_blocks:
                raise RuntimeError(f"feed position {e - 1} is past the request's {len(blocks)} KV blocks")
            tables[k, :len(blocks)] = blocks
            p = np.arange(s, e)
            host_rows[0, at:at + e - s] = p
            host_rows[1, at:at + e - s] = tables[k, p // bs].astype(np.int64) * bs + p % bs
            host_rows[2, at:at + e - s] = token_ids[i][s + 1:e + 1]
            at += e - s
        host_rows[0, rows:size] = 0
        host_rows[1, rows:size] = -1
        host_rows[2, rows:size] = 0
        host_seqs[0, :n + 1] = qsl
        host_seqs[0, n + 1:] = rows
        host_seqs[1, :n] = [e for _, _, e in pieces]
        host_seqs[1, n:] = 1
        host_seqs[2, :n] = qsl[1:] - 1
        host_seqs[2, n:] = 0
        self._rows.copy_(host_rows_t[:2, :self._rows.shape[1]], non_blocking=True)
        self.token_ids.copy_(host_rows_t[2, :self.token_ids.shape[0]], non_blocking=True)
        self._seqs.copy_(host_seqs_t, non_blocking=True)
        self.block_tables[:n].copy_(tables_t[:n], non_blocking=True)
        if self.device.type == "cuda":
            event = self._copied[turn] = torch.cuda.Event()
            event.record()
        self.query_start_loc.copy_(self._seqs[0])
        self.seq_lens.copy_(self._seqs[1, :self.max_seqs])
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][0][:n]
