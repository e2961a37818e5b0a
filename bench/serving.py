"""Online serving benchmark (like SGLang's bench_serving) through the OpenAI gateway.

Random token-id prompts of a fixed input length, a fixed output length (EOS ignored),
streamed from ``/v1/completions``; Poisson arrivals (``--request-rate``, inf = all at
once) under a cap of ``--max-concurrency`` requests in flight. Reports TTFT, ITL, TPOT
(mean, median, p99), request / input / output throughput and achieved concurrency, and
appends one JSON object per run to ``--output-file``; plots land beside it.

Either targets a running server (``--base-url``) or starts ``nibble serve`` once per
``--server-args`` (repeatable: one config each) on a free loopback port.

- ``--mode iso-concurrency``: every config runs the same concurrency levels.
- ``--mode iso-capacity``: per config, concurrency rises through ``--concurrency`` until
  requests queue for KV pages (the server's /get_server_info: a request waits while the
  pool cannot hold one more whole request, or requests get preempted); the highest level
  that fits is that config's capacity.

    nibble bench serving --mode iso-capacity --input-len 256 --output-len 32 \\
        --server-args "--kv-cache-dtype fp8_e4m3 --max-total-tokens 2048" \\
        --server-args "--kv-cache-dtype nvfp4 --max-total-tokens 3632" \\
        --concurrency 1 2 4 8 16 --output-file out/serving/serving.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import pathlib
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from nibble.services.errors import ConfigError

from . import _plots
from ._http import StatsSample, StatsSampler, completion_body, server_info, stream_completion
from ._http import flush_cache, probe_vocab_size
from ._server import BenchServerError, add_server_options, for_each_server, step_trace_path
from ._step_trace import scrape_steps, step_deltas, summarize_trace
from ._stats import append_jsonl, summarize

ISO_CAPACITY_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# ---------------------------------------------------------------- workload (pure)

def token_range(vocab_size: int, min_id: int, reserved_top: int) -> tuple[int, int]:
    """Half-open id range for random prompts: skips the lowest ids and the top ``reserved_top``
    (where tokenizer families put their special tokens)."""
    lo, hi = min_id, vocab_size - reserved_top
    if hi - lo < 2:
        raise ConfigError(f"no token ids left between {lo} and {hi} (vocab {vocab_size})")
    return lo, hi


def random_prompts(n: int, input_len: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``input_len`` ids uniform in [lo, hi); the same seed gives the same ids."""
    rng = np.random.default_rng(seed)
    return rng.integers(lo, hi, size=(n, input_len)).tolist()


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start): Poisson arrivals at ``rate`` req/s; inf = all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ConfigError("--request-rate must be > 0 (inf = all at once)")
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# ---------------------------------------------------------------- KV capacity (pure)

