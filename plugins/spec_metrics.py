"""Speculative-decoding metrics: per-engine counters and a periodic log line.

A built-in plugin like any other. When an engine with a ``speculative_config`` starts, it registers
one :class:`SpecDecodeMetrics` into that engine's plugin manager, which then counts every
``specloop_drafts_verified`` event of that engine and, at most every ``log_interval_s`` seconds
(``plugin_options["spec_metrics"]["log_interval_s"]``, default 10), logs::

    Speculative decoding: mean acceptance length 3.42, acceptance rate 80.5% (966/1200 draft tokens,
    400 drafts), per-position acceptance 0.93, 0.81, 0.68

The mean acceptance length is ``1 + accepted / drafts``: the tokens one verification commits on
average (the accepted drafts plus the target's own token). The counters are
:class:`~specloop.kernel.outputs.SpecDecodingStats`, the same accumulator the scheduler fills per
step and the frontend keeps for ``LLM.get_metrics()`` and ``/metrics``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from specloop.plugins.options import options_of
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.outputs import SpecDecodingStats

logger = logging.getLogger("specloop.spec_decode")

PLUGIN_NAME = "spec_metrics"


class SpecDecodeMetrics:
    """One engine's counters: ``total`` since startup, and the window since the last log line."""

    def __init__(self, log_interval_s: float = 10.0) -> None:
        self.log_interval_s = log_interval_s
        self.total = SpecDecodingStats()
        self.window = SpecDecodingStats()
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
        self.window = SpecDecodingStats()
        self._last_log = time.monotonic()


def get_spec_metrics(engine: Any) -> SpecDecodeMetrics | None:
    """The metrics plugin registered for ``engine`` (an ``EngineCore``), if it speculates."""
    return engine.plugins.pm.get_plugin(f"{PLUGIN_NAME}-{id(engine):x}")


@hookimpl
def specloop_startup(engine: Any) -> None:
    options = options_of(engine.config, PLUGIN_NAME, ("log_interval_s",))
    if engine.config.speculative_config is None:
        return
    metrics = SpecDecodeMetrics(float(options.get("log_interval_s", 10.0)))
    engine.plugins.pm.register(metrics, name=f"{PLUGIN_NAME}-{id(engine):x}")
