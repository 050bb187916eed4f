"""Prometheus metrics for one app, in a registry of its own (never the global one), so two apps in
one process (tests) do not share or clash.

Engine-wide gauges and counters are read from ``engine.get_metrics()`` at scrape time; latency
histograms are observed by the server as each choice finishes, measured from the moment its HTTP
request was accepted. Names follow vLLM's with the ``specloop:`` prefix.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (metric name, engine.get_metrics() key, help)
_GAUGES = (
    ("specloop:num_requests_running", "num_running_reqs", "Requests in the running batch."),
    ("specloop:num_requests_waiting", "num_waiting_reqs", "Requests waiting to be scheduled."),
    ("specloop:kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (1 = full)."),
)
_COUNTERS = (
    ("specloop:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("specloop:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("specloop:num_preemptions", "num_preemptions", "Requests preempted (KV blocks reclaimed)."),
    ("specloop:prompt_tokens", "num_prompt_tokens", "Prompt tokens computed (prefill)."),
    ("specloop:generation_tokens", "num_generation_tokens", "Tokens generated."),
    ("specloop:spec_decode_num_drafts", "spec_num_drafts", "Draft sequences verified."),
    ("specloop:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Draft tokens verified."),
    ("specloop:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Draft tokens accepted."),
)


class _EngineCollector(Collector):
    """Reads the engine's counters when Prometheus scrapes."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.get_metrics()
        labels = ["model_name"]
        for name, key, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], float(stats.get(key, 0)))
            yield g
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model_name], float(stats.get(key, 0)))
            yield c
        per_pos = CounterMetricFamily("specloop:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(stats.get("spec_num_accepted_tokens_per_pos") or []):
            per_pos.add_metric([self.model_name, str(pos)], float(n))
        yield per_pos
        success = CounterMetricFamily("specloop:request_success", "Finished completions, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, n in sorted((stats.get("num_requests_finished") or {}).items()):
            success.add_metric([self.model_name, str(reason)], float(n))
        yield success


class ServerMetrics:
    """The app's registry: engine counters plus request-latency histograms."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name
        self.ttft = Histogram("specloop:time_to_first_token_seconds", "Time to first token.", ["model_name"],
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram("specloop:time_per_output_token_seconds",
                              "Mean time per output token after the first, per completion.", ["model_name"],
                              buckets=_TPOT_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("specloop:e2e_request_latency_seconds", "End-to-end completion latency.",
                             ["model_name"], buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)

    def observe_finished(self, finish_reason: str, start: float, first_token: float | None, end: float,
                         num_tokens: int) -> None:
        """A completion (one of a request's ``n``) finished; times from ``time.perf_counter()``.
        Aborted and failed completions are counted by the engine but kept out of the latencies."""
        if finish_reason not in ("stop", "length") or first_token is None:
            return
        self.ttft.observe(first_token - start)
        self.e2e.observe(end - start)
        if num_tokens > 1:
            self.tpot.observe((end - first_token) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
