"""Speculation policies: how many drafts each request gets in the next step.

Speculation pays when the tokens a verification step commits grow faster than the step's cost.
Both sides move: acceptance differs by request, by position in the draft and by method; a step's
cost grows with the tokens it computes (a little at small batch, a lot at large batch, where the
forward is compute-bound), with what drafting costs, and with what it does to the pipeline (a step
without drafts overlaps the next one under asynchronous scheduling; a step with drafts does not,
since the next plan needs its accepted counts). No cost model sees all of that, so the ``adaptive``
policy measures the one figure that matters: committed tokens per second at each speculation length,
per batch size. ``fixed`` always asks for ``num_speculative_tokens``.

The model runner's drafting stage asks :meth:`SpeculationPolicy.drafting` at every step for the
step's speculation length (0: propose nothing after it), calls :meth:`SpeculationPolicy.choose`
before proposing and :meth:`SpeculationPolicy.observe` after, and reports the tokens and wall time
of every step that sat amid steps of its own length to :meth:`SpeculationPolicy.observe_rate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from specloop.kernel.config import EngineConfig


@dataclass(slots=True)
class StepObservation:
    """One step, as the drafting stage measured it."""

    num_tokens: int  # tokens the target computed (each request's 1 + drafts verified, prefills too)
    step_seconds: float  # the target's forward and sampling
    draft_seconds: float  # the proposer's propose() call that followed
    num_drafted: int  # draft tokens that call proposed
    # Per request that verified drafts: (request id, drafts verified, drafts accepted).
    verified: list[tuple[str, int, int]] = field(default_factory=list)


class SpeculationPolicy(Protocol):
    def drafting(self, req_ids: Sequence[str]) -> int:
        """Asked once per step, before it samples: the speculation length it proposes after it, at
        most (0, or False: none; the runner skips a proposer that catches up, and the step may
        overlap the next). Steps are grouped by this value for :meth:`observe_rate`."""

    def choose(self, req_ids: Sequence[str], limit: int) -> list[int]:
        """Draft counts for these requests' next step, each in ``[0, limit]``."""

    def observe(self, step: StepObservation) -> None: ...

    def observe_rate(self, length: int, num_reqs: int, tokens: int, seconds: float, first: bool = False) -> None:
        """A step of ``num_reqs`` requests that ran, as the steps on either side of it did, at the
        ``drafting`` value ``length``: the tokens it committed and the wall time from its sampling
        to the next step's. (Reported once its tokens are known: under asynchronous scheduling that
        may be a step or two later.) With ``first``, the step was the first of a run at ``length``
        after a step of another length (its time includes the switch; its tokens are the previous
        length's)."""

    def forget(self, req_ids: Sequence[str]) -> None:
        """Finished or preempted requests."""


class FixedPolicy:
    """Always ``k`` drafts (``num_speculative_tokens`` unless changed, e.g. by a benchmark)."""

    same_on_every_rank = True  # decides from nothing a rank measures (tensor parallelism)

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens if spec is not None and not isinstance(spec, (dict, str)) else 0

    def drafting(self, req_ids: Sequence[str]) -> int:
        return self.k

    def choose(self, req_ids: Sequence[str], limit: int) -> list[int]:
        return [min(self.k, limit)] * len(req_ids)

    def observe(self, step: StepObservation) -> None:
        pass

    def observe_rate(self, length: int, num_reqs: int, tokens: int, seconds: float, first: bool = False) -> None:
        pass

    def forget(self, req_ids: Sequence[str]) -> None:
        pass


