"""One request's stop strings as an Aho-Corasick automaton, so that matching costs the same per
character of output whatever the stop strings' lengths.

A state is a node of the trie of the stop strings: the longest tail of the text read so far that is
a prefix of some stop string. From it, in O(1):

* ``held(state)``: the longest tail of the text that is a *proper* prefix of some stop string
  (what the detokenizer holds back, since the next token may complete it);
* the longest stop string that ends the text (the one that starts earliest among those ending here).

Reading a character follows at most one trie edge and some failure links; every failure link
shortens the state, which grew by at most one per character, so a completion's whole output costs
O(its length) transitions (amortised O(1) per character). Building costs O(total length of the stop
strings); the automaton is immutable and shared by the completions of a request, each keeping its
own state in a :class:`StopScanner`.
"""

from __future__ import annotations

from array import array
from typing import Sequence

# Edges live in one dict keyed by ``node * _EDGE_BASE + ord(char)``: far smaller than a dict per node.
_EDGE_BASE = 0x110000


class StopStrings:
    """The automaton over ``stops`` (non-empty strings; the earlier one wins a tie)."""

    __slots__ = ("stops", "_edges", "_fail", "_held", "_match")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        # Plain arrays and one dict: no container per node, so building leaves the garbage collector
        # nothing to traverse however long the stop strings are.
        edges: dict[int, int] = {}
        depth, parent, code = array("i", [0]), array("i", [0]), array("i", [0])
        ends = array("i", [-1])  # the stop string that ends at a node (the first listed)
        has_child = bytearray(1)
        for index, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                key = node * _EDGE_BASE + ord(ch)
                nxt = edges.get(key)
                if nxt is None:
                    nxt = edges[key] = len(depth)
                    depth.append(depth[node] + 1)
                    parent.append(node)
                    code.append(ord(ch))
                    ends.append(-1)
                    has_child.append(0)
                    has_child[node] = 1
                node = nxt
            if ends[node] < 0:
                ends[node] = index
        size = len(depth)
        fail = array("i", bytes(4 * size))
        held = array("i", bytes(4 * size))
        match = array("i", [-1]) * size
        # Shallower nodes first, so that a node's failure link (a shallower node) is complete before
        # it: a counting sort by depth, in Python steps that let other threads run (a C sort of a
        # million nodes would hold the GIL for a third of a second).
        starts = array("i", bytes(4 * (max(depth) + 2)))
        for d in depth:
            starts[d + 1] += 1
        for d in range(1, len(starts)):
            starts[d] += starts[d - 1]
        order = array("i", bytes(4 * size))
        for node, d in enumerate(depth):
            order[starts[d]] = node
            starts[d] += 1
        for node in order:
            f = fail[parent[node]] if parent[node] else 0
            while node and parent[node]:
                nxt = edges.get(f * _EDGE_BASE + code[node])
                if nxt is not None:
                    fail[node] = nxt
                    break
                if f == 0:
                    break
                f = fail[f]
            held[node] = depth[node] if has_child[node] else held[fail[node]]
            match[node] = ends[node] if ends[node] >= 0 else match[fail[node]]
        self._edges, self._fail, self._held, self._match = edges, fail, held, match


class StopScanner:
    """One completion's position in a :class:`StopStrings` automaton."""

    __slots__ = ("automaton", "state")

    def __init__(self, automaton: StopStrings) -> None:
        self.automaton = automaton
        self.state = 0

    @property
    def held(self) -> int:
        """Length of the longest tail of the text read that could still grow into a stop string."""
        return self.automaton._held[self.state]

    def read(self, text: str, offset: int, report: bool = True) -> tuple[int, int] | None:
        """Read ``text``, which starts at ``offset`` in the whole text.

        :param report: look for stop strings (otherwise only follow the text, e.g. while
            ``min_tokens`` are not out yet).
        :returns: ``(start, stop index)`` of the stop string that starts earliest among those that
            end inside ``text`` (ties: the earlier stop string), or None.
        """
        a = self.automaton
        edges, fail, match, stops = a._edges, a._fail, a._match, a.stops
        state, best = self.state, None
        for i, ch in enumerate(text):
            code = ord(ch)
            while True:
                nxt = edges.get(state * _EDGE_BASE + code)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            if report and match[state] >= 0:
                found = (offset + i + 1 - len(stops[match[state]]), match[state])
                if best is None or found < best:
                    best = found
        self.state = state
        return best
