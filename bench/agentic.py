"""Agentic multi-turn benchmark: synthetic agent sessions through the OpenAI gateway.

A session starts from a system prompt shared by all sessions plus its own user message;
each later turn resends the whole history grown by the previous reply and a tool output
(``--tool-len MIN MAX``, uniform or log-normal), after a think time (exponential, mean
``--think-time``). ``--concurrency`` sessions run at once (their first starts staggered
over ``--stagger``), each slot running ``--sessions-per-slot`` sessions back to back.
Token-id prompts through streaming /v1/completions; the reply enters the history as
``--output-len`` placeholder ids (the completions API returns text, not ids), so a turn
can reuse the previous turn's prompt, not its reply.

Per server config and concurrency: the input-token cache hit rate (overall, and per tier
from usage's ``cached_tokens_by_tier``; the server's Prometheus counters are recorded beside
it), TTFT, output throughput, interactivity. One JSON object per run appended to ``--output-file``; plots
beside it. The pool size is part of ``--server-args`` (``--max-total-tokens``), so a small
pool shows what a 1.78x larger one in the same bytes (NVFP4 vs FP8) keeps.

    nibble bench agentic --concurrency 1 2 4 8 \\
        --server-args "--kv-cache-dtype fp8_e4m3 --max-total-tokens 4096" \\
        --server-args "--kv-cache-dtype nvfp4 --max-total-tokens 7280" \\
        --output-file out/agentic/agentic.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
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
from ._http import (RequestResult, StatsSampler, completion_body, context_length,
                    counter_deltas, flush_cache, probe_vocab_size, scrape_counters, server_info,
                    stream_completion)
from ._server import add_server_options, for_each_server
from ._stats import append_jsonl, summarize
from .serving import capacity_from_info, token_range


# ---------------------------------------------------------------- workload (pure)

@dataclass(frozen=True)
class AgentWorkload:
    system_len: int = 512
    user_len: int = 64
    tool_len: tuple[int, int] = (200, 4000)
    tool_dist: str = "lognormal"          # uniform | lognormal (median = geometric mean)
    output_len: int = 64
    turns: int = 8
    think_time: float = 2.0               # mean seconds (exponential); 0 = none
    stagger: float = 5.0                  # first sessions start uniformly within this many s
    start_ratio: float = 0.0              # first session of a slot may start this far in
    seed: int = 0


def tool_lengths(rng: np.random.Generator, n: int, lo: int, hi: int, dist: str) -> list[int]:
    """``n`` tool-output lengths in [lo, hi]: uniform, or log-normal with median sqrt(lo*hi)
    and sigma ln(hi/lo)/4 (so [lo, hi] spans +-2 sigma), clipped."""
    if dist == "uniform":
        return rng.integers(lo, hi + 1, size=n).tolist()
    if dist != "lognormal":
        raise ConfigError(f"--tool-dist must be uniform or lognormal, got {dist!r}")
    sigma = max(math.log(hi / lo) / 4, 1e-9)
    vals = rng.lognormal(math.log(math.sqrt(lo * hi)), sigma, size=n)
    return np.clip(np.rint(vals), lo, hi).astype(int).tolist()


@dataclass(frozen=True)
class SessionPlan:
    """One session's requests, precomputed. ``prompts[t]`` is turn t's whole prompt (ids)."""

    sid: int
    prompts: list[list[int]]
    thinks: list[float]                   # pause after turn t (len = len(prompts) - 1)
    start_delay: float                    # before the first turn
    first_turn: int                       # index of prompts[0] in the full trajectory


def plan_session(sid: int, w: AgentWorkload, system: list[int], lo: int, hi: int,
                 context: int, start_delay: float = 0.0, may_start_late: bool = False
                 ) -> SessionPlan:
    """The session's trajectory, cut where the next prompt + reply would exceed ``context``."""
    rng = np.random.default_rng([w.seed, sid])
    history = system + rng.integers(lo, hi, size=w.user_len).tolist()
    tools = tool_lengths(rng, w.turns, *w.tool_len, w.tool_dist)
    prompts = []
    for t in range(w.turns):
        if len(history) + w.output_len > context:
            break
        prompts.append(list(history))
        reply = rng.integers(lo, hi, size=w.output_len).tolist()      # placeholder for the reply
        history += reply + rng.integers(lo, hi, size=tools[t]).tolist()
    if not prompts:
        raise ConfigError(f"the first prompt ({len(history)} tokens) + --output-len does not fit "
                          f"the context ({context})")
    first = 0
    if may_start_late and w.start_ratio > 0:
        first = int(rng.integers(0, int(w.start_ratio * (len(prompts) - 1)) + 1))
    thinks = rng.exponential(w.think_time, size=len(prompts)).tolist() if w.think_time > 0 \
        else [0.0] * len(prompts)
    return SessionPlan(sid, prompts[first:], thinks[first:-1], start_delay, first)