class _Acceptance:
    """Accepted / tried counts per draft position (conditional: position i is tried only when every
    draft before it was accepted), on two time scales.

    The short-term counts of every position age at every step that verifies drafts (``age``), also
    the positions it did not try: acceptance moves with the text being written, and a position
    past the length running must not keep a figure from a stretch of text long gone. Aged out, a
    position falls back to what the long-term counts (aged slowly, only by steps that try it)
    expect of it *now*: its long-run acceptance scaled by how the first position, which every step
    with drafts tries, stands against its own long run. Without that, a hard stretch of text that
    drove the policy to length 1 left the deeper positions at that stretch's figures, and kept it at
    length 1 long after the text turned easy again (while it drafts nothing, nothing ages: its
    probes measure afresh)."""

    __slots__ = ("accepted", "tried", "long_accepted", "long_tried")

    def __init__(self, k: int) -> None:
        self.accepted, self.tried = [0.0] * k, [0.0] * k
        self.long_accepted, self.long_tried = [0.0] * k, [0.0] * k

    def add(self, verified: int, accepted: int) -> None:
        for i in range(min(verified, accepted + 1, len(self.tried))):
            self.tried[i] += 1
            self.accepted[i] += i < accepted
            self.long_tried[i] += 1
            self.long_accepted[i] += i < accepted

    def age(self, factor: float) -> None:
        """A step verified drafts: every position's short-term counts lose weight, those it
        did not try too."""
        for i in range(len(self.tried)):
            self.accepted[i] *= factor
            self.tried[i] *= factor

    def age_long(self, factor: float, positions: int) -> None:
        """A step tried the first ``positions``: their long-term counts lose weight."""
        for i in range(min(positions, len(self.tried))):
            self.long_accepted[i] *= factor
            self.long_tried[i] *= factor

    def expected_tokens(self, length: int, prior: float = 0.5) -> float:
        """Tokens a request commits per step at this length: 1 + the chance that each draft and
        every one before it are accepted. A position's chance is its short-term count with one
        pseudo-count of its long-term expectation (class docstring; ``prior`` for a position never
        tried)."""
        total, reach, scale = 1.0, 1.0, 1.0
        for i in range(length):
            long_run = (self.long_accepted[i] + prior) / (self.long_tried[i] + 1.0)
            expect = min(long_run * scale, 1.0)
            chance = (self.accepted[i] + expect) / (self.tried[i] + 1.0)
            if i == 0:
                scale = chance / long_run
            reach *= chance
            total += reach
        return total


