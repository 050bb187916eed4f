"""Greedy drafting on the device: a chain of one-token draft steps, and a whole proposal, as one
CUDA graph each.

:class:`ChainGraphs` captures drafts ``2 .. K`` of a head-like proposer (argmax of step ``j``
feeding step ``j + 1``, each step's positions, cache slots and context lengths computed on the
device by :func:`chain_steps`) once per padded request count. :class:`ProposalGraphs` puts a
uniform first step (:class:`proposers.step_graphs.StepGraphs` over ``q`` rows per request) and the
chain after it into one graph: after a decode or verification step the host copies the inputs in
once, replays once and reads all drafts once.

Graphs of one proposer share a memory pool. A replay may overwrite what was scratch memory when its
graph was captured, which includes the outputs of graphs captured later in the same pool; so a
chain is captured after the graphs whose outputs it reads, and an output is read before any
earlier-captured graph replays.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Callable, Sequence

import numpy as np
import torch

from specloop.models.attention import AttentionMetadata

from .base import DeviceStep, LaunchInputs
from .step_graphs import StepFn, StepGraphs, capture_sizes, graph_sizes


class ChainGraphs:
    """Greedy drafts ``2 .. K`` of a head-like proposer (its step reads the previous draft and its
    own previous output state) as ONE CUDA graph per padded request count: the ``K - 1`` steps,
    each step's positions, cache slots and context lengths computed on the device from the
    request's newest position and block table, each step's argmax and state feeding the next. A
    call copies two small tables in (positions and writable slots, block tables) and the first
    draft and its state, and replays once; the host reads all drafts with the first one.

    Every request drafts all ``K - 1`` steps; the caller keeps as many as the request may have.
    Positions past a request's blocks write no KV (slot -1), and positions past its limit but
    within its blocks hold entries past its tokens, which the next feed rewrites before anything
    reads them."""

    def __init__(self, fn: StepFn, device: torch.device, max_reqs: int, max_len: int, block_size: int,
                 num_steps: int, state: tuple[tuple[int, ...], torch.dtype], pool: object = None) -> None:
        self._fn = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
        self.device, self.block_size, self.max_len, self.num_steps = device, block_size, max_len, num_steps
        self.max_blocks = -(-max_len // block_size)
        self.sizes = graph_sizes(max_reqs)
        n = max(self.sizes)
        i64 = dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros(n, **i64)
        self.state = torch.zeros(n, *state[0], dtype=state[1], device=device)
        pinned = device.type == "cuda"
        # [newest position | writable slots (blocks x block size)], and block tables, in turn.
        self._host = [torch.zeros(2, n, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._host_tables = [torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=pinned)
                             for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._packed = torch.zeros(2, n, **i64)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [size, num_steps] drafts
        self.num_replays = 0
        self.pool = pool

    def chain(self, size: int) -> torch.Tensor:
        """The ``num_steps`` draft steps over the first ``size`` rows of the static inputs."""
        return chain_steps(self._fn(), self.num_steps, self.block_size, self.max_len, self.tokens[:size],
                           self.state[:size], self._packed[0, :size], self._packed[1, :size],
                           self.block_tables[:size], self.query_start_loc[:size + 1])

    def capture(self) -> None:
        # padding: position 0, nothing writable
        capture_sizes(self, lambda size: self._packed[:, :size].zero_(), self.chain,
                      f"{self.num_steps}-step draft chains")

    def fits(self, num_reqs: int) -> bool:
        return num_reqs <= self.sizes[-1]

    def run(self, tokens: torch.Tensor, state: torch.Tensor, newest: np.ndarray,
            block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Drafts ``2 .. K`` (``[n, K - 1]``, a view of a static buffer valid until the next call)
        of ``n`` requests whose first draft is ``tokens`` with output state ``state``, at position
        ``newest + 1`` onwards of the request whose blocks are ``block_ids[k]``."""
        n = len(block_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        turn = self._turn
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        host_t, tables_t = self._host[turn], self._host_tables[turn]
        host, tables = host_t.numpy(), tables_t.numpy()
        host[0, :n] = newest
        for k, blocks in enumerate(block_ids):
            if len(blocks) > self.max_blocks:
                raise RuntimeError(f"a request of {len(blocks)} KV blocks is past the draft graphs' {self.max_blocks}")
            tables[k, :len(blocks)] = blocks
            host[1, k] = len(blocks) * self.block_size
        host[:, n:size] = 0
        self._packed[:, :size].copy_(host_t[:, :size], non_blocking=True)
        self.block_tables[:n].copy_(tables_t[:n], non_blocking=True)
        if self.device.type == "cuda":
            event = self._copied[turn] = torch.cuda.Event()
            event.record()
        self.tokens[:n].copy_(tokens)
        self.state[:n].copy_(state)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:n]


