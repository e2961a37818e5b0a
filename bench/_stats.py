"""Pure metric math and result files shared by the serving benchmarks.

Definitions (as SGLang's bench_serving reports them):
- TTFT: request sent -> first streamed text; E2E: request sent -> end of stream.
- TPOT per request: (E2E - TTFT) / (output tokens - 1); ITL: every gap between text chunks.
- Throughputs: tokens (or requests) of completed requests / wall time of the run.
- Achieved concurrency: sum of E2E latencies / wall time (mean requests in flight).
- Interactivity: tokens per second seen by one user = 1 / mean TPOT.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ._http import RequestResult


def distribution(values: Sequence[float], prefix: str, scale: float = 1000.0) -> dict[str, Any]:
    """``{prefix_mean_ms, prefix_median_ms, prefix_p99_ms}`` of ``values`` (seconds x scale);
    None for an empty list. Percentiles interpolate linearly (numpy's default)."""
    unit = "ms" if scale == 1000.0 else "s"
    keys = [f"{prefix}_{k}_{unit}" for k in ("mean", "median", "p99")]
    if not values:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=np.float64) * scale
    return dict(zip(keys, (float(arr.mean()), float(np.median(arr)),
                           float(np.percentile(arr, 99)))))


def summarize(results: Sequence[RequestResult], duration_s: float, num_gpus: int = 1
              ) -> dict[str, Any]:
    """Aggregate metrics of one run (only completed requests count towards tokens)."""
    done = [r for r in results if r.ok]
    inp = sum(r.prompt_tokens for r in done)
    out = sum(r.completion_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    dur = max(duration_s, 1e-9)
    rec: dict[str, Any] = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration_s,
        "total_input_tokens": inp, "total_output_tokens": out, "cached_tokens": cached,
        "cache_hit_rate": cached / inp if inp else 0.0,
        "request_throughput": len(done) / dur, "input_throughput": inp / dur,
        "output_throughput": out / dur, "total_token_throughput": (inp + out) / dur,
        "output_throughput_per_gpu": out / dur / max(1, num_gpus),
        "achieved_concurrency": sum(r.e2e for r in done) / dur,
    }
    rec.update(distribution([r.ttft for r in done], "ttft"))
    rec.update(distribution(tpots, "tpot"))
    rec.update(distribution([g for r in done for g in r.itl], "itl"))
    rec.update(distribution([r.e2e for r in done], "e2e"))
    mean_tpot = rec["tpot_mean_ms"]
    rec["interactivity_tok_s_per_user"] = 1000.0 / mean_tpot if mean_tpot else None
    tiers: dict[str, int] = {}
    for r in done:
        for tier, n in r.cached_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + n
    if tiers:
        rec["cache_hit_rate_by_tier"] = {t: n / inp if inp else 0.0 for t, n in sorted(tiers.items())}
    rec["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return rec


def append_jsonl(path: pathlib.Path, record: dict[str, Any]) -> None:
    """Append one JSON object as one line (the file and its folder are created as needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True, allow_nan=False,
                           default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def label_points(ax, xs: Iterable[float], ys: Iterable[float], labels: Iterable[str]) -> None:
    """Small text labels beside plotted points (matplotlib axes)."""
    for x, y, text in zip(xs, ys, labels):
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
