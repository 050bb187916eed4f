"""CUDA graphs of a proposer's uniform draft steps.

After its first step (which feeds each request a ragged run of tokens: the accepted ones, or a
whole prompt), a draft model or a head feeds every live request exactly one token per draft:
a uniform decode step of its own. :class:`StepGraphs` captures such a step once per padded request
count (1, 2, 4, 8, then multiples of 16 up to ``max_reqs``), on static buffers: token ids,
positions, cache slots, context lengths, block tables and any extra per-request inputs (a head's
hidden state). A call copies the live values in and replays the smallest graph that fits; rows
past the live ones are padding that writes no KV and whose outputs are ignored. The flash-decoding
split count is fixed at capture for the longest context, as in the target's graphs.

The first step can be captured too when it is uniform: in a batch of decode or verification steps
padded to one draft count, every request computed ``q`` rows of the target, and a proposer may
feed all ``q`` of them (the rows of rejected drafts too, whose cache entries sit past the accepted
tokens and are rewritten before anything reads them). ``rows_per_req=q`` captures that shape:
``q`` consecutive positions per request, ``q * n`` rows in all. ``proposers.chain_graphs`` builds
the further drafts, and whole proposals, on it.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from typing import Any, Callable, Sequence

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


def capture_sizes(graphs: Any, prepare: Callable[[int], Any], forward: Callable[[int], Any],
                  what: str, into: tuple[dict, dict] | None = None) -> None:
    """Capture ``forward(size)`` into ``graphs.graphs[size]`` (its outputs into
    ``graphs.outputs[size]``; or the two dicts ``into``) for every size, largest first, all in
    ``graphs.pool`` (a new pool if None), after ``prepare(size)`` and one warm-up run outside the
    graph."""
    captured, outputs = into or (graphs.graphs, graphs.outputs)
    pool = graphs.pool
    for size in sorted(graphs.sizes, reverse=True):
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode():
            prepare(size)
            forward(size)  # warm-up outside the graph
            torch.cuda.synchronize(graphs.device)
            with torch.cuda.graph(graph, pool=pool):
                outputs[size] = forward(size)
        pool = graph.pool()
        captured[size] = graph
    graphs.pool = pool
    torch.cuda.synchronize(graphs.device)
    logger.info("captured %d CUDA graphs of %s (up to %d requests)", len(captured), what, max(graphs.sizes))


class StepGraphs:
    ROWS = 3  # int64 rows copied in per call: positions, slots, context lengths (first n)

    def __init__(self, fn: StepFn, device: torch.device, max_reqs: int, max_len: int, block_size: int,
                 extra: Sequence[tuple[tuple[int, ...], torch.dtype]] = (), rows_per_req: int = 1,
                 pool: object = None) -> None:
        # The proposer owns these graphs and ``fn`` is its method: a weak reference, so that the
        # proposer (and the device memory it holds) goes away with its engine, not at a later gc.
        self._fn = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
        self.device = device
        self.block_size = block_size
        self.max_len = max_len
        self.max_blocks = -(-max_len // block_size)
        self.q = q = rows_per_req
        self.sizes = graph_sizes(max_reqs)
        n = max(self.sizes)
        i64 = dict(dtype=torch.int64, device=device)
        self.token_ids = torch.zeros(n * q, **i64)
        self.extra = [torch.zeros(n * q, *shape, dtype=dtype, device=device) for shape, dtype in extra]
        # [positions | slots | seq_lens (first n)] in one host-to-device copy, block tables in
        # another, from pinned buffers used in turn: a buffer is rewritten only after its last copy ran.
        pinned = device.type == "cuda"
        self._host = [torch.zeros(self.ROWS, n * q, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._host_tables = [torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=pinned)
                             for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._packed = torch.zeros(self.ROWS, n * q, **i64)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, n * q + 1, q, dtype=torch.int32, device=device)
        self._offsets = np.arange(q)
        self._pad_positions = torch.arange(q, **i64).repeat(n)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_replays = 0
        self.pool = pool  # a memory pool shared with other graphs of the same proposer, if given

    def capture(self) -> None:
        capture_sizes(self, lambda size: self._fill_padding(0, size), self.forward,
                      f"draft steps of {self.q} tokens per request")

    def forward(self, size: int, **kwargs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a graph runs: the step over the first ``size`` requests of the static inputs
        (``kwargs``: more of the step function's arguments)."""
        rows = size * self.q
        return self._fn()(self._metadata(size), self.token_ids[:rows], self._packed[0, :rows],
                          *(e[:rows] for e in self.extra), **kwargs)

    def _metadata(self, size: int) -> AttentionMetadata:
        q = self.q
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            slot_mapping=self._packed[1, :size * q], block_tables=self.block_tables[:size], max_query_len=q,
            max_seq_len=self.max_len, query_start_loc_cpu=list(range(0, size * q + 1, q)),
            seq_lens_cpu=[self.max_len] * size)

    def _fill_padding(self, start: int, end: int) -> None:
        """Requests ``[start, end)`` own tokens at positions ``0..q-1`` that write no KV (slot -1)."""
        q = self.q
        self._packed[0, start * q:end * q].copy_(self._pad_positions[:(end - start) * q])
        self._packed[1, start * q:end * q].fill_(-1)
        self.seq_lens[start:end].fill_(q)

    def fits(self, num_reqs: int) -> bool:
        return num_reqs <= self.sizes[-1]

    def run(self, token_ids: torch.Tensor, positions: np.ndarray, block_ids: Sequence[Sequence[int]],
            *extra: torch.Tensor, more: Sequence[np.ndarray] = ()) -> tuple[torch.Tensor, ...]:
        """One step over ``len(block_ids)`` requests: request ``k`` feeds the ``q`` tokens
        ``token_ids[k*q:(k+1)*q]`` at positions ``positions[k]``, ``positions[k] + 1``, ... of the
        request whose blocks are ``block_ids[k]``; ``extra`` are the per-row inputs declared at
        construction, ``more`` a subclass's packed per-request rows (host arrays, or tensors already on
        the device). Returns the step's outputs
        (views of static buffers, valid until the next call)."""
        n, q = len(block_ids), self.q
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        if len(positions) != n or len(token_ids) != n * q:
            raise ValueError(f"{len(token_ids)} token ids and {len(positions)} positions for {n} requests "
                             f"of {q} tokens")
        bs, turn = self.block_size, self._turn
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        host_t, tables_t = self._host[turn], self._host_tables[turn]
        host, tables = host_t.numpy(), tables_t.numpy()
        rows = (np.asarray(positions, dtype=np.int64)[:, None] + self._offsets).reshape(-1)
        host[0, :n * q] = rows
        for k, blocks in enumerate(block_ids):
            last = int(rows[k * q + q - 1])
            if last // bs >= len(blocks) or len(blocks) > self.max_blocks:
                raise RuntimeError(f"draft position {last} is past the request's {len(blocks)} KV blocks")
            tables[k, :len(blocks)] = blocks
            if q == 1:
                host[1, k] = blocks[last // bs] * bs + last % bs
            else:
                p = rows[k * q:(k + 1) * q]
                host[1, k * q:(k + 1) * q] = tables[k, p // bs].astype(np.int64) * bs + p % bs
        host[2, :n] = rows[q - 1::q] + 1
        on_device = []
        for r, values in enumerate(more, start=3):
            if isinstance(values, torch.Tensor):
                on_device.append((r, values))
            else:
                host[r, :n] = values
        self._packed[:, :n * q].copy_(host_t[:, :n * q], non_blocking=True)
        for r, values in on_device:
            self._packed[r, :n].copy_(values)
        self.block_tables[:n].copy_(tables_t[:n], non_blocking=True)
        if self.device.type == "cuda":
            event = self._copied[turn] = torch.cuda.Event()
            event.record()
        self.seq_lens[:n].copy_(self._packed[2, :n])
        if n < size:
            self._fill_padding(n, size)
        self.token_ids[:n * q].copy_(token_ids)
        for buffer, value in zip(self.extra, extra):
            buffer[:n * q].copy_(value)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size]


class LaunchGraphs:
    """A launching proposer's proposal after a verification of ``q`` rows per request, as one CUDA
    graph per padded request count over the runner's step (``DeviceStep``): the rows each request
    accepted (its next token written into its token row), ``propose(accepted, q)`` (the
    ``[size, K]`` drafts, device work only), the drafts into the token rows."""

    def __init__(self, propose: Callable[[torch.Tensor, int], torch.Tensor], step: Any, q: int, max_reqs: int,
                 device: torch.device, what: str, pool: object = None) -> None:
        self._propose = weakref.WeakMethod(propose) if hasattr(propose, "__self__") else (lambda: propose)
        self.step, self.q, self.device, self.what, self.pool = step, q, device, what, pool
        self.sizes = graph_sizes(max_reqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # drafts [size, K], accepted [size]
        self.num_replays = 0

    def capture(self) -> None:
        capture_sizes(self, lambda size: None, self.forward, f"{self.what} after {self.q}-row verifications")

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        accepted = self.step.accept_rows(size, self.q)
        drafts = self._propose()(accepted, self.q)
        self.step.write_row_drafts(drafts, accepted, self.q)
        return drafts, accepted

    def replay(self, launch: Any) -> torch.Tensor | None:
        """The drafts after ``launch`` (a :class:`~specloop.proposers.base.LaunchInputs` of this
        step), from one replay, setting its ``accepted`` and ``drafts_written``; None when no graph
        fits it (more requests than captured, or fewer rows prepared than the graph reads)."""
        n = len(launch.req_ids)
        if launch.device is not self.step or n > self.sizes[-1]:
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        if launch.rows < size:
            return None
        self.graphs[size].replay()
        self.num_replays += 1
        drafts, accepted = self.outputs[size]
        launch.accepted, launch.drafts_written = accepted[:n], True
        return drafts[:n]


def verification_shapes(config: Any, num_speculative_tokens: int) -> list[tuple[int, int]]:
    """``(q, requests)`` for every verification shape a launched proposal follows: ``q = 2 .. K + 1``
    rows per request, each for as many requests as the step's token budget allows."""
    budget = config.max_num_batched_tokens or config.max_num_seqs * (num_speculative_tokens + 1)
    return [(q, min(config.max_num_seqs, budget // q)) for q in range(2, num_speculative_tokens + 2) if budget >= q]


def capture_launches(propose: Callable[[torch.Tensor, int], torch.Tensor], config: Any, step: Any,
                     device: torch.device, num_speculative_tokens: int, what: str) -> dict[int, LaunchGraphs]:
    """:class:`LaunchGraphs` for every :func:`verification_shapes`, in one memory pool; none without
    the runner's ``step`` or off CUDA graphs (:func:`graphs_wanted`, no attention)."""
    if step is None or not graphs_wanted(config, device, None):
        return {}
    graphs: dict[int, LaunchGraphs] = {}
    pool = None
    for q, max_reqs in verification_shapes(config, num_speculative_tokens):
        graphs[q] = LaunchGraphs(propose, step, q, max_reqs, device, what, pool)
        graphs[q].capture()
        pool = graphs[q].pool
    return graphs


def warm_up_eager(fn: StepFn, device: torch.device, block_size: int, max_len: int,
                  rows: Sequence[int] = (1, 2, 8, 16, 48)) -> None:
    """``fn`` run eagerly once over one sequence for each of these row counts at a few context
    lengths up to ``max_len`` (1,024 at most), writing no KV (slot -1): the attention variants of
    the ragged rows a catch-up feeds (a tile height per row count; a split count per context
    length) are compiled at start-up rather than in the first step that needs them (most of a
    second each on a GPU). Nothing to compile off a GPU."""
    if device.type != "cuda":
        return
    for context in [c for c in (64, 384, 768) if c <= max_len] or [max_len]:
        for n in (r for r in rows if r <= context):
            table = [list(range(-(-context // block_size)))]
            meta = AttentionMetadata.build([0, n], [context], [-1] * n, table, device)
            with torch.inference_mode():
                fn(meta, torch.zeros(n, dtype=torch.int64, device=device),
                   torch.arange(context - n, context, device=device))


def last_pool(feeds: dict[int, StepGraphs]) -> object:
    """The memory pool the feed graphs were captured in (None if there are none). Graphs captured
    later in it never reuse the memory of the feeds' outputs, which stay referenced."""
    return feeds[max(feeds)].pool if feeds else None


def uniform_feed(feed_graphs: dict[int, StepGraphs], num_sampled: np.ndarray, query_start_loc: np.ndarray
                 ) -> StepGraphs | None:
    """The captured first step for a target step in which every request computed the same number
    ``q`` of rows and sampled (a decode or verification step, drafts padded to one count)."""
    if not feed_graphs or not len(num_sampled) or not (num_sampled > 0).all():
        return None
    sizes = np.diff(query_start_loc)
    graphs = feed_graphs.get(int(sizes[0]))
    if graphs is None or not (sizes == sizes[0]).all() or not graphs.fits(len(num_sampled)):
        return None
    return graphs


def feed_token_ids(token_ids: Sequence[np.ndarray], first: np.ndarray, q: int) -> np.ndarray:
    """``[n * q]``: for row ``j`` of request ``i`` (position ``first[i] + j``), the token after
    it; 0 past the request's known tokens (rows of rejected drafts, whose outputs nobody reads)."""
    ids = np.zeros((len(first), q), dtype=np.int64)
    offsets = np.arange(1, q + 1)
    for i, tokens in enumerate(token_ids):
        known = min(q, len(tokens) - 1 - int(first[i]))
        ids[i, :known] = tokens[first[i] + offsets[:known]]
    return ids.reshape(-1)


def graphs_wanted(config: object, device: torch.device, attn_backend: object) -> bool:
    """Whether a proposer should capture its steps: on CUDA, with the Triton attention backend (its
    kernels read only device tensors) or none (``attn_backend`` None: a proposer without
    attention), unless ``enforce_eager`` or the gpu runner's ``cuda_graphs`` option turns graphs
    off."""
    options = getattr(config, "plugin_options", {}).get("gpu", {})
    return (device.type == "cuda" and (attn_backend is None or getattr(attn_backend, "name", "") == "triton")
            and not getattr(config, "enforce_eager", False) and bool(options.get("cuda_graphs", True)))
