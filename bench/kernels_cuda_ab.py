"""A/B runs of the CUDA decode variants (issue 17): checks, timings, decode/reduce kernel times.

A lighter companion of ``bench/kernels_cuda.py`` for comparing trees and variants on one
device: it checks every variant against the fp32 reference (same four cases), measures the
read ceiling, then times only the CUDA kernels (CUDA-graph replay, do_bench median, 1 and 2
waves of split CTAs) on the chosen cases, optionally SDPA, and with ``--profile`` the decode
and reduce kernels' own durations (torch.profiler, 20 plain calls, one wave of splits) at
(1, 131072) and (8, 32768). Run it from a tree's root with ``nibble`` mapped onto that tree
(two trees in one session give a same-machine before/after)::

    python3 bench/kernels_cuda_ab.py --tag new --cases 0,1,3 --variants 10424,10404 \\
        --fp8 110602 --profile 10424,110602 [--combine fused,kernel] \\
        [--profile-fmts nvfp4,fp8_e4m3] [--sdpa] [--sass]

JSON to ``$OUT/k17_<tag>.json`` (``--sass``: also ``$OUT/sass_<tag>.txt``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from nibble.bench import kernels as tk  # noqa: E402
from nibble.bench import kernels_cuda as kc  # noqa: E402
from nibble.kernels.cuda import decode as cd  # noqa: E402

CHECKS = ((16, 4, [1, 15, 16, 17, 2999, 40000], 1), (64, 4, [63, 3000, 9000], 2),
          (32, 8, [500, 5], 3), (16, 2, [1234], 4))


def kernel_times(layout, view, case: tuple, variant: int, combine: str = "kernel") -> dict:
    """Mean device time of the decode and reduce kernels over 20 plain calls."""
    b, ctx, hq, h, d, s = case
    tables, lens, _ = tk.tables_for([ctx] * b, s, seed=ctx + b)
    q = torch.randn((b, hq, d), device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ns = cd.default_num_splits(b, h, ctx, q.device, variant, 1)

    def fn():
        cd.decode_attention_cuda(layout, view, q, tables, lens, d ** -0.5, tk.ONE, tk.ONE,
                                 out=out, num_splits=ns, variant=variant, combine=combine)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    us = {}
    for e in prof.key_averages():
        if "decode_kernel" in e.key or "reduce_kernel" in e.key:
            us["decode" if "decode" in e.key else "reduce"] = e.device_time_total / max(e.count, 1)
    return {"variant": variant, "splits": ns, "combine": combine, "us": us}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", required=True)
    ap.add_argument("--cases", default="0,1,3", help="indices into kernels_cuda.CASES")
    ap.add_argument("--variants", default="10424")
    ap.add_argument("--fp8", default="110602")
    ap.add_argument("--sdpa", action="store_true")
    ap.add_argument("--profile", default="", help="NVFP4 variants for decode/reduce times")
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--waves", default="1,2")
    ap.add_argument("--combine", default="auto", help="split combines to time: auto,fused,kernel")
    ap.add_argument("--profile-fmts", default="nvfp4", help="formats for --profile: nvfp4,fp8_e4m3")
    a = ap.parse_args()
    kc.WAVES = tuple(int(w) for w in a.waves.split(","))
    kc.COMBINES = tuple(a.combine.split(","))
    out = Path(os.environ.get("OUT", "/tmp"))
    res: dict = {"tag": a.tag, "checks": [], "decode": []}
    tk.ONE = torch.ones(1, dtype=torch.float32, device="cuda")
    t0 = time.time()
    cd._module()
    res["build_s"] = time.time() - t0
    rb = res["read_bw"] = tk.read_ceiling()
    print(f"[{a.tag}] build {res['build_s']:.0f}s read {rb / 1e12:.2f} TB/s", flush=True)
    nv = [int(v) for v in a.variants.split(",") if v]
    f8 = [int(v) for v in a.fp8.split(",") if v]
    for var in nv + f8:
        errs = [kc.check(var, s, g, lens, seed) for s, g, lens, seed in CHECKS]
        res["checks"].append({"variant": var, "errs": errs})
        print(f"[{a.tag}] check v{var}: {max(errs):.2e}", flush=True)
    for ci in [int(c) for c in a.cases.split(",") if c]:
        case = kc.CASES[ci]
        b, ctx, hq, h, d, s = case
        _, _, pages = tk.tables_for([ctx] * b, s, seed=ctx + b)
        row: dict = {"case": case}
        for fmt, vs in (("nvfp4", nv), ("fp8_e4m3", f8)):
            if not vs:
                continue
            layout, pool, view = tk.filled_pool(fmt, h, d, s, pages, seed=b)
            row[f"bytes_{fmt}"] = tk.kv_bytes(layout, b * ctx)
            print(f"[{a.tag}] case {case} {fmt}", flush=True)
            row[f"cuda_{fmt}"] = kc.time_cuda(layout, view, case, vs, rb)
            if a.profile and fmt in a.profile_fmts.split(",") and ci in (0, 1):
                for var in [int(v) for v in a.profile.split(",")]:
                    if (var in cd.FP8_VARIANTS) != (fmt == "fp8_e4m3"):
                        continue
                    for comb in kc.COMBINES:
                        row.setdefault("profile", []).append(
                            kernel_times(layout, view, case, var, comb))
                        print(f"[{a.tag}] profile {case} {row['profile'][-1]}", flush=True)
            del pool, view
            torch.cuda.empty_cache()
        if a.sdpa and s == 16:
            row["sdpa"] = tk.time_sdpa(case)
        res["decode"].append(row)
    if a.sass:
        res["sass"] = kc.sass_report(out)
        (out / f"sass_{a.tag}.txt").write_text(json.dumps(res["sass"], indent=1))
    (out / f"k17_{a.tag}.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