def plan_level(concurrency: int, sessions_per_slot: int, w: AgentWorkload, lo: int, hi: int,
               context: int) -> list[list[SessionPlan]]:
    """Per slot, its sessions in order. Slot j's first session starts at ``stagger * j / C``;
    the shared system prompt comes from the seed alone."""
    system = np.random.default_rng([w.seed, 1 << 30]).integers(lo, hi, size=w.system_len).tolist()
    slots = []
    for j in range(concurrency):
        slots.append([plan_session(j + k * concurrency, w, system, lo, hi, context,
                                   w.stagger * j / concurrency if k == 0 else 0.0,
                                   may_start_late=k == 0)
                      for k in range(sessions_per_slot)])
    return slots


def hit_rates_by_turn(turns: list[tuple[int, RequestResult]]) -> dict[str, float]:
    """Hit rate of sessions' first requests (turn 0) and of their later requests."""
    def rate(rs: list[RequestResult]) -> float:
        prompt = sum(r.prompt_tokens for r in rs)
        return sum(r.cached_tokens for r in rs) / prompt if prompt else 0.0
    ok = [(t, r) for t, r in turns if r.ok]
    return {"hit_rate_first_turn": rate([r for t, r in ok if t == 0]),
            "hit_rate_later_turns": rate([r for t, r in ok if t > 0])}


def server_tier_rates(deltas: dict[str, float], page_size: int) -> dict[str, float]:
    """Per-tier rates from the server's counters: tier hit pages x page size / prompt tokens.

    A cross-check only: the server counts L1 hit pages at every admission attempt, so a
    request that waits for room is counted again each step (the per-request
    ``cached_tokens_by_tier`` in usage is exact; "all" here is exact too)."""
    prompt = deltas.get("nibble:prompt_tokens", 0.0)
    out = {}
    for key, val in deltas.items():
        if key.startswith("nibble:tier_hit_pages{tier="):
            tier = key.split("=", 1)[1].rstrip("}")
            out[tier] = val * page_size / prompt if prompt else 0.0
    if prompt:
        out["all"] = deltas.get("nibble:cached_tokens", 0.0) / prompt
    return out


# ---------------------------------------------------------------- running

async def _run_slot(client: httpx.AsyncClient, url: str, plans: list[SessionPlan], salt: str,
                    output_len: int, bar: tqdm) -> list[tuple[int, RequestResult]]:
    out = []
    for plan in plans:
        await asyncio.sleep(plan.start_delay)
        for t, prompt in enumerate(plan.prompts):
            res = await stream_completion(client, url, completion_body(prompt, output_len, salt))
            out.append((t, res))
            bar.update(1)
            if not res.ok:
                break                     # a broken session stops; its error is counted
            if t < len(plan.thinks):
                await asyncio.sleep(plan.thinks[t])
    return out


async def _run_level(url: str, slots: list[list[SessionPlan]], salt: str, output_len: int,
                     desc: str, sample_s: float):
    n = sum(len(p.prompts) for plans in slots for p in plans)
    limits = httpx.Limits(max_connections=len(slots) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30)) as client:
        sampler = StatsSampler(client, url, sample_s)
        sampler.start()
        with tqdm(total=n, desc=desc, leave=False) as bar:
            t0 = time.perf_counter()
            per_slot = await asyncio.gather(*(_run_slot(client, url, plans, salt, output_len, bar)
                                              for plans in slots))
            duration = time.perf_counter() - t0
        samples = await sampler.stop()
    return [x for s in per_slot for x in s], duration, samples


def run_level(url: str, args, w: AgentWorkload, label: str, concurrency: int, lo: int, hi: int,
              context: int, run_id: str) -> dict[str, Any]:
    slots = plan_level(concurrency, args.sessions_per_slot, w, lo, hi, context)
    flush_cache(url)
    info = server_info(url)
    before = scrape_counters(url)
    turns, duration, samples = asyncio.run(_run_level(
        url, slots, f"{run_id}-c{concurrency}", w.output_len, f"{label} c={concurrency}",
        args.sample_interval))
    deltas = counter_deltas(before, scrape_counters(url))
    results = [r for _, r in turns]
    cap = capacity_from_info(info)
    rec: dict[str, Any] = {
        "bench": "agentic", "run_id": run_id, "label": label,
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "concurrency": concurrency, "sessions": concurrency * args.sessions_per_slot,
        "requests": len(results), "workload": {**asdict(w), "tool_len": list(w.tool_len)},
        "num_gpus": args.num_gpus, **summarize(results, duration, args.num_gpus),
        **hit_rates_by_turn(turns),
        "server_counters": deltas,
        "server_hit_rate_by_tier": server_tier_rates(deltas, cap.page_size if cap else 1),
        "peak_running": max((s.num_running for s in samples), default=None),
        "peak_token_usage": max((s.token_usage for s in samples), default=None),
        "preemptions": deltas.get("nibble:num_preemptions"),
    }
    if cap is not None:
        rec["server"] = asdict(cap)
    return rec


def sweep(url: str, args, w: AgentWorkload, label: str, server_args: str | None, run_id: str,
          out: pathlib.Path) -> list[dict[str, Any]]:
    vocab = args.vocab_size or probe_vocab_size(url)
    lo, hi = token_range(vocab, args.min_token_id, args.reserved_top_ids)
    context = args.context_length or context_length(url)
    if context is None:
        raise ConfigError("the server does not report its context length; pass --context-length")
    records = []
    for c in sorted(set(args.concurrency)):
        rec = run_level(url, args, w, label, c, lo, hi, context, run_id)
        rec["server_args"] = server_args
        append_jsonl(out, rec)
        records.append(rec)
        print_record(rec)
    return records


