"""Multi-turn replay: prefix-cache hit rate and TTFT per KV format and cache tiers.

Sessions share a system prompt; every turn resends the whole history plus a new
user message, as agent loops do. All sessions run concurrently through Nibble's
in-process engine with a KV pool deliberately too small to keep every session
resident, so the formats differ in how much history survives. Modes: no prefix cache,
L1 (radix cache), L1+L2 (host pool, --hicache-ratio x L1 bytes), L1+L2+L3
(plus a file store).

    python -m nibble.bench.multiturn --sessions 8 --turns 4 --pool-tokens 6144 --out out/multiturn
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from nibble.kernels import PageLayout
from nibble.services.config import CacheConfig, HiCacheConfig, NibbleConfig, SchedulerConfig
from nibble.services.engine.builder import build_parts
from nibble.services.engine.types import GenerateRequest, SamplingParams


@dataclass
class Session:
    sid: int
    history: list[int]
    turns_left: int
    submitted_at: float = 0.0
    ttfts: list[float] = field(default_factory=list)


MODES = ("no-cache", "l1", "l1+l2", "l1+l2+l3")


def run_case(kv: str, mode: str, args, pool_bytes: int, geometry: PageLayout, l3_dir: str) -> dict:
    layout = PageLayout(kv, geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
                        geometry.page_size)
    tokens = pool_bytes // layout.page_nbytes * layout.page_size
    hc = HiCacheConfig(enable_hierarchical_cache=mode.startswith("l1+"),
                       hicache_ratio=args.hicache_ratio,
                       hicache_storage_backend="file" if mode == "l1+l2+l3" else "none",
                       hicache_storage_url=f"{l3_dir}/{kv}")
    cfg = NibbleConfig(cache=CacheConfig(kv_cache_dtype=kv, max_total_tokens=tokens,
                                         disable_radix_cache=mode == "no-cache"),
                       hicache=hc,
                       scheduler=SchedulerConfig(max_running_requests=args.sessions))
    radix = mode != "no-cache"
    core = build_parts(cfg).core
    rng = random.Random(args.seed)
    vocab = 40000
    system = [rng.randrange(100, vocab) for _ in range(args.system_len)]
    sessions = [Session(i, system + [rng.randrange(100, vocab) for _ in range(args.user_len)],
                        args.turns) for i in range(args.sessions)]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    by_rid, outputs = {}, {}
    t0 = time.perf_counter()

    def submit(s: Session) -> None:
        rid = f"s{s.sid}-t{args.turns - s.turns_left}"
        s.submitted_at = time.perf_counter()
        by_rid[rid], outputs[rid] = s, []
        core.add_request(GenerateRequest(rid, list(s.history), sp))

    for s in sessions:
        submit(s)
    prompt_total = cached_total = generated = 0
    with tqdm(total=args.sessions * args.turns, desc=f"{kv} {mode}", leave=False) as bar:
        while core.has_unfinished():
            for o in core.step():
                s = by_rid[o.request_id]
                if not outputs[o.request_id]:
                    s.ttfts.append(time.perf_counter() - s.submitted_at)
                outputs[o.request_id] += o.new_token_ids
                if not o.finished:
                    continue
                bar.update(1)
                prompt_total += o.usage.prompt_tokens
                cached_total += o.usage.cached_tokens
                generated += o.usage.completion_tokens
                s.turns_left -= 1
                if s.turns_left:
                    s.history += outputs[o.request_id] + [rng.randrange(100, vocab)
                                                          for _ in range(args.user_len)]
                    submit(s)
    wall = time.perf_counter() - t0
    ttfts = [t for s in sessions for t in s.ttfts]
    if core.tiers is not None:
        core.tiers.close()
    return {"kv": kv, "mode": mode, "radix": radix, "pool_tokens": tokens, "pool_bytes": pool_bytes,
            "cache_hit_rate": cached_total / prompt_total, "prompt_tokens": prompt_total,
            "cached_tokens": cached_total, "ttft_mean_s": statistics.mean(ttfts),
            "ttft_p50_s": statistics.median(ttfts), "output_tok_per_s": generated / wall,
            "wall_s": wall, "preemptions": core.scheduler.num_preemptions}


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['kv']}\n{r['mode']}" for r in results]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = ["tab:green" if r["kv"] == "nvfp4" else "tab:blue" for r in results]
    a1.bar(labels, [100 * r["cache_hit_rate"] for r in results], color=colors)
    a1.set_ylabel("prompt tokens served from cache (%)")
    a1.set_title("Cache hit rate, same pool bytes")
    a2.bar(labels, [r["ttft_mean_s"] for r in results], color=colors)
    a2.set_ylabel("mean TTFT (s)")
    a2.set_title("Time to first token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--pool-tokens", type=int, default=4096,
                   help="pool size in fp8_e4m3 tokens; every format gets the same bytes")
    p.add_argument("--kv", nargs="+", default=["nvfp4", "fp8_e4m3"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/multiturn")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    probe = build_parts(NibbleConfig(cache=CacheConfig(kv_cache_dtype="fp8_e4m3",
                                                       max_total_tokens=16))).core.pool.layout
    pool_bytes = int(args.pool_tokens * probe.bytes_per_token)
    results = []
    with tempfile.TemporaryDirectory() as l3_dir:
        for kv in args.kv:
            for mode in args.modes:
                results.append(run_case(kv, mode, args, pool_bytes, probe, l3_dir))
                print(json.dumps(results[-1]))
    (out / "multiturn.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "multiturn.png")
    print(f"{'kv':<10}{'mode':>10}{'pool tok':>10}{'hit rate':>10}{'TTFT mean':>11}{'TTFT p50':>10}{'out tok/s':>10}")
    for r in results:
        print(f"{r['kv']:<10}{r['mode']:>10}{r['pool_tokens']:>10}"
              f"{100 * r['cache_hit_rate']:>9.1f}%{r['ttft_mean_s']:>10.2f}s{r['ttft_p50_s']:>9.2f}s"
              f"{r['output_tok_per_s']:>10.1f}")


if __name__ == "__main__":
    main()