def batch_bucket(num_reqs: int) -> int:
    """The bucket whose step times a batch of ``num_reqs`` requests reads and adds to: powers of two
    (bucket ``b`` holds ``2**(b-1)`` to ``2**b - 1`` requests), but from 4 up a batch a request or
    a sixteenth short of the next power of two belongs to that one's bucket. A full batch dips below
    a power of two for a step whenever a request finishes before the next is admitted: each dip would
    otherwise run the smaller bucket's length for one step, a switch each way, and its time (the
    next step admits, or the batch drains at the end of a run) would be taken for what that bucket's
    length costs. One request keeps its own bucket."""
    n = max(num_reqs, 1)
    bucket = n.bit_length()
    top = 1 << bucket
    return bucket + 1 if top >= 4 and n >= top - max(1, top // 16) else bucket


OUTLIER = 4.0  # a measured step counts at most this many times its length's estimate
REPORT_LAG = 6  # steps after a step that its time may be reported (the drafting stage keeps 6)


class AdaptivePolicy:
    """The speculation length with the most committed tokens per second, per batch size.

    One length holds for every request of a step (the runner pads a step's drafts to one count for
    its CUDA graphs anyway). A length's rate is a request's expected tokens per step at that length
    over the step's wall time at that length:

    * expected tokens come from the acceptance of each draft position (conditional on the earlier
      ones), over all verified drafts, decayed by ``accept_decay`` per step that verifies drafts,
      with one pseudo-count of the position's long-run acceptance (decayed by
      ``long_accept_decay`` per step that tries it) scaled by how the first position stands
      against its own long run (``_Acceptance``): acceptance moves with the text being written,
      and the positions past the length running follow the first one;
    * step time is measured per batch-size bucket (:func:`batch_bucket`, about a power of two) and
      length, on steps that ran amid steps of the same length (:meth:`observe_rate`: what a step
      with drafts costs against one that overlaps the next, drafting included; the drafting stage
      leaves out the steps whose interval holds an admission's prefill), decayed by ``decay`` per
      step measured. A bucket that has not measured a length borrows it from the nearest bucket
      that has, scaled by a length both measured; a length between two it has measured (0 and
      ``K``) is interpolated.
      A step counts at most ``OUTLIER`` times the estimate it joins: one pause (a garbage
      collection, the machine busy elsewhere) would otherwise mark its length dear for many steps.

    Step times reported during the first ``warmup`` steps (``2 * probe_len``: the first probes of
    ``K`` and 0) are dropped, and so are those reported in the ``REPORT_LAG`` steps after, which
    may still be of warm-up steps: a fresh engine's first steps carry one-time costs, and one bad
    measurement of a length would otherwise keep the policy off it for thousands of steps.

    The policy runs the length with the highest rate, but holds the length running (whichever
    bucket chose it; after a probe, the bucket's own) unless the better one's gain over
    ``min_interval`` steps pays for the switch; it weighs the lengths again every ``recheck``
    steps, or when the batch changes bucket. (A batch draining at the end of a run into a bucket
    whose length differs would otherwise switch on entering it, however dear the switch: a draft
    model catching up on every token it skipped, for a few steps' gain.) A length whose
    step time nobody has measured is probed first (``K``, then 0; the lengths between are
    interpolated), in runs of ``probe_len`` steps; 0 and ``K`` measured only in other buckets (their
    figures borrowed) as soon as probes may come. The other lengths are probed again as often as
    keeps their expected loss, together, under ``probe_cost`` of the time (each its share): a probe
    loses its steps' shortfall against the best rate (at the length's estimated rate) plus what
    its two switches cost (a pipeline drains, a proposer catches up on the tokens it skipped: the
    measured excess of the first step of a run of each length over its steady step, one step until
    measured), so it comes once that loss is its share of ``probe_cost`` of the steps since the
    last, and not more often than every ``min_interval`` steps nor less often than every
    ``max_interval``: a one-time cost (a kernel compiled in a run's first step) must not mark a
    length dear for good. The lengths that far behind (their loss would allow a longer interval)
    take turns: one probe of them every ``max_interval`` steps, the one that waited longest, since a
    proposer whose drafts lose would otherwise pay a probe of every such length each time; and
    while such probes find nothing (the best length is the same at the next), they come twice as
    far apart each time, up to the interval ``probe_cost`` gives them and at most ``far_backoff``
    times ``max_interval`` (a new best length starts over): a cost measured again and again is not
    a one-time cost. A step that costs less than ``1 / OUTLIER`` of its estimate restarts that
    estimate, for the same reason. Probes of a length with drafts also refresh the acceptance while
    the policy drafts nothing.
    """

    def __init__(self, config: EngineConfig, *, probe_len: int = 8, probe_cost: float = 0.005,
                 min_interval: int = 64, max_interval: int = 2048, decay: float = 0.98,
                 accept_decay: float = 0.95, long_accept_decay: float = 0.998, warmup: int | None = None,
                 recheck: int = 8, far_backoff: int = 8) -> None:
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens if spec is not None and not isinstance(spec, (dict, str)) else 1
        if probe_len < 3:  # a step time is measured on a step amid two of its own length
            raise ValueError(f"probe_len must be at least 3, got {probe_len}")
        self.probe_len, self.probe_cost = probe_len, probe_cost
        self.min_interval, self.max_interval, self.far_backoff = min_interval, max_interval, far_backoff
        # Step times of the engine's first steps are not kept (one-time costs: kernels compiled and
        # tuned, first graph replays, the allocator growing): its first probes of K and 0.
        self.warmup = 2 * probe_len if warmup is None else warmup
        self.decay, self.accept_decay, self.long_accept_decay = decay, accept_decay, long_accept_decay
        self.lengths = [self.k, *range(self.k)]  # probe order for lengths nobody measured
        self.acceptance = _Acceptance(self.k)
        self.num_steps = 0
        # (bucket, length) -> decayed [seconds, steps] of steady steps, and of first steps of a run.
        self.times: dict[tuple[int, int], list[float]] = {}
        self.entries: dict[tuple[int, int], list[float]] = {}
        self.probed: dict[tuple[int, int], int] = {}
        self.first_seen: dict[int, int] = {}
        self.held: dict[int, int] = {}  # per bucket, the length it runs between probes
        self.far_probed: dict[int, int] = {}  # per bucket, when it last probed a length far behind
        self.far_every: dict[int, int] = {}  # per bucket, steps between such probes (max_interval and up)
        self.far_best: dict[int, int] = {}  # per bucket, the best length at the last such probe
        self.length = self.k  # this step's
        self.probe: tuple[int, int, int] | None = None  # (bucket, length, steps left)
        # Weighing every length costs tens of microseconds of Python, a tenth of a small step: a
        # choice holds for ``recheck`` steps of its bucket (a probe that comes due waits that long
        # at most).
        self.recheck = recheck
        self.decided: tuple[int, int, int] = (-1, 0, 0)  # (bucket, length, until step)

    # --- measurements --------------------------------------------------------------------------------

    def step_time(self, bucket: int, length: int) -> tuple[float, float] | None:
        """Measured ``(seconds per step, steps measured)`` at this length in this bucket (the count
        decayed like the sum); None before any."""
        kept = self.times.get((bucket, length))
        return (kept[0] / kept[1], kept[1]) if kept and kept[1] > 0 else None

    def step_times(self, bucket: int) -> dict[int, tuple[float, float] | None]:
        """Every length's :meth:`step_time` in this bucket, borrowed where it has none (class
        docstring; a borrowed figure counts 0 steps measured)."""
        own = {n: self.step_time(bucket, n) for n in self.lengths}
        if all(own.values()):
            return own
        others = sorted({b for b, _ in self.times if b != bucket}, key=lambda b: (abs(b - bucket), b))
        if not any(own.values()):
            for b in others:
                theirs = {n: self.step_time(b, n) for n in self.lengths}
                if any(theirs.values()):
                    return {n: t and (t[0], 0.0) for n, t in theirs.items()}
            return own
        for n in self.lengths:
            for b in others if own[n] is None else ():
                theirs = self.step_time(b, n)
                common = [m for m in self.lengths if own[m] is not None and self.step_time(b, m) is not None]
                if theirs is not None and common:
                    own[n] = (theirs[0] * own[common[0]][0] / self.step_time(b, common[0])[0], 0.0)
                    break
        if own[0] is not None and own[self.k] is not None:  # in between: linear in the length
            for n in range(1, self.k):
                if own[n] is None:
                    own[n] = (own[0][0] + (own[self.k][0] - own[0][0]) * n / self.k, 0.0)
        return own

    def rates(self, bucket: int) -> dict[int, tuple[float, float, float] | None]:
        """Per length: ``(expected tokens per second per request, seconds per step, steps measured)``."""
        return {n: t and (self.acceptance.expected_tokens(n) / t[0], t[0], t[1])
                for n, t in self.step_times(bucket).items()}

    # --- the policy ---------------------------------------------------------------------------------

    def drafting(self, req_ids: Sequence[str]) -> int:
        self.num_steps += 1
        bucket = batch_bucket(len(req_ids))
        self.first_seen.setdefault(bucket, self.num_steps)
        # A probe runs its steps out even when the batch crosses into another bucket (a request
        # finished, the next not yet admitted): cut short, it would measure nothing (its last step
        # is not reported) and be tried again at every crossing, each a switch.
        if self.probe is not None and self.probe[2] > 0:
            self.probe = (self.probe[0], self.probe[1], self.probe[2] - 1)
            self.length = self.probe[1]
            return self.length
        probed, self.probe = self.probe is not None, None
        held_bucket, held, until = self.decided
        if held_bucket == bucket and self.num_steps < until:
            self.length = held
            return held
        self.length = self._next_length(bucket, None if probed else self.length)  # (from a probe: back)
        if self.probe is None:
            self.decided = (bucket, self.length, self.num_steps + self.recheck)
        return self.length

    def _next_length(self, bucket: int, running: int | None = None) -> int:
        if self.num_steps < self.warmup:  # warm K and 0 up in turn
            return self._start_probe(bucket, self.k if (self.num_steps // self.probe_len) % 2 == 0 else 0)
        rates = self.rates(bucket)
        unknown = [n for n in self.lengths if rates[n] is None]
        if unknown:
            return self._start_probe(bucket, unknown[0])
        best = max(self.lengths, key=lambda n: (rates[n][0], -n))
        # Stay at the length running (or, after a probe, at the bucket's own) unless the gain over
        # min_interval steps pays for the switch: noise between close rates would otherwise switch
        # back and forth, each switch a drained step; and a batch that drains into a smaller bucket
        # at the end of a run would enter that bucket's length, a draft model catching up on every
        # token it skipped, for a few steps' gain.
        held = running if running is not None else self.held.get(bucket)
        if held is not None and held != best:
            gain = (1 - rates[held][0] / rates[best][0]) * self.min_interval * rates[held][1]
            if gain < self.switch_cost(bucket, best, rates[best][1]):
                best = held
        self.held[bucket] = best
        best_rate, best_step, _ = rates[best]
        due = []
        far_every, far_budget = self.far_every.get(bucket, self.max_interval), self.far_backoff * self.max_interval
        far = self.num_steps - self.far_probed.get(bucket, self.first_seen[bucket]) < far_every
        for n in self.lengths:
            if n == best:
                continue
            rate, step, measured = rates[n]
            # Seconds a probe loses against the best length: its steps' shortfall, and its switches.
            loss = (self.probe_len * step * (1 - rate / best_rate) + self.switch_cost(bucket, n, step)
                    + self.switch_cost(bucket, best, best_step))
            # The lengths share the probing budget. 0 and K not measured in this bucket have figures
            # borrowed from another (scaled by a length both measured: a guess), probed as soon as
            # probes may come; the lengths between are interpolated from those two.
            guess = not measured and n in (0, self.k)
            interval = 0.0 if guess else loss * (len(self.lengths) - 1) / (best_step * self.probe_cost)
            if interval >= self.max_interval:  # far behind: the budget's fewest steps for any of them
                far_budget = min(far_budget, interval)
                if far:
                    continue  # one length this far behind was probed within far_every: it speaks for all
            interval = min(max(self.min_interval, interval), self.max_interval)
            waited = self.num_steps - self.probed.get((bucket, n), self.first_seen[bucket])
            if waited >= interval:
                due.append((waited / interval, interval >= self.max_interval, n))
        if due:
            _, capped, n = max(due)
            if capped:  # the last such probe found nothing if the best length is still the same
                self.far_every[bucket] = int(max(self.max_interval, min(2 * far_every, far_budget))) \
                    if self.far_best.get(bucket) == best else self.max_interval
                self.far_best[bucket] = best
                self.far_probed[bucket] = self.num_steps
            return self._start_probe(bucket, n)
        return best

    def switch_cost(self, bucket: int, length: int, step: float) -> float:
        """Seconds the first step of a run at this length costs beyond a steady ``step`` (one step
        until measured in this bucket)."""
        kept = self.entries.get((bucket, length))
        return max(kept[0] / kept[1] - step, 0.0) if kept and kept[1] > 0 else step

    def _start_probe(self, bucket: int, length: int) -> int:
        self.probe = (bucket, length, self.probe_len - 1)
        self.probed[(bucket, length)] = self.num_steps
        return length

    def choose(self, req_ids: Sequence[str], limit: int) -> list[int]:
        return [min(limit, self.length)] * len(req_ids)

    def observe(self, step: StepObservation) -> None:
        if step.verified:
            reached = max(min(verified, accepted + 1) for _, verified, accepted in step.verified)
            self.acceptance.age(self.accept_decay)
            self.acceptance.age_long(self.long_accept_decay, reached)
        for _, verified, accepted in step.verified:
            self.acceptance.add(verified, accepted)

    def observe_rate(self, length: int, num_reqs: int, tokens: int, seconds: float, first: bool = False) -> None:
        if self.num_steps < self.warmup + (REPORT_LAG if self.warmup else 0):
            return
        kept = (self.entries if first else self.times).setdefault((batch_bucket(num_reqs), int(length)), [0.0, 0.0])
        if kept[1] > 0:  # a pause inside one step (a garbage collection, another process) is not its length's cost
            estimate = kept[0] / kept[1]
            if OUTLIER * seconds < estimate:  # nor was it when the estimate began with one
                kept[0] = kept[1] = 0.0
            seconds = min(seconds, OUTLIER * estimate)
        kept[0] = self.decay * kept[0] + seconds
        kept[1] = self.decay * kept[1] + 1

    def forget(self, req_ids: Sequence[str]) -> None:
        pass