# ---------------------------------------------------------------- reporting

def print_record(r: dict[str, Any]) -> None:
    tiers = r.get("cache_hit_rate_by_tier") or {}
    tier_txt = " ".join(f"{k}={100 * v:.1f}%" for k, v in sorted(tiers.items()))
    print(f"{r['label']:<26} c={r['concurrency']:<3} req={r['completed']}/{r['requests']} "
          f"hit={100 * r['cache_hit_rate']:.1f}% (later turns {100 * r['hit_rate_later_turns']:.1f}%"
          f"; {tier_txt})  out={r['output_throughput']:.1f} tok/s  TTFT p50="
          f"{(r['ttft_median_ms'] or 0) / 1e3:.2f}s  interactivity="
          f"{r['interactivity_tok_s_per_user'] or 0:.1f} tok/s/user  preempt={r['preemptions']}",
          flush=True)


def report(records: list[dict[str, Any]], w: AgentWorkload, out: pathlib.Path) -> None:
    stem = out.with_suffix("")
    title = (f"agentic: system {w.system_len}, tool {w.tool_len[0]}-{w.tool_len[1]} ({w.tool_dist}), "
             f"out {w.output_len}, {w.turns} turns, think {w.think_time}s")
    _plots.against_concurrency(records, pathlib.Path(f"{stem}_perf.png"), title, [
        ("output_throughput_per_gpu", "output tok/s per GPU", 1.0),
        ("interactivity_tok_s_per_user", "interactivity (tok/s per user)", 1.0),
        ("ttft_median_ms", "median TTFT (s)", 1e-3)])
    panels = [("cache_hit_rate", "input-token cache hit rate (%)", 100.0),
              ("hit_rate_later_turns", "hit rate, turns 2+ (%)", 100.0)]
    tiers = sorted({t for r in records for t, v in (r.get("cache_hit_rate_by_tier") or {}).items()
                    if t in ("l2", "l3") and v > 0})
    panels += [(f"cache_hit_rate_by_tier.{t}", f"hit rate from {t.upper()} (%)", 100.0)
               for t in tiers]
    _plots.against_concurrency(records, pathlib.Path(f"{stem}_hit_rate.png"), title, panels)
    print(f"wrote {out}, {stem}_perf.png, {stem}_hit_rate.png")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nibble bench agentic", description=__doc__.splitlines()[0])
    add_server_options(p)
    d = AgentWorkload()
    g = p.add_argument_group("sessions")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    g.add_argument("--sessions-per-slot", type=int, default=2)
    g.add_argument("--system-len", type=int, default=d.system_len)
    g.add_argument("--user-len", type=int, default=d.user_len)
    g.add_argument("--tool-len", type=int, nargs=2, default=list(d.tool_len), metavar=("MIN", "MAX"))
    g.add_argument("--tool-dist", choices=["uniform", "lognormal"], default=d.tool_dist)
    g.add_argument("--output-len", type=int, default=d.output_len)
    g.add_argument("--turns", type=int, default=d.turns)
    g.add_argument("--think-time", type=float, default=d.think_time, help="mean s between turns")
    g.add_argument("--stagger", type=float, default=d.stagger, help="s over which sessions start")
    g.add_argument("--start-ratio", type=float, default=d.start_ratio,
                   help="a slot's first session starts up to this fraction into its trajectory")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--vocab-size", type=int, default=None, help="default: asked from the server")
    g.add_argument("--context-length", type=int, default=None, help="default: /v1/models")
    g.add_argument("--min-token-id", type=int, default=128)
    g.add_argument("--reserved-top-ids", type=int, default=1024)
    g = p.add_argument_group("output")
    g.add_argument("--num-gpus", type=int, default=1)
    g.add_argument("--sample-interval", type=float, default=0.5)
    g.add_argument("--output-file", default="out/agentic/agentic.jsonl")
    return p


def workload(args) -> AgentWorkload:
    lo, hi = args.tool_len
    if not 0 < lo <= hi:
        raise ConfigError("--tool-len needs 0 < MIN <= MAX")
    return AgentWorkload(args.system_len, args.user_len, (lo, hi), args.tool_dist, args.output_len,
                         args.turns, args.think_time, args.stagger, args.start_ratio, args.seed)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    w = workload(args)
    out = pathlib.Path(args.output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")

    def one_config(url: str, label: str, server_args: str | None, i: int) -> list[dict]:
        if not label:
            cap = capacity_from_info(server_info(url))
            label = cap.kv_format if cap is not None else "server"
        return sweep(url, args, w, label, server_args, f"{run_id}-{i}", out)

    records = for_each_server(args.base_url, args.server_args, args.labels, out.parent, out.stem,
                              one_config)
    if records:
        report(records, w, out)
    return records


if __name__ == "__main__":
    main()
