"""CUDA graphs of a proposer's one-token-per-request steps.

After its first step (which feeds each request a ragged run of tokens: the accepted ones, or a
whole prompt), a draft model or a head feeds every live request exactly one token per draft:
a uniform decode step of its own. :class:`StepGraphs` captures that step once per padded request
count (1, 2, 4, 8, then multiples of 16 up to ``max_reqs``), on static buffers: token ids,
positions, cache slots, context lengths, block tables and any extra per-request inputs (a head's
hidden state). A call copies the live values in and replays the smallest graph that fits; rows
past the live ones are padding that writes no KV and whose outputs are ignored.

The token ids (and extra inputs) are copied device to device, so a greedy chain of drafts (argmax
of step ``j`` feeding step ``j + 1``) runs without the host waiting between steps; the host reads
all the drafts once at the end. The flash-decoding split count is fixed at capture for the longest
context, as in the target's graphs.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from typing import Callable, Sequence

import numpy as np
import torch

from specloop.models.attention import AttentionMetadata

logger = logging.getLogger("specloop")

# fn(metadata, token_ids [B], positions [B], *extra [B, ...]) -> outputs, each [B, ...]
StepFn = Callable[..., tuple[torch.Tensor, ...]]


def graph_sizes(max_reqs: int) -> list[int]:
    """Padded request counts a graph is captured for (the target's too): 1, 2, 4, 8, then every
    multiple of 16 up to ``max_reqs`` (and ``max_reqs`` itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_reqs] + list(range(16, max_reqs + 1, 16))
    return sorted(set(sizes + [max_reqs]))


class StepGraphs:
    def __init__(self, fn: StepFn, device: torch.device, max_reqs: int, max_len: int, block_size: int,
                 extra: Sequence[tuple[tuple[int, ...], torch.dtype]] = ()) -> None:
        # The proposer owns these graphs and ``fn`` is its method: a weak reference, so that the
        # proposer (and the device memory it holds) goes away with its engine, not at a later gc.
        self._fn = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
        self.device = device
        self.block_size = block_size
        self.max_len = max_len
        self.max_blocks = -(-max_len // block_size)
        self.sizes = graph_sizes(max_reqs)
        n = max(self.sizes)
        i64 = dict(dtype=torch.int64, device=device)
        self.token_ids = torch.zeros(n, **i64)
        self.extra = [torch.zeros(n, *shape, dtype=dtype, device=device) for shape, dtype in extra]
        # [positions | slots | seq_lens] in one host-to-device copy, block tables in another, from
        # pinned buffers used in turn: a buffer is rewritten only after its last copy ran.
        pinned = device.type == "cuda"
        self._host = [torch.zeros(3, n, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._host_tables = [torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=pinned)
                             for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._packed = torch.zeros(3, n, **i64)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_replays = 0

    def capture(self) -> None:
        pool = None
        for size in sorted(self.sizes, reverse=True):
            meta = self._metadata(size)
            graph = torch.cuda.CUDAGraph()
            args = (self.token_ids[:size], self._packed[0, :size], *(e[:size] for e in self.extra))
            with torch.inference_mode():
                self._fill_padding(0, size)
                fn = self._fn()
                fn(meta, *args)  # warm-up outside the graph
                torch.cuda.synchronize(self.device)
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = fn(meta, *args)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs of draft steps (up to %d requests)", len(self.graphs), max(self.sizes))

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            slot_mapping=self._packed[1, :size], block_tables=self.block_tables[:size], max_query_len=1,
            max_seq_len=self.max_len, query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[self.max_len] * size)

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows ``[start, end)`` own one token at position 0 that writes no KV (slot -1)."""
        self._packed[0, start:end].zero_()
        self._packed[1, start:end].fill_(-1)
        self.seq_lens[start:end].fill_(1)

    def fits(self, num_reqs: int) -> bool:
        return num_reqs <= self.sizes[-1]

    def run(self, token_ids: torch.Tensor, positions: np.ndarray, block_ids: Sequence[Sequence[int]],
            *extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One step over ``len(positions)`` requests: request ``k`` feeds ``token_ids[k]`` at
        ``positions[k]`` of the request whose blocks are ``block_ids[k]``; ``extra`` are the
        per-request inputs declared at construction. Returns the step's outputs' rows (views of
        static buffers, valid until the next call)."""
        n = len(positions)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        if len(block_ids) != n or len(token_ids) != n:
            raise ValueError(f"{len(token_ids)} token ids and {len(block_ids)} block tables for {n} positions")
        bs, turn = self.block_size, self._turn
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        host_t, tables_t = self._host[turn], self._host_tables[turn]
        host, tables = host_t.numpy(), tables_t.numpy()
        host[0, :n] = positions
        for k, blocks in enumerate(block_ids):
            p = int(positions[k])
            if p // bs >= len(blocks) or len(blocks) > self.max_blocks:
                raise RuntimeError(f"draft position {p} is past the request's {len(blocks)} KV blocks")
            host[1, k] = blocks[p // bs] * bs + p % bs
            tables[k, :len(blocks)] = blocks
        host[2, :n] = np.asarray(positions) + 1
        self._packed[:, :n].copy_(host_t[:, :n], non_blocking=True)
        self.block_tables[:n].copy_(tables_t[:n], non_blocking=True)
        if self.device.type == "cuda":
            event = self._copied[turn] = torch.cuda.Event()
            event.record()
        self.seq_lens[:n].copy_(self._packed[2, :n])
        if n < size:
            self._fill_padding(n, size)
        self.token_ids[:n].copy_(token_ids)
        for buffer, value in zip(self.extra, extra):
            buffer[:n].copy_(value)
        self.graphs[size].replay()
        self.num_replays += 1
        return tuple(out[:n] for out in self.outputs[size])


def collect_drafts(steps: list[tuple[list[int], torch.Tensor]], drafts: list[list[int]]) -> None:
    """Append each step's device tokens (``(requests, tokens)``, one token per listed request) to
    ``drafts``, with one device-to-host read for all steps."""
    values = torch.cat([tokens for _, tokens in steps]).tolist()
    first = 0
    for rows, _ in steps:
        for k, i in enumerate(rows):
            drafts[i].append(values[first + k])
        first += len(rows)


def graphs_wanted(config: object, device: torch.device, attn_backend: object) -> bool:
    """Whether a proposer should capture its steps: on CUDA, with the Triton attention backend (its
    kernels read only device tensors), unless ``enforce_eager`` or the gpu runner's
    ``cuda_graphs`` option turns graphs off."""
    options = getattr(config, "plugin_options", {}).get("gpu", {})
    return (device.type == "cuda" and getattr(attn_backend, "name", "") == "triton"
            and not getattr(config, "enforce_eager", False) and bool(options.get("cuda_graphs", True)))