@dataclass(frozen=True)
class KVCapacity:
    """What /get_server_info says about the KV pool and the batch cap."""

    kv_format: str
    page_size: int
    total_pages: int
    max_total_tokens: int
    pool_bytes: int
    bytes_per_token: float
    max_running_requests: int

    def request_pages(self, input_len: int, output_len: int) -> int:
        return -(-(input_len + output_len) // self.page_size)

    def kv_slots(self, input_len: int, output_len: int) -> int:
        """Whole requests the pool holds at once (admission reserves every future page)."""
        return self.total_pages // self.request_pages(input_len, output_len)


def capacity_from_info(info: dict[str, Any]) -> KVCapacity | None:
    cap, sched = info.get("capacity"), (info.get("config") or {}).get("scheduler") or {}
    if not cap:
        return None
    return KVCapacity(cap["kv_format"], int(cap["page_size"]), int(cap["num_pages"]),
                      int(cap["max_tokens"]), int(cap["pool_bytes"]), float(cap["bytes_per_token"]),
                      int(sched.get("max_running_requests", 1 << 30)))


@dataclass(frozen=True)
class Verdict:
    """How one run at a concurrency level used the server (from sampled stats).

    status: ``fits`` (every offered request was resident), ``kv_full`` (requests waited
    for KV pages, or were preempted), ``batch_cap`` (``--max-running-requests`` bound first).
    """

    status: str
    peak_running: int
    mean_running: float
    kv_queued_samples: int
    samples: int
    preemptions: int
    peak_token_usage: float


def judge_level(samples: list[StatsSample], concurrency: int, cap: KVCapacity,
                input_len: int, output_len: int, preemptions: int,
                min_queued_samples: int = 2) -> Verdict:
    """Classify a run. A sample queues for KV when requests wait while the running ones already
    claim the pool: ``(running + 1) * request_pages > total_pages``."""
    pages = cap.request_pages(input_len, output_len)
    kv_q = sum(1 for s in samples if s.num_queued > 0
               and (s.num_running + 1) * pages > cap.total_pages)
    capped = any(s.num_queued > 0 and s.num_running >= cap.max_running_requests for s in samples)
    peak = max((s.num_running for s in samples), default=0)
    if preemptions > 0 or kv_q >= min_queued_samples:
        status = "kv_full"
    elif capped and concurrency > cap.max_running_requests:
        status = "batch_cap"
    else:
        status = "fits"
    mean = float(np.mean([s.num_running for s in samples])) if samples else 0.0
    usage = max((s.token_usage for s in samples), default=0.0)
    return Verdict(status, peak, mean, kv_q, len(samples), preemptions, usage)


# ---------------------------------------------------------------- running

async def _run_requests(url: str, prompts: list[list[int]], output_len: int, concurrency: int,
                        offsets: list[float], salt: str, temperature: float, desc: str,
                        sample_s: float) -> tuple[list, float, list[StatsSample]]:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30)) as client:
        sampler = StatsSampler(client, url, sample_s)
        sem = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(prompts), desc=desc, leave=False)
        t0 = time.perf_counter()

        async def one(i: int):
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            async with sem:
                res = await stream_completion(client, url, completion_body(
                    prompts[i], output_len, f"{salt}-{i}", temperature))
            bar.update(1)
            return res

        sampler.start()
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        duration = time.perf_counter() - t0
        samples = await sampler.stop()
        bar.close()
    return list(results), duration, samples


def run_level(url: str, args, label: str, concurrency: int, cap: KVCapacity | None,
              token_lo: int, token_hi: int, run_id: str) -> dict[str, Any]:
    """One run at one concurrency level; returns its JSONL record."""
    n = max(args.num_prompts, concurrency * args.prompts_per_concurrency, concurrency)
    prompts = random_prompts(n, args.input_len, token_lo, token_hi, args.seed)
    offsets = arrival_offsets(n, args.request_rate, args.seed)
    flush_cache(url)
    before = (server_info(url).get("stats") or {}).get("num_preemptions", 0)
    steps_before = scrape_steps(url)
    results, duration, samples = asyncio.run(_run_requests(
        url, prompts, args.output_len, concurrency, offsets, f"{run_id}-c{concurrency}",
        args.temperature, f"{label} c={concurrency}", args.sample_interval))
    after = (server_info(url).get("stats") or {}).get("num_preemptions", 0)
    steps = step_deltas(steps_before, scrape_steps(url))
    rec: dict[str, Any] = {
        "bench": "serving", "run_id": run_id, "label": label, "mode": args.mode,
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "concurrency": concurrency, "num_prompts": n,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
        "temperature": args.temperature, "token_range": [token_lo, token_hi],
        "num_gpus": args.num_gpus, **summarize(results, duration, args.num_gpus)}
    if steps:
        rec["steps"] = steps     # the server's step intervals by kind during this run
    if cap is not None:
        rec["server"] = {**asdict(cap), "kv_slots": cap.kv_slots(args.input_len, args.output_len)}
        rec["kv"] = asdict(judge_level(samples, concurrency, cap, args.input_len,
                                       args.output_len, after - before))
    return rec


