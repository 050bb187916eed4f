"""How far a recording proposer's cache is fed (``proposers.recorded``): exact after a proposal on
the host, up to the next step's rows after a launch, conservative once a step was skipped; the
gaps it feeds before a step's rows; the record itself; the catch-up's pieces."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from specloop.proposers.recorded import Recorded


def recorded(max_rows: int = 8) -> Recorded:
    r = Recorded(4, torch.float32, torch.device("cpu"), max_rows)
    r.allocate(64)
    return r


def test_fed_counts_through_proposals_launches_and_skips() -> None:
    r = recorded()
    r.fed_to(["a", "b"], [10, 7])  # a host proposal: fed below each newest token
    assert (r.valid("a", 10), r.valid("b", 7), r.valid("new", 5)) == (10, 7, 0)
    r.launched(["a", "b"], [10, 7])  # launched from rows at 10 and 7; accepted counts unknown
    assert r.valid("a", 13) == 13  # the next step's rows start at the newest token: exact
    r.launched(["a", "b"], [13, 9])
    r.skip()  # a step the proposer did not see: only each launched step's first row is sure
    assert (r.valid("a", 20), r.valid("b", 15)) == (14, 10)
    r.forget(["a"])
    assert (r.valid("a", 20), r.valid("b", 15)) == (0, 10)


def test_gaps_before_a_steps_rows_are_fed_once_and_never_with_a_placeholder() -> None:
    r = recorded()
    calls = []

    def catch_up(inputs, start, end, reqs):
        calls.append((start.tolist(), end.tolist(), reqs.tolist()))

    tokens = [list(range(40)), list(range(40))]
    inputs = SimpleNamespace(req_ids=["a", "b"], token_ids=tokens, block_ids=[[0, 1, 2], [3, 4, 5]])
    r.fed_to(["a", "b"], [12, 20])
    r.launched(["a", "b"], [12, 20])
    assert r.fill_gaps(inputs, [15, 22], catch_up) and calls == []  # launched last, nothing skipped
    r.skip()
    tokens[1][22] = -1  # the token after position 21, which b lacks, is still on the device
    assert not r.fill_gaps(inputs, [16, 23], catch_up) and calls == []
    tokens[1][22] = 22
    assert r.fill_gaps(inputs, [16, 23], catch_up)
    assert calls == [([13, 21], [16, 23], [0, 1])]  # from each launched step's first row + 1
    assert (r.valid("a", 16), r.valid("b", 23)) == (16, 23)
    assert r.fill_gaps(inputs, [16, 23], catch_up) and len(calls) == 1


def test_the_record_is_read_back_by_slot_and_padding_rows_write_their_own_row() -> None:
    r = recorded()
    states = torch.arange(12, dtype=torch.float32).view(3, 4)
    r.write(states, torch.tensor([5, -1, 9]))
    assert torch.equal(r.read(torch.tensor([9, 5])), states[[2, 0]])
    assert torch.equal(r.read(torch.tensor([-1])), states[[1]])  # the padding row, never a real slot
    # Positions 1 and 2 of a request whose blocks (size 4) are [1, 2]: slots 5 and 6.
    assert torch.equal(r.read_positions([[1, 2]], [(0, 1, 3)], 4)[0], states[0])


def test_catch_up_pieces_cover_every_position_in_order_within_max_rows() -> None:
    r = recorded(max_rows=8)
    start, end = np.array([0, 30, 5]), np.array([20, 31, 5])  # the last has nothing new: its last row
    groups = list(r.pieces(start, end))
    assert all(sum(e - s for _, s, e in g) <= 8 for g in groups)
    assert all(len({k for k, _, _ in g}) == len(g) for g in groups)  # a request once per forward
    fed: dict[int, list[int]] = {}
    for g in groups:
        for k, s, e in g:
            fed.setdefault(k, []).extend(range(s, e))
    assert fed == {0: list(range(20)), 1: [30], 2: [4]}
