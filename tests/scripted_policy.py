"""A scripted speculation policy for tests, and a count of overlapped steps."""

from __future__ import annotations


class Alternating:
    """A speculation policy that drafts in runs: ``on`` steps with drafts, ``off`` steps without."""

    def __init__(self, on: int = 3, off: int = 4) -> None:
        self.on, self.off, self.num_steps, self.active = on, off, 0, True

    def drafting(self, req_ids):
        self.num_steps += 1
        self.active = self.num_steps % (self.on + self.off) < self.on
        return self.active

    def choose(self, req_ids, limit):
        return [limit if self.active else 0] * len(req_ids)

    def observe(self, step):
        pass

    def observe_rate(self, length, num_reqs, tokens, seconds, first=False):
        pass

    def forget(self, req_ids):
        pass


class OverlapCounter:
    """Wraps ``core.step``: counts the steps after which a launched plan is still in flight (the
    next one will be planned before it commits)."""

    def __init__(self, core) -> None:
        self.count, self._step, self._core = 0, core.step, core
        core.step = self.step

    def step(self):
        out = self._step()
        self.count += bool(self._core.in_flight)
        return out