def warm_up(url: str, args, lo: int, hi: int, run_id: str) -> None:
    if args.warmup_requests <= 0:
        return
    prompts = random_prompts(args.warmup_requests, args.input_len, lo, hi, args.seed + 7)
    results, _, _ = asyncio.run(_run_requests(
        url, prompts, args.output_len, args.warmup_requests, [0.0] * len(prompts),
        f"{run_id}-warmup", args.temperature, "warm-up", 1.0))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise BenchServerError(f"warm-up requests failed: {failed[0]}")


def sweep(url: str, args, label: str, server_args: str | None, run_id: str,
          out: pathlib.Path) -> list[dict[str, Any]]:
    """All levels of one config against a healthy server; iso-capacity stops at the first
    level that does not fit."""
    info = server_info(url)
    cap = capacity_from_info(info)
    if args.mode == "iso-capacity" and cap is None:
        raise ConfigError("iso-capacity needs the server's /get_server_info capacity and stats")
    if cap is not None and cap.kv_slots(args.input_len, args.output_len) < 1:
        raise ConfigError(f"one request ({args.input_len}+{args.output_len} tokens) does not fit "
                          f"the KV pool ({cap.max_total_tokens} tokens)")
    vocab = args.vocab_size or probe_vocab_size(url)
    lo, hi = token_range(vocab, args.min_token_id, args.reserved_top_ids)
    warm_up(url, args, lo, hi, run_id)
    records = []
    for c in levels(args):
        rec = run_level(url, args, label, c, cap, lo, hi, run_id)
        rec["server_args"] = server_args
        append_jsonl(out, rec)
        records.append(rec)
        print_record(rec)
        if args.mode == "iso-capacity" and rec["kv"]["status"] != "fits":
            break
    return records


def levels(args) -> list[int]:
    if args.concurrency:
        return sorted(set(args.concurrency))
    return list(ISO_CAPACITY_LEVELS) if args.mode == "iso-capacity" else [args.max_concurrency]


# ---------------------------------------------------------------- reporting

