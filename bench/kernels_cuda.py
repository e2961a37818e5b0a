"""CUDA C++ NVFP4 and FP8 decode on one Hopper GPU: correctness first, then timings.

Builds the extension (timed), checks every variant it times on fresh random data
with NaN-poisoned outputs against the float32 reference, measures the read
ceiling in the same run, then times decode (CUDA-graph replay, do_bench median)
for the CUDA kernel's NVFP4 variants and split counts, the portable Triton NVFP4
kernel on the same pages, the CUDA FP8 variants and the Triton FP8 kernel on one
FP8 pool, and torch SDPA on contiguous BF16. Optionally dumps registers and SASS
of the built extension (cuobjdump). Prints a table; JSON to ``$OUT/kernels_cuda.json``.

    python bench/kernels_cuda.py [--quick] [--variants 10424,10404] [--fp8-variants 110403] [--sass]
    python bench/kernels_cuda.py --diag            # loads-only / compute-only diagnostics
    ncu -k regex:decode_kernel python bench/kernels_cuda.py --profile 4   # one case, no graph
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import types
from collections import Counter
from pathlib import Path

import torch

try:
    import nibble.kernels  # noqa: F401
except ImportError:  # not installed: map nibble.* onto the repository's folders
    _pkg = types.ModuleType("nibble")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[1])]
    sys.modules["nibble"] = _pkg

from nibble.bench import kernels as tk  # noqa: E402
from nibble.kernels import PageLayout, decode_attention_ref  # noqa: E402
from nibble.kernels.cuda import FP8_VARIANTS, VARIANTS, decode_attention_cuda  # noqa: E402
from nibble.kernels.cuda import decode as cuda_decode  # noqa: E402
from nibble.kernels.triton import decode as triton_decode  # noqa: E402
from nibble.kernels.triton import store_kv  # noqa: E402

DEV = torch.device("cuda")
# (batch, ctx, q heads, kv heads, head_dim, page_size)
CASES = [(1, 131072, 32, 8, 128, 16), (8, 32768, 32, 8, 128, 16), (64, 4096, 32, 8, 128, 16),
         (32, 32768, 32, 8, 128, 16), (8, 32768, 32, 8, 128, 64)]
# Triton knobs (block_n, warps, stages, scale_mode, ptx) and ctas/SM: the best of the
# docs/benchmarks.md sweep on this device kind.
TRITON = {"nvfp4": ((64, 4, 2, 1, True), 8), "fp8_e4m3": ((128, 4, 3, 1, True), 4)}
WAVES = (1, 2)
COMBINES = ("auto",)   # split combines timed per variant (kernels_cuda_ab --combine fused,kernel)


def check(variant: int, s: int, group: int, lens: list[int], seed: int) -> float:
    """Relative error vs the fp32 reference; random pool bytes, then stored slots."""
    gen = torch.Generator(DEV).manual_seed(seed)
    h = 8
    layout = PageLayout("fp8_e4m3" if variant in FP8_VARIANTS else "nvfp4", 2, h, 128, s)
    width = max(-(-n // s) for n in lens)
    pages = len(lens) * width
    pool = layout.allocate(pages, DEV).random_(0, 256, generator=gen)
    view = layout.layer_view(pool, 1)
    n = pages * s
    k = torch.randn((n, h, 128), generator=gen, device=DEV) * 2 + 0.5
    v = torch.randn((n, h, 128), generator=gen, device=DEV)
    store_kv(layout, view, k, v, torch.arange(n, device=DEV), 0.37, 2.0)
    tables = torch.randperm(pages, generator=gen, device=DEV).to(torch.int32).view(len(lens), width)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn((len(lens), h * group, 128), generator=gen, device=DEV).to(torch.bfloat16)
    out = torch.full(q.shape, float("nan"), device=DEV)
    decode_attention_cuda(layout, view, q, tables, lens_t, 128 ** -0.5, 0.37, 2.0, out=out,
                                variant=variant)
    ref = decode_attention_ref(layout, view, q, tables, lens_t, 128 ** -0.5, 0.37, 2.0)
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def time_cuda(layout, view, case: tuple, variants: list[int], read_bw: float) -> list[dict]:
    """The CUDA kernel's ``variants`` x split waves on one pool."""
    b, ctx, hq, h, d, s = case
    tables, lens, _ = tk.tables_for([ctx] * b, s, seed=ctx + b)
    q = torch.randn((b, hq, d), device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    nbytes = tk.kv_bytes(layout, b * ctx)
    rows = []
    for var in variants:
        for waves in WAVES:
            ns = cuda_decode.default_num_splits(b, h, ctx, DEV, var, waves)
            for comb in COMBINES:
                fn = lambda: decode_attention_cuda(  # noqa: E731
                    layout, view, q, tables, lens, d ** -0.5, tk.ONE, tk.ONE, out=out,
                    num_splits=ns, variant=var, combine=comb)
                sec = tk.graph_time(fn)
                rows.append({"variant": var, "waves": waves, "splits": ns, "combine": comb,
                             "us": sec * 1e6, "bw": nbytes / sec})
                print(f"  cuda v{var:<6d} waves={waves} splits={ns:3d} {comb:6s} "
                      f"{sec * 1e6:8.1f} us {100 * nbytes / sec / read_bw:5.1f}%", flush=True)
    return rows


def time_triton(layout, view, case: tuple, fmt: str) -> dict:
    """The portable Triton decode with its best knobs on the same pool."""
    b, ctx, hq, h, d, s = case
    tables, lens, _ = tk.tables_for([ctx] * b, s, seed=ctx + b)
    q = torch.randn((b, hq, d), device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    (bn, nw, st, sm, ptx), cps = TRITON[fmt]
    ns = triton_decode.default_num_splits(b, h, ctx, DEV, cps)
    sec = tk.graph_time(lambda: triton_decode.decode_attention(
        layout, view, q, tables, lens, d ** -0.5, tk.ONE, tk.ONE, out=out, num_splits=ns,
        block_n=bn, num_warps=nw, num_stages=st, scale_mode=sm, ptx=ptx))
    nbytes = tk.kv_bytes(layout, b * ctx)
    return {"us": sec * 1e6, "bw": nbytes / sec, "splits": ns}


def time_case(case: tuple, variants: list[int], fp8_variants: list[int], read_bw: float) -> dict:
    """NVFP4 (CUDA variants, Triton) on one pool, FP8 (CUDA, Triton) on another, then SDPA."""
    b, ctx, hq, h, d, s = case
    _, _, pages = tk.tables_for([ctx] * b, s, seed=ctx + b)
    row: dict = {"case": case}
    for fmt, vars_ in (("nvfp4", variants), ("fp8_e4m3", fp8_variants)):
        layout, pool, view = tk.filled_pool(fmt, h, d, s, pages, seed=b)
        row[f"bytes_{fmt}"] = tk.kv_bytes(layout, b * ctx)
        row[f"cuda_{fmt}"] = time_cuda(layout, view, case, vars_, read_bw)
        row[f"triton_{fmt}"] = time_triton(layout, view, case, fmt)
        del pool, view
        torch.cuda.empty_cache()
    row["sdpa"] = tk.time_sdpa(case) if s == 16 else None
    return row


def diag(read_bw: float) -> list[dict]:
    """Time the full kernel against its loads-only and compute-only diagnostic variants."""
    rows = []
    for case in (CASES[1], CASES[3]):
        b, ctx, hq, h, d, s = case
        tables, lens, pages = tk.tables_for([ctx] * b, s, seed=ctx + b)
        layout, pool, view = tk.filled_pool("nvfp4", h, d, s, pages, seed=b)
        q = torch.randn((b, hq, d), device=DEV, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        nbytes = tk.kv_bytes(layout, b * ctx)
        for var in (4, 1004, 2004):
            ns = cuda_decode.default_num_splits(b, h, ctx, DEV, 4)
            sec = tk.graph_time(lambda: decode_attention_cuda(  # noqa: E731
                layout, view, q, tables, lens, d ** -0.5, tk.ONE, tk.ONE, out=out, num_splits=ns,
                variant=var))
            rows.append({"case": case, "variant": var, "us": sec * 1e6, "bw": nbytes / sec})
            pct = 100 * nbytes / sec / read_bw
            print(f"diag {b} x {ctx} v{var}: {sec * 1e6:.1f} us ({pct:.0f}% of read BW)",
                  flush=True)
        del pool, view
    return rows


def profile(variant: int, case: int = 1) -> None:
    """One decode of ``CASES[case]``, three plain launches (for ncu), on pages of the variant's
    format."""
    b, ctx, hq, h, d, s = CASES[case]
    tables, lens, pages = tk.tables_for([ctx] * b, s, seed=ctx + b)
    fmt = "fp8_e4m3" if variant in FP8_VARIANTS else "nvfp4"
    layout, pool, view = tk.filled_pool(fmt, h, d, s, pages, seed=b)
    q = torch.randn((b, hq, d), device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        decode_attention_cuda(layout, view, q, tables, lens, d ** -0.5, tk.ONE, tk.ONE,
                              variant=variant)
    torch.cuda.synchronize()


def sass_report(out_dir: Path | None) -> dict:
    """Registers (cuobjdump -res-usage) and loop opcode counts of the built extension."""
    so = cuda_decode._module().__file__
    info: dict = {}
    try:
        res = subprocess.run(["cuobjdump", "-res-usage", so], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run(["cuobjdump", "-sass", so], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return {"error": str(exc)}
    if out_dir is not None:
        (out_dir / "decode_cuda.sass").write_text(sass)
    for m in re.finditer(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+)", res):
        info[m.group(1)] = {"regs": int(m.group(2)), "stack": int(m.group(3))}
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        name = fn.split("\n", 1)[0].strip()
        ins = []
        for addr, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", fn):
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
            target = re.search(r"0x([0-9a-f]+)", text) if op == "BRA" else None
            ins.append((int(addr, 16), op, int(target.group(1), 16) if target else None))
        loops = [(tgt, a) for a, op, tgt in ins if tgt is not None and tgt < a]
        if loops:  # the main tile loop is the first backward branch of the kernel
            lo, hi = loops[0]
            body = Counter(op.split(".")[0] for a, op, _ in ins if lo <= a <= hi)
            info.setdefault(name, {}).update(loop_instr=sum(body.values()),
                                             loop_ops=dict(body.most_common(16)))
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="first two cases only")
    ap.add_argument("--variants", default=",".join(map(str, VARIANTS)))
    ap.add_argument("--fp8-variants", default=",".join(map(str, FP8_VARIANTS)))
    ap.add_argument("--sass", action="store_true", help="registers and SASS loop counts")
    ap.add_argument("--diag", action="store_true", help="loads-only / compute-only timings")
    ap.add_argument("--profile", type=int, default=None, help="run one case with VARIANT")
    ap.add_argument("--profile-case", type=int, default=1, help="index into CASES for --profile")
    args = ap.parse_args()
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    tk.ONE = torch.ones(1, dtype=torch.float32, device=DEV)
    if args.profile is not None:
        profile(args.profile, args.profile_case)
        return
    props = torch.cuda.get_device_properties(DEV)
    res: dict = {"device": props.name, "torch": torch.__version__, "checks": [], "decode": []}
    t0 = time.time()
    cuda_decode._module()
    res["build_s"] = time.time() - t0
    read_bw = tk.read_ceiling()
    res["read_bw"] = read_bw
    print(f"{props.name}: build {res['build_s']:.0f} s, read ceiling {read_bw / 1e12:.2f} TB/s",
          flush=True)
    variants, fp8_variants = [], []
    wanted = [int(v) for v in args.variants.split(",") if v]
    wanted += [int(v) for v in args.fp8_variants.split(",") if v]
    for var in wanted:
        errs = [check(var, s, g, lens, seed) for s, g, lens, seed in (
            (16, 4, [1, 15, 16, 17, 2999, 40000], 1), (64, 4, [63, 3000, 9000], 2),
            (32, 8, [500, 5], 3), (16, 2, [1234], 4))]
        ok = max(errs) < 3e-3
        res["checks"].append({"variant": var, "errs": errs, "ok": ok})
        print(f"check v{var}: max rel err {max(errs):.2e} {'ok' if ok else 'BAD'}", flush=True)
        if ok:
            (fp8_variants if var in FP8_VARIANTS else variants).append(var)
    if args.diag:
        res["diag"] = diag(read_bw)
    cases = [] if args.diag else CASES[:2] if args.quick else CASES
    for case in cases:
        print(f"case {case}", flush=True)
        res["decode"].append(time_case(case, variants, fp8_variants, read_bw))
    if args.sass:
        res["sass"] = sass_report(out_dir)
        for name, info in res["sass"].items():
            print(f"sass {name}: {info}", flush=True)
    lines = table(res["decode"], read_bw)
    print("\n" + "\n".join(lines))
    if out_dir is not None:
        (out_dir / "kernels_cuda.json").write_text(json.dumps(res, indent=1, default=str))


def table(rows: list[dict], read_bw: float) -> list[str]:
    pct = lambda r: f"{r['us']:.1f} ({100 * r['bw'] / read_bw:.0f}%)"  # noqa: E731
    lines = ["| batch x ctx | page | CUDA nvfp4 us (% BW) | variant, splits | CUDA fp8 | variant, "
             "splits | Triton nvfp4 | Triton fp8 | SDPA bf16 | nvfp4 vs fp8 (CUDA) | "
             "vs Triton fp8 | vs SDPA |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["cuda_nvfp4"] or not r["cuda_fp8_e4m3"]:
            continue
        n4 = min(r["cuda_nvfp4"], key=lambda c: c["us"])
        f8 = min(r["cuda_fp8_e4m3"], key=lambda c: c["us"])
        b, ctx, *_, s = r["case"]
        sd = r["sdpa"]
        lines.append(
            f"| {b} x {ctx} | {s} | {pct(n4)} | v{n4['variant']}, {n4['splits']} | {pct(f8)} | "
            f"v{f8['variant']}, {f8['splits']} | {pct(r['triton_nvfp4'])} | "
            f"{pct(r['triton_fp8_e4m3'])} | {pct(sd) if sd else '-'} | "
            f"{f8['us'] / n4['us']:.2f}x | {r['triton_fp8_e4m3']['us'] / n4['us']:.2f}x | "
            f"{(sd['us'] / n4['us']) if sd else float('nan'):.2f}x |")
    return lines


if __name__ == "__main__":
    main()
