"""The target's hidden states, recorded by KV slot, and how far each request's draft cache is fed.

EAGLE's head and MTP's layers build their own KV caches over the target's positions, and the entry
at position ``p`` needs only the target's state at ``p`` and the token after it. So such a proposer
records the states inside the target's forward (``Proposer.record``: device work only, captured in
the target's CUDA graphs), one row per KV slot of the target's block pool (``H`` values a token,
sized into the pool with the proposer's cache), and feeds its cache lazily: a proposal first feeds
each request every position its cache lacks below the newest token. In a run of steps with drafts
that is exactly the step's rows; after steps the policy drafted nothing for (the proposer was not
called: ``skip``), those steps' positions too; for a new request its whole sequence, prefix-cache
hits included (a cached block's record is the target's, written when it computed the block; the
runner has the last block of a hit recomputed, so that a shared block's entries pair each position
with the same next token for every request, and feeding one again writes what it holds). The
positions before a step's rows are fed first (``fill_gaps``, one eager forward), so that the step's
own rows still replay the proposer's graph, or launch from the device.

:class:`Recorded` keeps the record and, per request, how far the cache is fed: exactly, after a
proposal on the host; after a proposal launched from the device (whose accepted count the host has
not read) up to the next step's first row, if no step was skipped since, else up to the launched
step's first row (re-feeding a position rewrites the same entry).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

EXACT = -1  # a fed count the host knows
# A proposer's catch-up: (inputs, first positions, ends, request indices) -> outputs at the ends.
CatchUp = Callable[[Any, np.ndarray, np.ndarray, np.ndarray], torch.Tensor]


class Recorded:
    def __init__(self, width: int, dtype: torch.dtype, device: torch.device, max_rows: int) -> None:
        self.width, self.dtype, self.device = width, dtype, device
        self.max_rows = max_rows  # rows per catch-up forward at most
        self.states = torch.empty(0, width, dtype=dtype, device=device)
        # Per request: (positions fed, EXACT), or (launched step's first position + 1, skips then).
        self.fed: dict[str, tuple[int, int]] = {}
        self.skips = 0
        # The last launch (request ids, first positions, skips then), put into ``fed`` only when
        # asked about anything else: a run of launches for the same requests costs no per-request work.
        self._launch: tuple[list[str], Sequence[int], int] | None = None

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.width * self.dtype.itemsize

    def allocate(self, num_slots: int) -> None:
        """One row per slot, and a last row that padding rows (slot -1) write and read."""
        self.states = torch.zeros(num_slots + 1, self.width, dtype=self.dtype, device=self.device)
        self.fed.clear()
        self._launch = None

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        slots = slots.to(torch.int64)
        return torch.where(slots >= 0, slots, self.states.shape[0] - 1)

    def write(self, states: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        rows = min(len(states), len(slot_mapping))
        self.states.index_copy_(0, self._rows(slot_mapping[:rows]), states[:rows].to(self.dtype))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self.states[self._rows(slots)]

    def read_positions(self, block_ids: Sequence[Sequence[int]], pieces: Sequence[tuple[int, int, int]],
                       block_size: int) -> torch.Tensor:
        """The states at positions ``s .. e - 1`` of request ``i`` for each piece ``(i, s, e)``, packed."""
        slots = np.concatenate([np.asarray(block_ids[i], dtype=np.int64)[np.arange(s, e) // block_size] * block_size
                                + np.arange(s, e) % block_size for i, s, e in pieces])
        return self.read(torch.as_tensor(slots, device=self.device))

    # --- how far each request is fed ------------------------------------------------------------------

    def skip(self) -> None:
        self.skips += 1

    def _settle(self) -> None:
        if self._launch is not None:
            req_ids, first, skips = self._launch
            self._launch = None
            self.fed.update(zip(req_ids, ((int(f) + 1, skips) for f in first)))

    def forget(self, req_ids: Iterable[str]) -> None:
        self._settle()
        for rid in req_ids:
            self.fed.pop(rid, None)

    def valid(self, rid: str, first: int) -> int:
        """Positions of request ``rid`` its cache holds, for a step whose rows start at ``first``."""
        self._settle()
        fed, skips = self.fed.get(rid, (0, EXACT))
        return first if skips == self.skips else fed

    def fill_gaps(self, inputs: Any, first: Sequence[int], catch_up: CatchUp) -> bool:
        """Feed each request of ``inputs`` (``req_ids``, ``token_ids``, ``block_ids``) the positions
        its cache lacks before its step's first row (those of steps it skipped) with ``catch_up``,
        so that the step's own rows can follow in one graph. False, feeding nothing, when a token
        they pair with is not on the host yet (a placeholder)."""
        if self._launch is not None and self._launch[2] == self.skips and self._launch[0] == inputs.req_ids:
            return True  # the same requests launched last, nothing skipped since
        start = np.array([self.valid(rid, f) for rid, f in zip(inputs.req_ids, first)], dtype=np.int64)
        end = np.asarray(first, dtype=np.int64)
        lacking = np.nonzero(start < end)[0]
        if not len(lacking):
            return True
        if any(min(inputs.token_ids[i][start[i] + 1:end[i] + 1]) < 0 for i in lacking):
            return False
        catch_up(inputs, start[lacking], end[lacking], lacking)
        self.fed_to([inputs.req_ids[i] for i in lacking], end[lacking])
        return True

    def fed_to(self, req_ids: Sequence[str], newest: Iterable[int]) -> None:
        """Fed below each request's newest token (a proposal on the host)."""
        self._settle()
        self.fed.update(zip(req_ids, ((int(m), EXACT) for m in newest)))

    def launched(self, req_ids: Sequence[str], first: Iterable[int]) -> None:
        """Fed below the newest token of a step whose rows start at ``first``, as yet unknown."""
        if self._launch is None or self._launch[0] != req_ids:  # else the new launch covers the last
            self._settle()
        self._launch = (list(req_ids), first, self.skips)

    def pieces(self, start: np.ndarray, end: np.ndarray) -> Iterator[list[tuple[int, int, int]]]:
        """Request ``i``'s positions ``start[i] .. end[i] - 1`` (at least the last) as groups of
        pieces ``(i, s, e)`` of at most ``max_rows`` rows each, a long run cut into pieces in
        order, so that one forward per group feeds them all."""
        cap = self.max_rows
        pieces: list[tuple[int, int, int]] = []
        for i, (s, e) in enumerate(zip(start.tolist(), end.tolist())):
            s = min(s, e - 1)
            while e - s > cap:
                pieces.append((i, s, s + cap))
                s += cap
            pieces.append((i, s, e))
        group: list[tuple[int, int, int]] = []
        rows = 0
        for i, s, e in pieces:
            if group and rows + e - s > cap:
                yield group
                group, rows = [], 0
            group.append((i, s, e))
            rows += e - s
        if group:
            yield group
