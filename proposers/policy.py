"""Speculation policies: how many drafts each request gets in the next step.

Speculation pays when the tokens a verification step commits grow faster than the step's cost.
Both sides move: acceptance differs by request and by position in the draft, and a step's cost grows
with the tokens it computes (a little at small batch, where the forward is bandwidth-bound, a lot at
large batch, where it is compute-bound) plus what drafting costs. The ``adaptive`` policy measures
both and picks, per request and per step, the draft counts that maximise expected tokens per second;
``fixed`` always asks for ``num_speculative_tokens``.

The model runner's drafting stage asks :meth:`SpeculationPolicy.drafting` at every step whether
to propose at all, calls :meth:`SpeculationPolicy.choose` before proposing and
:meth:`SpeculationPolicy.observe` after, and reports every step's committed tokens and wall time to
:meth:`SpeculationPolicy.observe_rate`. A step that proposes nothing and verifies nothing is an
ordinary decode step, which asynchronous scheduling overlaps with the next one; a step with drafts
is synchronous (the next plan needs its accepted counts). Whether drafting pays therefore depends
on more than the draft and verification costs, and the adaptive policy measures it directly: tokens
per second of steps with drafts against steps without.
"""

from __future__ import annotations

import heapq
from collections import deque
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
    def drafting(self, req_ids: Sequence[str]) -> bool:
        """Asked once per step, before it samples: whether to propose after it at all (False:
        the runner skips a proposer that catches up, and the step may overlap the next)."""

    def choose(self, req_ids: Sequence[str], limit: int) -> list[int]:
        """Draft counts for these requests' next step, each in ``[0, limit]``."""

    def observe(self, step: StepObservation) -> None: ...

    def observe_rate(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A step amid steps of its own kind (with drafts, verified or proposed; or without):
        the tokens it committed and the wall time from its sampling to the next step's."""

    def forget(self, req_ids: Sequence[str]) -> None:
        """Finished or preempted requests."""


class FixedPolicy:
    """Always ``k`` drafts (``num_speculative_tokens`` unless changed, e.g. by a benchmark)."""

    same_on_every_rank = True  # decides from nothing a rank measures (tensor parallelism)

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens if spec is not None and not isinstance(spec, (dict, str)) else 0

    def drafting(self, req_ids: Sequence[str]) -> bool:
        return self.k > 0

    def choose(self, req_ids: Sequence[str], limit: int) -> list[int]:
        return [min(self.k, limit)] * len(req_ids)

    def observe(self, step: StepObservation) -> None:
        pass

    def observe_rate(self, drafted: bool, tokens: int, seconds: float) -> None:
        pass

    def forget(self, req_ids: Sequence[str]) -> None:
        pass


class _Acceptance:
    """Accepted / tried counts per draft position (conditional: position i is tried only when every
    draft before it was accepted)."""

    __slots__ = ("accepted", "tried")

    def __init__(self, k: int) -> None:
        self.accepted = [0.0] * k
        self.tried = [0.0] * k

    def add(self, verified: int, accepted: int) -> None:
        for i in range(min(verified, accepted + 1)):
            self.tried[i] += 1
            self.accepted[i] += i < accepted

    def decay(self, factor: float) -> None:
        self.accepted = [a * factor for a in self.accepted]
        self.tried = [t * factor for t in self.tried]


class AdaptivePolicy:
    """Per-request draft counts from measured acceptance and a measured cost model.

    Acceptance: each request's per-position acceptance, shrunk toward the engine-wide figure
    (``prior_weight`` pseudo-observations), so a new request starts from what others showed and
    settles on its own. Cost: a step of ``T`` target tokens costs ``a + b * T`` seconds (least
    squares over the last ``window`` steps) plus ``c`` seconds per drafted token. Choice: start every
    request at 0 drafts and add one draft at a time where the expected gain (the probability that
    this and every earlier draft are accepted) is largest, while it raises expected tokens per second:
    ``gain > E * (b + c) / t`` for the step's current expected tokens ``E`` and cost ``t``. Until the
    model has ``warmup`` steps it asks for the full ``limit``; every ``explore_every`` steps a request
    at 0 gets one draft, so a request that turned speculation off can turn it back on.

    On or off: the cost model sees only steps with drafts, which run synchronously, while steps
    without drafts overlap under asynchronous scheduling and cost less than ``a + b * T`` says. So
    the policy also keeps the measured tokens per second of both kinds of step (decayed sums, steps
    amid their own kind only) and drafts nothing while steps without drafts are faster. Every
    ``probe_every`` steps it runs ``probe_len`` steps of the other kind to keep both figures fresh.
    """

    def __init__(self, config: EngineConfig, *, window: int = 64, warmup: int = 8, prior_weight: float = 4.0,
                 explore_every: int = 16, probe_every: int = 64, probe_len: int = 4) -> None:
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens if spec is not None and not isinstance(spec, (dict, str)) else 1
        self.window, self.warmup, self.prior_weight, self.explore_every = window, warmup, prior_weight, explore_every
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)
        self.draft_cost = 0.0  # seconds per drafted token (exponential moving average)
        self.engine = _Acceptance(self.k)
        self.requests: dict[str, _Acceptance] = {}
        self.num_choices = 0
        self.probe_every, self.probe_len = probe_every, probe_len
        self.num_steps = 0
        self.mode = "plan"  # this step's: "plan" (per-request counts), "off", or "probe" (drafts forced)
        # Decayed [tokens, seconds] of steps with drafts (True) and without (False).
        self.rates: dict[bool, list[float]] = {True: [0.0, 0.0], False: [0.0, 0.0]}

    # --- model -------------------------------------------------------------------------------------

    def cost_model(self) -> tuple[float, float]:
        """``(a, b)`` of ``step_seconds = a + b * tokens``; b is clamped at 0."""
        n = len(self.steps)
        mean_t = sum(t for t, _ in self.steps) / n
        mean_s = sum(s for _, s in self.steps) / n
        var = sum((t - mean_t) ** 2 for t, _ in self.steps)
        b = max(sum((t - mean_t) * (s - mean_s) for t, s in self.steps) / var, 0.0) if var > 0 else 0.0
        return max(mean_s - b * mean_t, 1e-9), b

    def acceptance(self, req_id: str) -> list[float]:
        """Conditional acceptance probability of each draft position for this request."""
        own = self.requests.get(req_id)
        out = []
        for i in range(self.k):
            g_tried = self.engine.tried[i]
            prior = self.engine.accepted[i] / g_tried if g_tried else 0.5
            acc, tried = (own.accepted[i], own.tried[i]) if own is not None else (0.0, 0.0)
            out.append((acc + self.prior_weight * prior) / (tried + self.prior_weight))
        return out

    def rate(self, drafted: bool) -> float | None:
        """Measured tokens per second of steps with (or without) drafts; None before any."""
        tokens, seconds = self.rates[drafted]
        return tokens / seconds if seconds > 0 else None

    def drafting_pays(self) -> bool:
        with_drafts, without = self.rate(True), self.rate(False)
        return with_drafts is None or without is None or with_drafts >= without

    # --- the policy ---------------------------------------------------------------------------------

    def drafting(self, req_ids: Sequence[str]) -> bool:
        self.num_steps += 1
        if len(self.steps) < self.warmup:
            self.mode = "plan"
            return True
        probing = self.num_steps % self.probe_every < self.probe_len
        if self.drafting_pays() == probing:  # off, or a probe of steps without drafts
            self.mode = "off"
            return False
        if probing:  # a probe of steps with drafts
            self.mode = "probe"
            return True
        self.mode = "plan"
        return self._first_draft_pays(req_ids)

    def choose(self, req_ids: Sequence[str], limit: int) -> list[int]:
        self.num_choices += 1
        limit = min(limit, self.k)
        if len(self.steps) < self.warmup:
            return [limit] * len(req_ids)
        if self.mode == "off":
            return [0] * len(req_ids)
        ks = self._plan(req_ids, limit)
        if self.mode == "probe" or self.num_choices % self.explore_every == 0:
            ks = [max(k, min(1, limit)) for k in ks]
        return ks

    def _plan(self, req_ids: Sequence[str], limit: int) -> list[int]:
        """Per-request draft counts from acceptance and the cost model (class docstring)."""
        a, b = self.cost_model()
        ks = [0] * len(req_ids)
        accept = [self.acceptance(r) for r in req_ids]
        expected = float(len(req_ids))  # each request's own token
        seconds = a + b * len(req_ids)
        # (-gain of the request's next draft, request): a draft's gain is the chance that it and
        # every earlier one are accepted, so each request's gains only fall as it gets more.
        heap = [(-acc[0], j) for j, acc in enumerate(accept)] if limit > 0 else []
        heapq.heapify(heap)
        while heap:
            gain, j = -heap[0][0], heap[0][1]
            if gain <= 0.0 or gain <= expected * (b + self.draft_cost) / seconds:
                break
            heapq.heappop(heap)
            ks[j] += 1
            expected += gain
            seconds += b + self.draft_cost
            if ks[j] < limit:
                heapq.heappush(heap, (-gain * accept[j][ks[j]], j))
        return ks

    def _first_draft_pays(self, req_ids: Sequence[str]) -> bool:
        """Whether :meth:`_plan` gives anyone a draft: its first pick passes the threshold."""
        if not req_ids:
            return False
        a, b = self.cost_model()
        best = max(self.acceptance(r)[0] for r in req_ids)
        return best > 0.0 and best > len(req_ids) * (b + self.draft_cost) / (a + b * len(req_ids))

    def observe(self, step: StepObservation) -> None:
        self.steps.append((step.num_tokens, step.step_seconds))
        if step.num_drafted:
            per_token = step.draft_seconds / step.num_drafted
            self.draft_cost = per_token if self.draft_cost == 0.0 else 0.9 * self.draft_cost + 0.1 * per_token
        self.engine.decay(0.99)  # recent behaviour counts more
        for rid, verified, accepted in step.verified:
            self.engine.add(verified, accepted)
            self.requests.setdefault(rid, _Acceptance(self.k)).add(verified, accepted)

    def observe_rate(self, drafted: bool, tokens: int, seconds: float) -> None:
        kept = self.rates[drafted]
        kept[0] = 0.9 * kept[0] + tokens
        kept[1] = 0.9 * kept[1] + seconds

    def forget(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            self.requests.pop(rid, None)
