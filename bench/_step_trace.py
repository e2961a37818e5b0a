"""The server's step intervals in a serving run: what stretched the inter-token latency.

* :func:`scrape_steps` reads ``nibble:step_interval_seconds`` (a histogram by step kind)
  from ``/metrics``; :func:`step_deltas` turns two scrapes around a run into that run's
  steps per kind: count, mean, and p50/p99 as bucket upper bounds.
* :func:`summarize_trace` reads a ``--step-trace-file`` (one JSON line per step): per kind
  count, p50, p99 and max interval, and the slowest steps with their shapes (decodes,
  chunk and prefix tokens, budget cost) and host pauses (GC, allocator segments), so a
  slow mixed step shows its cause; ``pauses`` sums those over the trace.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import httpx

METRIC = "nibble:step_interval_seconds"


def parse_steps(text: str) -> dict[str, dict[str, Any]]:
    """Prometheus text -> ``{kind: {"buckets": {le: cumulative}, "sum": s, "count": n}}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, Any]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != METRIC:
            continue
        for s in fam.samples:
            kind = s.labels.get("kind")
            if kind is None:
                continue
            h = out.setdefault(kind, {"buckets": {}, "sum": 0.0, "count": 0.0})
            if s.name.endswith("_bucket"):
                h["buckets"][float(s.labels["le"])] = s.value
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
            elif s.name.endswith("_count"):
                h["count"] = s.value
    return out


def scrape_steps(base_url: str) -> dict[str, dict[str, Any]]:
    """The step histogram now ({} from a server without it)."""
    try:
        r = httpx.get(f"{base_url}/metrics", timeout=30)
    except httpx.HTTPError:
        return {}
    return parse_steps(r.text) if r.status_code == 200 else {}


def _quantile_bound(buckets: dict[float, float], count: float, q: float) -> float:
    """Upper bound (s) of the bucket holding quantile ``q`` of ``count`` observations."""
    target = q * count
    for le in sorted(buckets):
        if buckets[le] >= target:
            return le
    return math.inf


def step_deltas(before: dict, after: dict) -> dict[str, dict[str, float | None]]:
    """Per kind, the steps between two scrapes: ``count``, ``mean_ms``, and ``p50_le_ms`` /
    ``p99_le_ms`` (the bucket bound the quantile falls under; None past the last bound)."""
    out = {}
    for kind, a in after.items():
        b = before.get(kind, {"buckets": {}, "sum": 0.0, "count": 0.0})
        n = a["count"] - b["count"]
        if n <= 0:
            continue
        buckets = {le: c - b["buckets"].get(le, 0.0) for le, c in a["buckets"].items()}
        ms = {q: _quantile_bound(buckets, n, q) * 1e3 for q in (0.5, 0.99)}
        out[kind] = {"count": int(n), "mean_ms": (a["sum"] - b["sum"]) / n * 1e3,
                     "p50_le_ms": ms[0.5] if math.isfinite(ms[0.5]) else None,
                     "p99_le_ms": ms[0.99] if math.isfinite(ms[0.99]) else None}
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize_trace(path: pathlib.Path, top: int = 8) -> dict[str, Any] | None:
    """Per kind ``{count, p50_ms, p99_ms, max_ms}`` and the ``top`` slowest steps of a
    step trace (None when the file is missing or empty)."""
    if not path.exists():
        return None
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not steps:
        return None
    kinds: dict[str, Any] = {}
    for kind in sorted({s["kind"] for s in steps}):
        ms = [s["interval_ms"] for s in steps if s["kind"] == kind]
        kinds[kind] = {"count": len(ms), "p50_ms": _pct(ms, 0.5), "p99_ms": _pct(ms, 0.99),
                       "max_ms": max(ms)}
    slowest = sorted(steps, key=lambda s: -s["interval_ms"])[:top]
    out = {"kinds": kinds, "slowest": slowest}
    if any("gc_ms" in s for s in steps):          # a trace with the host pauses (pauses.py)
        out["pauses"] = {k: round(sum(s.get(k, 0) for s in steps), 3)
                         for k in ("gc_ms", "gc_runs", "gc_full", "device_mallocs",
                                   "alloc_retries")}
    return out
