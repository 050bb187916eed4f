"""The drafting stage's clock: a record of each step as it starts sampling, and from consecutive
records the tokens per second of steady steps at one speculation length, which the policy's cost
model reads (``SpeculationPolicy.observe_rate``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specloop.proposers.policy import SpeculationPolicy


@dataclass(slots=True)
class StepRecord:
    """One step as the drafting stage sees it when it samples."""

    propose: bool  # call the proposer after sampling
    drafts: bool  # a step with drafts: it verifies some, or the policy wants some after it
    started: float  # when it began sampling
    length: int = 0  # the policy's speculation length for it (steps of one length are compared)
    num_reqs: int = 0
    fresh: bool = False  # every request in it is new: the engine may have waited for them before it
    admits: bool = False  # it computes a new or resumed request's prompt
    tokens: int | None = None  # tokens it commits, once sampled (on a sampling thread: later)
    reported: bool = False  # its rate went to the policy

    @property
    def overlaps(self) -> bool:
        """Whether the next step may be planned before this one commits."""
        return not (self.propose or self.drafts)


class StepRates:
    """The last few steps' records, and each step's rate reported to ``policy`` once it is known.
    ``history``: a list to keep every record in as well (a benchmark's trace of what the policy
    chose and was told, at the cost of one append a step), or None."""

    def __init__(self, policy: SpeculationPolicy) -> None:
        self.policy = policy
        self.recent: deque[StepRecord] = deque(maxlen=6)
        self.history: list[StepRecord] | None = None

    def add(self, record: StepRecord) -> None:
        """A step began sampling: keep its record, and report the steps before it whose rates are
        now known."""
        self.recent.append(record)
        if self.history is not None:
            self.history.append(record)
        self._report()

    def _report(self) -> None:
        """Each step whose tokens are known and whose next step began at its length: its tokens and
        the wall time to that start, once, ``first`` after a step of another length. Not a step
        that admits requests, nor one before such a step (its interval holds that forward): prefill
        costs every length alike, but a length that finishes requests sooner admits in more steps
        (EAGLE-3 at K = 3, batch 128: 2.6x dearer). Not the second step of a run (after a run with
        drafts it is the first that overlaps the next, and its interval still holds the pipeline's
        refill), nor a step followed by one of only new requests (the engine may have idled)."""
        recent = self.recent
        for i in range(3, len(recent)):  # (earlier, before, step, after) = recent[i - 3:i + 1]
            step, after = recent[i - 1], recent[i]
            if (step.reported or not step.tokens or step.admits or after.admits or step.length != after.length
                    or after.fresh or after.started <= step.started):
                continue
            before = recent[i - 2]
            if before.length != step.length or recent[i - 3].length == step.length:
                step.reported = True
                self.policy.observe_rate(step.length, step.num_reqs, step.tokens, after.started - step.started,
                                         first=before.length != step.length)
