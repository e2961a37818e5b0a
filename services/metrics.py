"""Prometheus metrics of one server, with SGLang's metric names under the ``nibble:`` prefix.

Two sources:
- engine state (gauges such as running/queued requests, token usage, cache hit
  rate): an ``EngineStats`` (services/engine/client.py) that the ``/metrics``
  route awaits from ``engine.stats()`` at scrape time and hands to ``render``,
  so they are never stale and cost nothing between scrapes;
- per-request observations (token counters, TTFT / TPOT / end-to-end latency
  histograms), recorded by the gateway when each request ends, whatever way it
  ends (finished, aborted, failed).

Each ``Metrics`` owns its own ``CollectorRegistry``: nothing touches
prometheus_client's global default registry, so tests can build many servers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from .engine.client import EngineStats

log = logging.getLogger(__name__)

PREFIX = "nibble:"

# Latency buckets (seconds) wide enough for a CPU box (seconds per token) and an H200
# (sub-millisecond decode steps).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03,
                0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0,
               30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0)

# EngineStats field -> (gauge name, help)
ENGINE_GAUGES = {
    "num_running": ("num_running_reqs", "Requests running (prefilling or decoding)."),
    "num_queued": ("num_queue_reqs", "Requests waiting for admission."),
    "token_usage": ("token_usage", "Fraction of KV pool pages in use (0..1)."),
    "max_total_tokens": ("max_total_num_tokens", "KV pool capacity in tokens."),
    "cache_hit_rate": ("cache_hit_rate",
                       "Cumulative prefix cache hit rate: cached prompt tokens / prompt tokens."),
    "num_cached_pages": ("num_cached_pages", "KV pages held by the prefix cache."),
}

FINISH_REASONS = ("stop", "length", "abort", "error")


StatsSource = Callable[[], "EngineStats | dict[str, Any]"]


class EngineStatsCollector(Collector):
    """Turns the scrape's ``EngineStats`` (``snapshot``, set by ``Metrics.render``) into
    gauge (and counter) families. Fields the engine does not report are left out."""

    def __init__(self) -> None:
        self.snapshot: EngineStats | None = None

    def describe(self) -> list[Metric]:
        return []       # values only exist at scrape time

    def collect(self) -> Iterator[Metric]:
        if self.snapshot is None:
            return
        s = self.snapshot.as_dict()
        for key, (name, doc) in ENGINE_GAUGES.items():
            if s.get(key) is not None:
                yield GaugeMetricFamily(PREFIX + name, doc, value=float(s[key]))
        if s.get("kv_bytes_per_token") is not None:
            g = GaugeMetricFamily(PREFIX + "kv_bytes_per_token",
                                  "KV cache bytes per token (all layers) of the active dtype.",
                                  labels=["kv_cache_dtype"])
            g.add_metric([str(s.get("kv_cache_dtype", "unknown"))], float(s["kv_bytes_per_token"]))
            yield g
        if s.get("num_preemptions") is not None:
            yield CounterMetricFamily(PREFIX + "num_preemptions",
                                      "Requests preempted because KV pages ran out.",
                                      value=float(s["num_preemptions"]))
        for key, name, doc in ENGINE_COUNTERS:
            if s.get(key) is not None:
                yield CounterMetricFamily(PREFIX + name, doc, value=float(s[key]))
        if s.get("tiers") and s["tiers"].get("hierarchical"):
            yield from tier_families(s["tiers"], s.get("num_cached_pages", 0))
        if s.get("step_intervals"):
            yield step_interval_family(s["step_intervals"])


def step_interval_family(by_kind: dict[str, dict]) -> HistogramMetricFamily:
    """``StepTimer.snapshot()`` as one histogram with a ``kind`` label."""
    h = HistogramMetricFamily(
        PREFIX + "step_interval_seconds",
        "Time between two engine steps landing, by step kind: decode (generated tokens "
        "only), mixed (decodes and prompt chunks: what stretches the inter-token latency), "
        "prefill (prompt chunks only).", labels=["kind"])
    for kind, v in by_kind.items():
        buckets = [(repr(float(le)), int(c)) for le, c in v["buckets"]] + \
            [("+Inf", int(v["count"]))]
        h.add_metric([kind], buckets, sum_value=float(v["sum"]))
    return h


# Engine totals exported as counters: (stats key, metric name, help).
ENGINE_COUNTERS = (
    ("prompt_tokens_computed", "prompt_tokens_computed",
     "Prompt tokens run through the model (prefix-cache hits excluded; recomputed tokens "
     "counted again)."),
    ("num_request_faults", "request_faults",
     "Requests failed alone by a fault in their own step (bad input or pages); the rest ran on."),
    ("num_fault_recomputes", "fault_recomputes",
     "Requests recomputed without the cached pages a failed step had used."),
)


def _labelled(family, values: dict[str, float]):
    for key, value in values.items():
        family.add_metric([key], float(value))
    return family


def tier_families(t: dict[str, Any], l1_cached_pages: int) -> Iterator[Metric]:
    """Per-tier metrics of the hierarchical cache (``engine.stats()["tiers"]``)."""
    yield _labelled(CounterMetricFamily(PREFIX + "tier_hit_pages", "Prefix pages served, by tier.",
                                        labels=["tier"]),
                    {"l1": t["l1_hit_pages"], "l2": t["l2_hit_pages"], "l3": t["l3_hit_pages"]})
    yield _labelled(CounterMetricFamily(PREFIX + "tier_pages_moved", "Pages copied between tiers.",
                                        labels=["direction"]),
                    {"l1_to_l2": t["l2_written"] + t["l1_to_l2_evict_pages"],
                     "l2_to_l3": t["l3_written"], "l3_to_l2": t["l3_read"],
                     "l2_to_l1": t["l2_to_l1_pages"]})
    yield _labelled(CounterMetricFamily(PREFIX + "tier_bytes_moved", "Bytes moved to and from L3.",
                                        labels=["direction"]),
                    {"l2_to_l3": t["l3_bytes_written"], "l3_to_l2": t["l3_bytes_read"]})
    yield _labelled(CounterMetricFamily(PREFIX + "tier_l3_failures",
                                        "L3 reads that missed or failed their checksum, and "
                                        "writes that failed.", labels=["kind"]),
                    {"miss": t["l3_miss"], "corrupt": t["l3_corrupt"],
                     "write_failed": t["l3_write_failed"]})
    rejected = CounterMetricFamily(
        PREFIX + "tier_rejected_records", "Stored page records refused and recomputed, by tier "
        "and reason (auth: forged or moved; malformed; stale; nonfinite scales).",
        labels=["tier", "reason"])
    for tier, reasons in t.get("rejected_records", {}).items():
        for reason, n in reasons.items():
            rejected.add_metric([tier, reason], float(n))
    yield rejected
    yield CounterMetricFamily(PREFIX + "tier_load_seconds", "Time spent copying prefixes into L1.",
                              value=float(t["load_seconds"]))
    yield CounterMetricFamily(PREFIX + "tier_loads", "Prefix loads into L1.", value=float(t["loads"]))
    yield _labelled(GaugeMetricFamily(PREFIX + "tier_occupancy_pages", "Pages held per tier.",
                                      labels=["tier"]),
                    {"l1": l1_cached_pages, "l2": t["l2_pages"]})
    yield GaugeMetricFamily(PREFIX + "tier_l2_capacity_pages", "L2 host pool size in pages.",
                            value=float(t["l2_capacity_pages"]))
    yield _labelled(GaugeMetricFamily(PREFIX + "tier_up", "1 when the storage tier is reachable.",
                                      labels=["tier"]),
                    {"l3": 1.0 if t["l3_state"] == "up" else 0.0})
    yield GaugeMetricFamily(PREFIX + "tier_l3_bytes_per_second",
                            "Measured L3 read bandwidth (EMA; 0 until measured).",
                            value=float(t["l3_bytes_per_s"]))


class RequestTimer:
    """Times one request: created when it is received, ``first_token()`` at its first
    output token, ``finish()`` once when it ends (later calls are ignored)."""

    def __init__(self, metrics: "Metrics"):
        self._metrics = metrics
        self.received = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished = False

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def finish(self, finish_reason: str, prompt_tokens: int = 0, completion_tokens: int = 0,
               cached_tokens: int = 0) -> None:
        if self.finished:
            return
        self.finished = True
        now = time.perf_counter()
        ttft = None if self.first_token_at is None else self.first_token_at - self.received
        self._metrics.observe_request(finish_reason, now - self.received, ttft, prompt_tokens,
                                      completion_tokens, cached_tokens)


class Metrics:
    """All metrics of one server. ``render()`` gives the exposition for a scrape."""

    def __init__(self, stats: StatsSource | None = None):
        """``stats``: a synchronous source of engine stats for renders given none (tests,
        benchmarks); the server passes the awaited ``engine.stats()`` to ``render``."""
        self.registry = CollectorRegistry()
        self._stats = stats
        self._engine = EngineStatsCollector()
        self._render_lock = threading.Lock()
        self._failed_before = False
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.",
                                     registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.",
                                         registry=reg)
        self.cached_tokens = Counter(PREFIX + "cached_tokens",
                                     "Prompt tokens served from the prefix cache.", registry=reg)
        self.num_requests = Counter(PREFIX + "num_requests", "Requests ended, by finish reason.",
                                    ["finish_reason"], registry=reg)
        for reason in FINISH_REASONS:      # export zeros so rate() works from the first scrape
            self.num_requests.labels(finish_reason=reason)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from request arrival to its first output token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from request arrival to its end.", buckets=E2E_BUCKETS,
                             registry=reg)
        reg.register(self._engine)

    def start_request(self) -> RequestTimer:
        return RequestTimer(self)

    def observe_request(self, finish_reason: str, e2e: float, ttft: float | None,
                        prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """Record one ended request. TPOT = (e2e - ttft) / (completion_tokens - 1)."""
        self.num_requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(max(prompt_tokens, 0))
        self.generation_tokens.inc(max(completion_tokens, 0))
        self.cached_tokens.inc(max(cached_tokens, 0))
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe(max(e2e - ttft, 0.0) / (completion_tokens - 1))

    def stats_failed(self) -> None:
        """Log (once, with the exception being handled) that engine stats could not be read;
        the scrape still returns the request metrics."""
        if not self._failed_before:
            log.exception("engine.stats() failed; engine gauges are left out of /metrics")
        self._failed_before = True

    def _snapshot(self) -> EngineStats | None:
        if self._stats is None:
            return None
        try:
            s = self._stats()
        except Exception:  # noqa: BLE001 - reported once, the scrape goes on
            self.stats_failed()
            return None
        return s if isinstance(s, EngineStats) else EngineStats.from_dict(s)

    def render(self, accept: str | None = None, stats: EngineStats | None = None
               ) -> tuple[bytes, str]:
        """(body, content type): Prometheus text format, or OpenMetrics when ``accept``
        (the scraper's Accept header) asks for it. ``stats``: the engine's gauges for this
        scrape (else read from the source given to the constructor, if any)."""
        encoder, content_type = choose_encoder(accept or "")
        with self._render_lock:
            self._engine.snapshot = stats if stats is not None else self._snapshot()
            try:
                return encoder(self.registry), content_type
            finally:
                self._engine.snapshot = None
