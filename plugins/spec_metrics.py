"""Speculative-decoding metrics: per-engine counters and a periodic log line.

A built-in plugin like any other. When an engine with a ``speculative_config`` starts, it registers
one :class:`SpecDecodeMetrics` into that engine's plugin manager, which then counts every
``specloop_drafts_verified`` event of that engine and, at most every ``log_interval_s`` seconds
(``plugin_options["spec_metrics"]["log_interval_s"]``, default 10), logs::

    Speculative decoding: mean acceptance length 3.42, acceptance rate 80.5% (966/1200 draft tokens,
    400 drafts), per-position acceptance 0.93, 0.81, 0.68

The mean acceptance length is ``1 + accepted / drafts``: the tokens one verification commits on
average (the accepted drafts plus the target's own token). Engine-wide counters also reach
``LLM.get_metrics()`` and ``/metrics`` through the frontend, from the same ``SchedulerStats``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from specloop.kernel.hookspecs import hookimpl

logger = logging.getLogger("specloop.spec_decode")

PLUGIN_NAME = "spec_metrics"


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters over some span of steps. Updated by :class:`SpecDecodeMetrics`."""

    num_drafts: int = 0  # verifications (requests whose drafts a step verified)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
            accepted_per_position: list[int]) -> None:
        self.num_drafts += num_drafts
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.accepted_per_position
        per_pos.extend([0] * (len(accepted_per_position) - len(per_pos)))
        for i, n in enumerate(accepted_per_position):
            per_pos[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of verifications whose draft ``i`` was accepted."""
        return [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else []

    def as_dict(self) -> dict[str, Any]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance": self.per_position_acceptance}

    def format(self) -> str:
        per_pos = ", ".join(f"{a:.2f}" for a in self.per_position_acceptance)
        return (f"Speculative decoding: mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"acceptance rate {100 * self.acceptance_rate:.1f}% ({self.num_accepted_tokens}/"
                f"{self.num_draft_tokens} draft tokens, {self.num_drafts} drafts), "
                f"per-position acceptance {per_pos}")


class SpecDecodeMetrics:
    """One engine's counters: ``total`` since startup, and the window since the last log line."""

    def __init__(self, log_interval_s: float = 10.0) -> None:
        self.log_interval_s = log_interval_s
        self.total = SpecDecodeStats()
        self.window = SpecDecodeStats()
        self._last_log = time.monotonic()

    @hookimpl
    def specloop_drafts_verified(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                                 accepted_per_position: list[int]) -> None:
        self.total.add(num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_position)
        self.window.add(num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_position)
        if time.monotonic() - self._last_log >= self.log_interval_s:
            self.log()

    @hookimpl
    def specloop_shutdown(self) -> None:
        if self.window.num_drafts:
            self.log()

    def log(self) -> None:
        logger.info(self.window.format())
        self.window = SpecDecodeStats()
        self._last_log = time.monotonic()


def get_spec_metrics(engine: Any) -> SpecDecodeMetrics | None:
    """The metrics plugin registered for ``engine`` (an ``EngineCore``), if it speculates."""
    return engine.plugins.pm.get_plugin(f"{PLUGIN_NAME}-{id(engine):x}")


@hookimpl
def specloop_startup(engine: Any) -> None:
    if engine.config.speculative_config is None:
        return
    options = engine.config.plugin_options.get(PLUGIN_NAME, {})
    metrics = SpecDecodeMetrics(float(options.get("log_interval_s", 10.0)))
    engine.plugins.pm.register(metrics, name=f"{PLUGIN_NAME}-{id(engine):x}")
