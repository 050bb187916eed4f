"""The GPU-resident persistent batch: request state that lives on the device across steps, and one
step's inputs built from it with O(requests) host work.

Per request *slot* the device keeps the token ids (prompt, committed output, then drafts), the block
table and the sampling parameters the fast sampler reads. They change incrementally: a new request
writes its tokens and blocks once; a running one appends only what the device lacks (new blocks,
tokens it did not sample itself, drafts proposed on the host). The GPU runner writes each sampled
token straight into the token row, and a proposal launched on the device its drafts, so a plain
decode step sends no token ids at all, and a verification only the tokens it accepted.

Each step the host fills one pinned int32 buffer, ``[req_slots | starts | qsl | seq_lens |
sample_req_rows | logits_indices | write_at | lagged]``, and copies it to the device in one
transfer; the ``prepare_inputs`` kernel then writes the packed ``input_ids``, ``positions`` and
``slot_mapping``. A request ``lagged`` in a step planned before its last verification's outcome
reached the host is pulled back there by its slot's rejected count (``lag``, written on the device
by that verification's :meth:`accept`). All step tensors have fixed addresses, so CUDA graphs
captured on them replay on the live values; rows past the live batch are padding a graph may
read (no owner, no KV write). ``write_at`` is where a decode graph that samples stores each row's
token (a flat index into the token rows; rows that sample nothing, and padding, point at the spare
slot ``max_reqs``, which no request owns).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from specloop.kernel.outputs import SchedulerOutput
from specloop.kernel.sampling_params import SamplingParams
from specloop.kernels import verify
from specloop.kernels.prepare_inputs import prepare_inputs

from ..batch import BatchLayout, InputBatch
from ..requests import PLACEHOLDER, CachedRequestState, PlanChanges
from .triton_attention import GpuAttentionMetadata


def send(values: Sequence[float] | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values on ``device``, through pinned memory and without blocking: under asynchronous
    scheduling a forward is still running when a step's inputs are sent, and a copy from pageable
    memory waits for the stream, so the host would idle until that forward ends."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def plain_sampling(params: SamplingParams) -> bool:
    """Whether the fast sampler (temperature, min-p, seed only) reproduces the reference sampler for
    this request; anything else goes through the full path."""
    return (params.top_k == 0 and params.top_p == 1.0 and params.repetition_penalty == 1.0
            and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0 and not params.logit_bias
            and params.min_tokens == 0 and params.logprobs is None and params.prompt_logprobs is None
            and params.allowed_token_ids is None and not params.bad_words_token_ids)


class PersistentBatch:
    """Device buffers for up to ``max_reqs`` live requests and one step of ``max_tokens`` tokens."""

    def __init__(self, max_reqs: int, max_len: int, block_size: int, max_tokens: int, device: torch.device) -> None:
        self.max_reqs, self.max_len, self.block_size, self.max_tokens = max_reqs, max_len, block_size, max_tokens
        self.device = device
        self.max_blocks = -(-max_len // block_size)
        if (max_reqs + 1) * max_len >= 1 << 31:
            raise ValueError(f"{max_reqs} requests of {max_len} tokens do not fit the device batch's int32 indices")
        i32 = dict(dtype=torch.int32, device=device)
        # --- per slot, persistent (slot max_reqs: the spare one, for writes that go nowhere) ---
        self.spare = max_reqs
        self.tokens = torch.zeros(max_reqs + 1, max_len, **i32)
        self.block_table = torch.zeros(max_reqs + 1, self.max_blocks, **i32)
        self.temperature = torch.zeros(max_reqs + 1, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(max_reqs + 1, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(max_reqs + 1, dtype=torch.int64, device=device)
        self.lag = torch.zeros(max_reqs + 1, **i32)  # drafts the slot's last launched verification rejected
        self.num_blocks = torch.zeros(max_reqs + 1, **i32)  # block-table entries the slot's request holds
        # --- host bookkeeping (set by add/remove/update) ---
        self.slots: dict[str, int] = {}
        self._free = list(range(max_reqs - 1, -1, -1))
        self.device_len: dict[str, int] = {}  # leading token positions valid on the device
        self.device_blocks: dict[str, int] = {}  # leading block-table entries valid on the device
        self.plain: dict[str, bool] = {}
        self.with_min_p: set[str] = set()  # requests sampling with min-p (the graphs' draw has none)
        self.draws_in_graph = False  # set by a graph executor whose decode graphs draw (``write_at``)
        self._token_writes: list[tuple[int, int, list[int]]] = []
        self._block_writes: list[tuple[int, int, list[int]]] = []
        self._param_writes: list[tuple[int, float, float, int]] = []
        # --- one step, at fixed addresses ---
        self._off = np.cumsum([0, max_reqs, max_reqs, max_reqs + 1, max_reqs, max_tokens, max_tokens, max_reqs,
                               max_reqs])
        pinned = device.type == "cuda"
        self._host = torch.zeros(int(self._off[-1]), dtype=torch.int32, pin_memory=pinned)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(int(self._off[-1]), **i32)
        self.req_slots, self.starts, self.query_start_loc, self.seq_lens, self.sample_req_rows, \
            self.logits_indices, self.write_at, self.lagged = (self._dev[self._off[k]:self._off[k + 1]]
                                                               for k in range(8))
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.top = torch.zeros(max_tokens, dtype=torch.int64, device=device)  # a verification's argmax per row
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_reqs, self.max_blocks, **i32)

    # --- request lifecycle ----------------------------------------------------------------------

    def update(self, changes: PlanChanges) -> None:
        """Mirror the runner's request table after a plan was applied to it."""
        for rid in changes.removed:
            self.remove(rid)
        for state in changes.added:
            self.add(state)
        for state in changes.updated:
            self.update_running(state)

    def add(self, state: CachedRequestState) -> None:
        """A new or resumed request: all its tokens, its block table and sampling parameters."""
        if state.req_id in self.slots:
            self.remove(state.req_id)
        if not self._free:
            raise RuntimeError(f"more than {self.max_reqs} live requests (max_num_seqs)")
        if len(state.token_ids) > self.max_len:
            raise ValueError(f"request {state.req_id!r} has {len(state.token_ids)} tokens, more than "
                             f"the {self.max_len} the device batch holds")
        slot = self._free.pop()
        rid = state.req_id
        self.slots[rid] = slot
        self._token_writes.append((slot, 0, state.token_ids))
        self._block_writes.append((slot, 0, state.block_ids))
        self.device_len[rid] = len(state.token_ids)
        self.device_blocks[rid] = len(state.block_ids)
        params = state.sampling_params
        self._param_writes.append((slot, 0.0 if params.greedy else params.temperature, params.min_p, state.seed))
        self.plain[rid] = plain_sampling(params)
        if params.min_p > 0:
            self.with_min_p.add(rid)

    def remove(self, req_id: str) -> None:
        slot = self.slots.pop(req_id, None)
        if slot is None:
            return
        self._free.append(slot)
        for d in (self.device_len, self.device_blocks, self.plain):
            d.pop(req_id, None)
        self.with_min_p.discard(req_id)

    def update_running(self, state: CachedRequestState) -> None:
        """A running request after the plan was applied to ``state``: send the device the tokens it
        lacks (those sampled on the host) and the new blocks. Tokens the fast sampler wrote on the
        device are never sent, so their host copies may still be placeholders."""
        rid = state.req_id
        slot = self.slots[rid]
        have = min(self.device_len[rid], len(state.token_ids))
        if have < len(state.token_ids):
            self._token_writes.append((slot, have, state.token_ids[have:]))
        self.device_len[rid] = len(state.token_ids)
        nb = self.device_blocks[rid]
        if nb < len(state.block_ids):
            self._block_writes.append((slot, nb, state.block_ids[nb:]))
            self.device_blocks[rid] = len(state.block_ids)

    def flush_writes(self) -> None:
        """Apply the staged token, block-table and parameter writes (one transfer each)."""
        for writes, target in ((self._token_writes, self.tokens), (self._block_writes, self.block_table)):
            if not writes:
                continue
            # Whole-step arrays from a few calls, not three small ones per request.
            n = len(writes)
            lens = np.fromiter((len(v) for _, _, v in writes), dtype=np.int64, count=n)
            total = int(lens.sum())
            rows = np.repeat(np.fromiter((s for s, _, _ in writes), dtype=np.int64, count=n), lens)
            starts = np.fromiter((c for _, c, _ in writes), dtype=np.int64, count=n)
            cols = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
            vals = np.fromiter(chain.from_iterable(v for _, _, v in writes), dtype=np.int32, count=total)
            if cols.size and int(cols.max()) >= target.shape[1]:
                raise ValueError(f"a request outgrew the device batch ({int(cols.max()) + 1} > {target.shape[1]})")
            flat = send(rows * target.shape[1] + cols, torch.int64, self.device)
            target.view(-1).index_copy_(0, flat, send(vals, torch.int32, self.device))
            if target is self.block_table:  # each slot's count after its last write
                counts = {slot: start + len(ids) for slot, start, ids in writes}
                self.num_blocks.index_copy_(0, send(list(counts), torch.int64, self.device),
                                            send(list(counts.values()), torch.int32, self.device))
            writes.clear()
        if self._param_writes:
            slots, temps, min_ps, seeds = zip(*self._param_writes)
            index = send(slots, torch.int64, self.device)
            self.temperature.index_copy_(0, index, send(temps, torch.float32, self.device))
            self.min_p.index_copy_(0, index, send(min_ps, torch.float32, self.device))
            self.seeds.index_copy_(0, index, send(seeds, torch.int64, self.device))
            self._param_writes.clear()

    # --- one step -------------------------------------------------------------------------------

    def prepare(self, plan: SchedulerOutput, requests: dict[str, CachedRequestState], pad_to: int | None = None,
                num_splits: int = 0, lagged: Sequence[int] = ()) -> InputBatch:
        """The step's :class:`InputBatch`. With ``pad_to``, batch rows up to it are padding for a
        CUDA graph of that many requests. ``lagged``: the batch rows the device pulls back by their
        rejected count (module docstring); the host's layout keeps the plan's values until the
        runner learns the counts."""
        lay = BatchLayout.from_plan(plan, requests, self.block_size)
        num_reqs = len(lay.req_ids)
        slots = [self.slots[rid] for rid in lay.req_ids]
        for slot, rid, spec in zip(slots, lay.req_ids, lay.specs):
            if spec and spec[0] != PLACEHOLDER:  # placeholders: drafts the device wrote itself
                self._token_writes.append((slot, len(requests[rid].token_ids), spec))
        self.flush_writes()
        num_tokens = lay.num_tokens
        rows = pad_to or num_reqs
        if num_tokens > self.max_tokens or rows > self.max_reqs:
            raise ValueError(f"step of {num_tokens} tokens / {rows} requests exceeds the device batch "
                             f"({self.max_tokens} / {self.max_reqs})")
        host, off = self._host_np, self._off
        host[off[0]:off[0] + num_reqs] = slots
        host[off[0] + num_reqs:off[0] + rows] = self.spare  # padding rows' writes go nowhere
        host[off[1]:off[1] + num_reqs] = lay.starts
        host[off[2]:off[2] + num_reqs + 1] = lay.query_start_loc
        host[off[2] + num_reqs + 1:off[2] + rows + 1] = num_tokens  # padding requests own no tokens
        host[off[3]:off[3] + num_reqs] = lay.seq_lens
        host[off[3] + num_reqs:off[3] + rows] = 0
        host[off[4]:off[4] + len(lay.sample_req_rows)] = lay.sample_req_rows
        host[off[5]:off[5] + len(lay.token_rows)] = lay.token_rows
        draws = self.draws_in_graph and pad_to and lay.max_query_len == 1
        if draws:  # where a decode graph puts each row's token
            samples = np.fromiter((count == 1 for _, count in lay.sample_rows), dtype=bool, count=num_reqs)
            at = host[off[6]:off[6] + rows]
            at[:] = self.spare * self.max_len
            at[:num_reqs][samples] = (np.asarray(slots, dtype=np.int64)[samples] * self.max_len
                                      + np.asarray(lay.seq_lens, dtype=np.int64)[samples])
        if lagged:
            flags = host[off[7]:off[7] + num_reqs]
            flags[:] = 0
            flags[list(lagged)] = 1
        self._dev[:off[7] + (num_reqs if lagged else 0)].copy_(self._host[:off[7] + (num_reqs if lagged else 0)],
                                                               non_blocking=True)
        torch.index_select(self.block_table, 0, self.req_slots[:num_reqs], out=self.block_tables[:num_reqs])
        if pad_to:
            self.slot_mapping[num_tokens:].fill_(-1)
        lag = dict(lag=self.lag, lagged=self.lagged[:num_reqs], seq_lens=self.seq_lens[:num_reqs],
                   write_at=self.write_at[:num_reqs] if draws else None) if lagged else {}
        prepare_inputs(self.tokens, self.block_table, self.req_slots[:num_reqs], self.starts[:num_reqs],
                       self.query_start_loc[:num_reqs + 1], self.block_size,
                       self.input_ids, self.positions, self.slot_mapping, **lag)
        meta = GpuAttentionMetadata(
            query_start_loc=self.query_start_loc[:num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_reqs],
            max_query_len=lay.max_query_len,
            max_seq_len=max(lay.seq_lens, default=0),
            query_start_loc_cpu=lay.query_start_loc,
            seq_lens_cpu=lay.seq_lens,
            num_splits=num_splits,
        )
        return InputBatch(lay, self.input_ids[:num_tokens], self.positions[:num_tokens], meta,
                          self.logits_indices[:len(lay.token_rows)], lagged=list(lagged), rows=rows)

    def write_sampled(self, tokens: torch.Tensor) -> None:
        """Store the tokens just sampled, one per entry of ``sample_req_rows``, into their requests'
        token rows at the next position (device to device; the host learns them later)."""
        rows = self.sample_req_rows[:tokens.shape[0]].long()
        slots = self.req_slots.index_select(0, rows).long()
        pos = self.seq_lens.index_select(0, rows).long()
        self.tokens.view(-1).index_copy_(0, slots * self.max_len + pos, tokens.to(torch.int32))

    def accept(self, input_ids: torch.Tensor, top: torch.Tensor, positions: torch.Tensor, q: int) -> torch.Tensor:
        """A uniform greedy verification of the step's first ``n = len(top) // q`` requests, ``q``
        rows each (``input_ids``, ``positions``: the step's), against the target's tokens ``top``:
        the rows each accepted (``[n]``, on the device). Writes each request's own next token after
        them into its token row and the drafts it rejected into ``lag`` (``kernels.verify``)."""
        n = top.shape[0] // q
        return verify.accept(input_ids, top, positions, q, self.req_slots[:n], self.tokens, self.lag)

    def write_drafts(self, drafts: torch.Tensor, accepted: torch.Tensor, positions: torch.Tensor, q: int) -> None:
        """Drafts proposed on the device after :meth:`accept` (``[n, K]``) into the token rows
        after each request's next token: the next step reads them there, so the host sends none
        (its copies are placeholders until it reads them)."""
        verify.write_drafts(drafts, accepted, positions, q, self.req_slots, self.tokens)

    # --- a launched proposal's graph (proposers.base.DeviceStep): the step's first ``size`` rows ---

    def accept_rows(self, size: int, q: int) -> torch.Tensor:
        """:meth:`accept` over the step's first ``size`` request rows (padding included) against
        ``top``, where the sampler or the verification graph put the target's tokens."""
        rows = size * q
        return self.accept(self.input_ids[:rows], self.top[:rows], self.positions[:rows], q)

    def writable(self, size: int) -> torch.Tensor:
        """Positions the blocks of each of the first ``size`` request rows hold (int64; 0 for
        padding)."""
        return self.num_blocks.index_select(0, self.req_slots[:size]).long() * self.block_size

    def write_row_drafts(self, drafts: torch.Tensor, accepted: torch.Tensor, q: int) -> None:
        """:meth:`write_drafts` for the first ``len(drafts)`` request rows."""
        self.write_drafts(drafts, accepted, self.positions[:drafts.shape[0] * q], q)

    def mark_sampled(self, req_id: str, position: int) -> None:
        """The token at ``position`` was written on the device by :meth:`write_sampled`."""
        self.device_len[req_id] = position + 1

    def mark_on_device(self, req_id: str, length: int) -> None:
        """The request's first ``length`` tokens (placeholders or not) are on the device."""
        if req_id in self.device_len:
            self.device_len[req_id] = length
