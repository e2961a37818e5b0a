"""TTFT of a long shared prefix served from each tier, against recomputing it.

One request with a ``--prefix-len``-token prefix runs cold (recompute), then
again with the prefix in L1, in L2 only (L1 flushed), and in L3 only (L1 and L2
flushed), for the file backend and Redis. Nibble's in-process engine, default
model, KV format per ``--kv``.

    python -m nibble.bench.tier_ttft --prefix-len 2048 --kv nvfp4 fp8_e4m3 --out out/tier_ttft
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import tempfile
import time

from nibble.services.config import CacheConfig, HiCacheConfig, NibbleConfig
from nibble.services.engine.builder import build_parts
from nibble.services.engine.types import GenerateRequest, SamplingParams


def ttft(core, prompt, rid) -> tuple[float, dict]:
    core.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0)))
    t0 = time.perf_counter()
    first, usage = None, None
    while core.has_unfinished():
        for o in core.step():
            first = first or time.perf_counter() - t0
            usage = o.usage
    return first, usage.cached_by_tier or {}


def run(kv: str, backend: str, url: str | None, args) -> list[dict]:
    hc = HiCacheConfig(enable_hierarchical_cache=True, hicache_storage_backend=backend,
                       hicache_storage_url=url, hicache_prefetch_policy="wait_complete",
                       hicache_storage_prefix=f"nibble:bench:{random.getrandbits(32):x}:")
    parts = build_parts(NibbleConfig(cache=CacheConfig(kv_cache_dtype=kv, max_total_tokens=16384),
                                     hicache=hc))
    core, tiers = parts.core, parts.core.tiers
    rng = random.Random(0)
    ttft(core, [rng.randrange(100, 40000) for _ in range(64)], "warmup")
    core.flush_cache()
    rows = []
    for rep in range(args.repeats):
        prompt = [rng.randrange(100, 40000) for _ in range(args.prefix_len + 1)]
        cold, _ = ttft(core, prompt, f"cold{rep}")
        tiers.drain(60)
        l1, _ = ttft(core, prompt, f"l1-{rep}")
        core.cache.flush()
        l2, by2 = ttft(core, prompt, f"l2-{rep}")
        core.cache.flush()
        tiers.host.clear()
        l3, by3 = ttft(core, prompt, f"l3-{rep}")
        assert by2.get("l2", 0) > 0 and by3.get("l3", 0) > 0, (by2, by3)
        rows.append({"cold": cold, "l1": l1, "l2": l2, "l3": l3})
        core.flush_cache()
    if backend == "redis":
        tiers.storage.clear()
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return [{"kv": kv, "l3_backend": backend, "source": k, "ttft_s": v,
             "prefix_len": args.prefix_len} for k, v in out.items()]


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["kv"], r["l3_backend"]) for r in results})
    sources = ["cold", "l1", "l2", "l3"]
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(groups)
    for i, g in enumerate(groups):
        vals = [next(r["ttft_s"] for r in results if (r["kv"], r["l3_backend"]) == g
                     and r["source"] == s) for s in sources]
        ax.bar([j + i * w for j in range(len(sources))], vals, w, label=f"{g[0]}, L3={g[1]}")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(sources))],
                  ["recompute", "L1 hit", "L2 hit", "L3 hit"])
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"TTFT of a {results[0]['prefix_len']}-token prefix by where it lives")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--kv", nargs="+", default=["nvfp4", "fp8_e4m3"])
    p.add_argument("--l3", nargs="+", default=["file", "redis"])
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="out/tier_ttft")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kv in args.kv:
            for backend in args.l3:
                url = args.redis_url if backend == "redis" else f"{tmp}/{kv}"
                results += run(kv, backend, url, args)
    (out / "tier_ttft.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "tier_ttft.png")
    print(f"{'kv':<10}{'L3':<7}{'recompute':>10}{'L1':>9}{'L2':>9}{'L3':>9}   (TTFT, s)")
    for kv in args.kv:
        for b in args.l3:
            v = {r["source"]: r["ttft_s"] for r in results if r["kv"] == kv and r["l3_backend"] == b}
            print(f"{kv:<10}{b:<7}{v['cold']:>10.3f}{v['l1']:>9.3f}{v['l2']:>9.3f}{v['l3']:>9.3f}")


if __name__ == "__main__":
    main()