def chain_steps(fn: StepFn, num_steps: int, block_size: int, max_len: int, tokens: torch.Tensor, state: torch.Tensor,
                newest: torch.Tensor, writable: torch.Tensor, block_tables: torch.Tensor,
                query_start_loc: torch.Tensor) -> torch.Tensor:
    """``num_steps`` greedy draft steps of ``fn`` (``fn(metadata, tokens, positions, state) ->
    (state, tokens)``), one token per request, all on the device: step ``j`` feeds position
    ``newest + j + 1`` and writes its KV where that position lies below ``writable`` (slot -1
    past it). Returns the drafts, ``[size, num_steps]``."""
    size, max_blocks = len(tokens), block_tables.shape[1]
    drafts = []
    for step in range(num_steps):
        pos = newest + (step + 1)
        block = block_tables.gather(1, (pos // block_size).clamp(max=max_blocks - 1)[:, None])[:, 0].long()
        meta = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=(pos + 1).to(torch.int32),
            slot_mapping=torch.where(pos < writable, block * block_size + pos % block_size, -1),
            block_tables=block_tables, max_query_len=1, max_seq_len=max_len,
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[max_len] * size)
        state, tokens = fn(meta, tokens, pos, state)
        drafts.append(tokens)
    return torch.stack(drafts, dim=1)


class ProposalGraphs(StepGraphs):
    """A head-like proposer's whole greedy proposal as one graph per request count: the first
    step over ``q`` rows per request (as :class:`StepGraphs`), then each request's output at its
    newest accepted row, that output's greedy token (``argmax``) and drafts ``2 .. K`` of
    :func:`chain_steps` (``step``). A call packs each request's accepted row count (from the host,
    or already on the device) with the feed's inputs and replays once; outputs are the first
    step's rows and the ``[n, K]`` drafts.

    Given ``source`` (the runner's :class:`~specloop.proposers.base.DeviceStep`), a second graph
    per request count takes every input from the verification step itself, at its fixed addresses:
    the accepted rows (computed in the graph, which writes each request's next token into its
    device token row), the target's tokens, positions, cache slots, context lengths and block
    tables, then the proposal, then the drafts into the token rows. A launch after such a step
    (:meth:`launch`) copies nothing in and launches nothing but the replay.

    ``selects``: the first step takes ``rows=`` (the newest accepted row of each request) and
    returns those rows' outputs alone, its other rows fed for their cache entries; the first output
    is then ``[n, H]``, a request's newest row."""

    ROWS = 5  # + per request: the rows it accepted, its writable slots

    def __init__(self, fn: StepFn, step: StepFn, argmax: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                 max_reqs: int, max_len: int, block_size: int, num_steps: int,
                 extra: Sequence[tuple[tuple[int, ...], torch.dtype]] = (), rows_per_req: int = 1,
                 pool: object = None, source: DeviceStep | None = None, selects: bool = False) -> None:
        super().__init__(fn, device, max_reqs, max_len, block_size, extra=extra, rows_per_req=rows_per_req, pool=pool)
        self.selects = selects
        self._step, self._argmax = weakref.WeakMethod(step), weakref.WeakMethod(argmax)
        self.num_steps = num_steps
        n = max(self.sizes)
        self.chain_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._first_rows = torch.arange(0, n * self.q, self.q, dtype=torch.int64, device=device)
        self.source = source if not extra else None  # extra per-row inputs come from the host
        self.device_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.device_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # drafts [size, K], accepted
        self.num_device_replays = 0

    host_fed = True  # also the graphs fed from the host's copies (``propose``)

    def capture(self) -> None:
        if self.host_fed:
            super().capture()
        if self.source is not None:
            capture_sizes(self, lambda size: None, self.device_forward,
                          f"proposals fed from the device after {self.q}-row verifications",
                          into=(self.device_graphs, self.device_outputs))

    def device_forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a device-fed graph runs: the bookkeeping and the proposal over the first ``size``
        request rows of ``source``. Returns the drafts and the accepted rows."""
        src, q, rows = self.source, self.q, size * self.q
        accepted = src.accept_rows(size, q)
        self.token_ids[:rows].copy_(src.top[:rows])
        self._packed[0, :rows].copy_(src.positions[:rows])
        self._packed[1, :rows].copy_(src.slot_mapping[:rows])
        self._packed[3, :size].copy_(accepted)
        self._packed[4, :size].copy_(src.writable(size))
        self.seq_lens[:size].copy_(src.seq_lens[:size])
        width = min(self.max_blocks, src.block_tables.shape[1])
        self.block_tables[:size, :width].copy_(src.block_tables[:size, :width])
        drafts = self.forward(size)[1]
        src.write_row_drafts(drafts, accepted, q)
        return drafts, accepted

    def launch(self, step: LaunchInputs) -> torch.Tensor:
        """The drafts (``[n, K]`` on the device, valid until the next call) after ``step``: from
        the device-fed graph when ``step`` is ``source``'s and prepared at least as many request rows
        as that graph reads (its drafts then written, ``step.drafts_written``), else from the host's
        copies (:meth:`propose`)."""
        drafts = self.replay_device(step)
        if drafts is not None:
            return drafts
        return self.propose(step.target_tokens, step.first, step.block_ids, step.accept())[1][:len(step.req_ids)]

    def replay_device(self, step: LaunchInputs) -> torch.Tensor | None:
        """The drafts after ``step`` from the device-fed graph, if it applies (as :meth:`launch`)."""
        n = len(step.req_ids)
        if not self.fits(n):
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        graph = self.device_graphs.get(size)
        if graph is None or step.device is not self.source or step.rows < size:
            return None
        graph.replay()
        self.num_replays += 1
        self.num_device_replays += 1
        drafts, accepted = self.device_outputs[size]
        step.accepted, step.drafts_written = accepted[:n], True
        return drafts[:n]

    def forward(self, size: int) -> tuple[torch.Tensor, ...]:
        accepted, writable = self._packed[3:5, :size]
        newest_rows = self._first_rows[:size] + accepted - 1
        if self.selects:
            out = super().forward(size, rows=newest_rows)[0]
            state = out.clone()  # a step may update its input state in place (a fused residual add)
        else:
            out = super().forward(size)[0]
            state = out.index_select(0, newest_rows)
        newest = self._packed[0, :size * self.q:self.q] + accepted - 1  # first row's position + accepted - 1
        first = self._argmax()(state)
        if not self.num_steps:
            return out, first[:, None]
        rest = chain_steps(self._step(), self.num_steps, self.block_size, self.max_len, first, state, newest,
                           writable, self.block_tables[:size], self.chain_start_loc[:size + 1])
        return out, torch.cat([first[:, None], rest], dim=1)

    def _fill_padding(self, start: int, end: int) -> None:
        super()._fill_padding(start, end)
        self._packed[3, start:end].fill_(1)  # its first row, position 0
        self._packed[4, start:end].fill_(0)  # nothing writable

    def propose(self, token_ids: torch.Tensor, first: np.ndarray, block_ids: Sequence[Sequence[int]],
                accepted: np.ndarray | torch.Tensor, *extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`StepGraphs.run`, request ``k`` having accepted ``accepted[k]`` of its ``q``
        rows (so its newest position is ``first[k] + accepted[k] - 1``; a host array, or a tensor on
        the device). Returns the first step's outputs and the drafts (views of static buffers,
        padded, valid until the next call)."""
        writable = np.array([len(b) for b in block_ids], dtype=np.int64) * self.block_size
        return self.run(token_ids, first, block_ids, *extra, more=(accepted, writable))


def launchable(graphs_on: bool, feeds: dict[int, StepGraphs], num_reqs: int, q: int) -> ProposalGraphs | None:
    """The whole-proposal graph a launch after a uniform verification of ``q`` rows per request
    replays, if there is one for that shape."""
    feed = feeds.get(q) if graphs_on else None
    return feed if isinstance(feed, ProposalGraphs) and feed.fits(num_reqs) else None


def greedy_graphed(graphs_on: bool, chain: ChainGraphs | None, limits: np.ndarray) -> bool:
    """Whether greedy drafts up to ``limits`` (the live requests') come from graphs: the first
    needs none of the chain's, the rest need a chain that fits."""
    if not graphs_on:
        return False
    return int(limits.max()) <= 1 or (chain is not None and chain.fits(len(limits)))


def greedy_drafts(chain: ChainGraphs | None, live: list[int], limits: np.ndarray, newest: np.ndarray,
                  block_ids: Sequence[Sequence[int]], state: torch.Tensor, tokens: torch.Tensor,
                  drafts: list[list[int]]) -> None:
    """Append each live request's greedy drafts (up to ``limits[i]``): the first, ``tokens``
    (from output state ``state``), and the rest from ``chain``; one device-to-host read."""
    if chain is not None and int(limits[live].max()) > 1:
        rest = chain.run(tokens, state, newest[live], [block_ids[i] for i in live])
        # ``tokens`` may be another graph's output in a pool the chain's replay reuses: read the
        # chain's own copy of it.
        tokens = torch.cat([chain.tokens[:len(live), None], rest], dim=1)
    take_drafts(tokens.view(len(live), -1).tolist(), live, limits, drafts)


def take_drafts(rows: list[list[int]], live: list[int], limits: np.ndarray, drafts: list[list[int]]) -> None:
    """Append ``rows[k]`` to live request ``live[k]``'s drafts, up to its limit."""
    for i, row in zip(live, rows):
        drafts[i].extend(row[:int(limits[i])])


def capture_feeds(fn: StepFn, config: object, device: torch.device, max_len: int, block_size: int,
                  num_speculative_tokens: int, extra: Sequence[tuple[tuple[int, ...], torch.dtype]],
                  pool: object = None, step: StepFn | None = None,
                  argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  source: DeviceStep | None = None, selects: bool = False) -> dict[int, StepGraphs]:
    """The first-step graphs of a head-like proposer, by rows per request: ``q = 1 .. K + 1`` (one
    plus the padded draft count of a decode or verification step), each for as many requests as
    the step's token budget allows, all in one memory pool. Given ``step`` and ``argmax`` they are
    :class:`ProposalGraphs`, the whole greedy proposal in each (fed from ``source`` too after a
    verification, ``q >= 2``; ``selects``: as :class:`ProposalGraphs` takes it)."""
    max_reqs = config.max_num_seqs
    budget = config.max_num_batched_tokens or max_reqs * (num_speculative_tokens + 1)
    feeds: dict[int, StepGraphs] = {}
    for q in range(1, num_speculative_tokens + 2):
        if budget // q < 1:
            break
        common = dict(extra=extra, rows_per_req=q, pool=pool)
        if step is not None and argmax is not None:
            graphs = ProposalGraphs(fn, step, argmax, device, min(max_reqs, budget // q), max_len, block_size,
                                    num_speculative_tokens - 1, source=source if q > 1 else None, selects=selects,
                                    **common)
        else:
            graphs = StepGraphs(fn, device, min(max_reqs, budget // q), max_len, block_size, **common)
        graphs.capture()
        pool = graphs.pool
        feeds[q] = graphs
    return feeds