def capacity_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config: the highest level that fit and its numbers, with ratios to the first config."""
    rows = []
    for label, rs in _plots.by_label(records).items():
        fit = [r for r in rs if r.get("kv", {}).get("status", "fits") == "fits"]
        best = fit[-1] if fit else None
        stop = next((r for r in rs if r.get("kv", {}).get("status", "fits") != "fits"), None)
        rows.append({"label": label, "max_fitting_concurrency": best["concurrency"] if best else 0,
                     "stopped_by": stop["kv"]["status"] if stop else None,
                     "max_resident_requests": max((r.get("kv") or {}).get("peak_running", 0)
                                                  for r in rs),
                     "kv_slots": (rs[0].get("server") or {}).get("kv_slots"),
                     "max_total_tokens": (rs[0].get("server") or {}).get("max_total_tokens"),
                     "pool_bytes": (rs[0].get("server") or {}).get("pool_bytes"),
                     "output_throughput": best["output_throughput"] if best else None,
                     "ttft_mean_ms": best["ttft_mean_ms"] if best else None,
                     "tpot_mean_ms": best["tpot_mean_ms"] if best else None})
    base = rows[0] if rows else None
    for row in rows:
        row["baseline"] = base["label"]
        for key in ("max_fitting_concurrency", "output_throughput", "ttft_mean_ms"):
            if base[key] and row[key] is not None:
                row[f"{key}_ratio"] = row[key] / base[key]
    return rows


def headline(records: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """The run each config is judged by: its highest level (iso-concurrency) or its highest
    level that fit (iso-capacity)."""
    out = []
    for rs in _plots.by_label(records).values():
        fit = [r for r in rs if r.get("kv", {}).get("status", "fits") == "fits"]
        out.append((fit or rs)[-1] if mode == "iso-capacity" else rs[-1])
    return out


def print_record(r: dict[str, Any]) -> None:
    kv = r.get("kv") or {}
    print(f"{r['label']:<28} c={r['concurrency']:<4} ok={r['completed']}/{r['num_prompts']} "
          f"out={r['output_throughput']:.1f} tok/s  TTFT mean/p99={r['ttft_mean_ms'] or 0:.0f}/"
          f"{r['ttft_p99_ms'] or 0:.0f} ms  TPOT={r['tpot_mean_ms'] or 0:.1f} ms  "
          f"conc={r['achieved_concurrency']:.2f}  peak_running={kv.get('peak_running')}  "
          f"kv={kv.get('status')}", flush=True)


def report(records: list[dict[str, Any]], args, out: pathlib.Path) -> None:
    title = (f"{args.input_len} in / {args.output_len} out, {args.mode}, "
             f"rate={args.request_rate}")
    stem = out.with_suffix("")
    _plots.pareto(records, pathlib.Path(f"{stem}_pareto.png"), title)
    _plots.bars(headline(records, args.mode), pathlib.Path(f"{stem}_bars.png"), title)
    summary = capacity_summary(records)
    pathlib.Path(f"{stem}_summary.json").write_text(json.dumps(summary, indent=2))
    for row in summary:
        print(json.dumps(row))
    print(f"wrote {out}, {stem}_pareto.png, {stem}_bars.png, {stem}_summary.json")


# ---------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nibble bench serving", description=__doc__.splitlines()[0])
    add_server_options(p)
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=1024)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--prompts-per-concurrency", type=int, default=0,
                   help="at least this many prompts per unit of concurrency")
    g.add_argument("--request-rate", type=float, default=float("inf"))
    g.add_argument("--max-concurrency", type=int, default=8)
    g.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help=f"levels to run (iso-capacity default: {' '.join(map(str, ISO_CAPACITY_LEVELS))})")
    g.add_argument("--mode", choices=["iso-concurrency", "iso-capacity"], default="iso-concurrency")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--warmup-requests", type=int, default=1)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--vocab-size", type=int, default=None, help="default: asked from the server")
    g.add_argument("--min-token-id", type=int, default=128)
    g.add_argument("--reserved-top-ids", type=int, default=1024,
                   help="top ids left out of prompts (special tokens)")
    g = p.add_argument_group("output")
    g.add_argument("--num-gpus", type=int, default=1, help="divides throughput for per-GPU figures")
    g.add_argument("--sample-interval", type=float, default=0.2, help="s between server stats polls")
    g.add_argument("--output-file", default="out/serving/serving.jsonl")
    return p


def external_label(url: str) -> str:
    cap = capacity_from_info(server_info(url))
    return cap.kv_format if cap is not None else "server"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    out = pathlib.Path(args.output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")

    def one_config(url: str, label: str, server_args: str | None, i: int) -> list[dict]:
        return sweep(url, args, label or external_label(url), server_args, f"{run_id}-{i}", out)

    records = for_each_server(args.base_url, args.server_args, args.labels, out.parent, out.stem,
                              one_config, step_trace=True)
    if records:
        report(records, args, out)
        report_traces(records, out)
    return records


def report_traces(records: list[dict[str, Any]], out: pathlib.Path) -> None:
    """Per started server, its step trace's summary (warm-up included): the slowest steps
    and what they ran, into ``<stem>_steps.json`` and on the console."""
    labels = {}
    for r in records:
        labels.setdefault(int(r["run_id"].rsplit("-", 1)[1]), r["label"])
    summaries = {}
    for i, label in sorted(labels.items()):
        got = summarize_trace(step_trace_path(out.parent, out.stem, i))
        if got is None:
            continue
        summaries[label] = got
        kinds = "  ".join(f"{k}: n={v['count']} p50={v['p50_ms']:.1f} p99={v['p99_ms']:.1f} "
                          f"max={v['max_ms']:.1f} ms" for k, v in got["kinds"].items())
        print(f"steps {label}: {kinds}")
        if "pauses" in got:
            print(f"  pauses: {json.dumps(got['pauses'])}")
        for st in got["slowest"][:3]:
            print(f"  slow step: {json.dumps(st)}")
    if summaries:
        path = out.with_suffix("").with_name(out.stem + "_steps.json")
        path.write_text(json.dumps(summaries, indent=2))


if __name__ == "__main__":
    main()
