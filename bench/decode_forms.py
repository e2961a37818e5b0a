"""CUDA decode kernel forms side by side: variants x split counts, one pool, CUDA graphs
(one H200).

A/B of decode-kernel variants (``--variants``, from ``kernels/cuda/decode.py``'s lists) and
of the split count: one wave of resident CTAs (the default), and with ``--whole-waves`` the
fewest splits whose CTAs fill whole waves (one wave at 16 x 32K is 4 splits x 128 (sequence,
KV head) pairs = 512 CTAs on 528 slots; 33 splits make 8 full waves).

Per (format, batch): every form is first checked against the fp32 reference (relative
error), then timed as a 36-layer graph of the decode alone (the one layer's pages re-read by
every launch: 0.3-1.2 GB, far past the L2), the forms alternated ``--rounds`` times
(median, us per layer; share of the read ceiling measured in the same run).

    python -m nibble.bench.decode_forms --out out/decode_forms.json
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics

import torch

from nibble.kernels.cuda import decode as cd
from nibble.kernels.cuda import decode_attention_cuda
from nibble.kernels.paged_ref import decode_attention_ref

from . import kernels as tk
from ._plots import grouped_bars
from ._timing import replay_us, save

HQ, H, D, LAYERS = 32, 8, 128, 36


def whole_wave_splits(base: int, slots: int, pairs: int) -> int:
    """The fewest splits, at least ``base``, whose ``pairs * splits`` CTAs fill whole waves of
    ``slots`` resident CTAs."""
    step = slots // math.gcd(slots, pairs)
    return max(step, -(-base // step) * step)


def balanced_splits(batch: int, ctx: int, variant: int) -> int:
    """:func:`whole_wave_splits` from the variant's one-wave split count on this GPU."""
    dev = torch.device("cuda")
    return whole_wave_splits(cd.default_num_splits(batch, H, ctx, dev, variant),
                             cd._resident_ctas(dev.index or 0, variant), batch * H)


def forms_for(batch: int, ctx: int, variants: list[int], whole: bool) -> list[tuple[int, int]]:
    """(variant, splits): each variant at one wave (and at whole waves with ``whole``)."""
    dev = torch.device("cuda")
    out = []
    for v in variants:
        out.append((v, cd.default_num_splits(batch, H, ctx, dev, v)))
        if whole:
            out.append((v, balanced_splits(batch, ctx, v)))
    return list(dict.fromkeys(out))


def run(fmt: str, batch: int, ctx: int, page: int, variants: list[int], rounds: int,
        read_bw: float, whole: bool) -> dict:
    tables, lens, pages = tk.tables_for([ctx] * batch, page, seed=batch + ctx)
    layout, _pool, view = tk.filled_pool(fmt, H, D, page, pages, seed=batch)
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(batch, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ref = decode_attention_ref(layout, view, q, tables, lens, D ** -0.5, tk.ONE, tk.ONE)
    graphs, errs = {}, {}
    for v, s in forms_for(batch, ctx, variants, whole):
        def call(v=v, s=s):
            decode_attention_cuda(layout, view, q, tables, lens, D ** -0.5, tk.ONE, tk.ONE,
                                  out=out, num_splits=s, variant=v)
        name = f"v{v} x{s}"
        call()
        torch.cuda.synchronize()
        errs[name] = ((out.float() - ref).norm() / ref.norm()).item()
        if not errs[name] < 2e-2:
            raise AssertionError(f"{fmt} {name}: relative error {errs[name]:.3g}")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(LAYERS):
                call()
        graphs[name] = g
    times: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(rounds):
        for n, g in graphs.items():
            times[n].append(replay_us(g, LAYERS))
    med = {n: statistics.median(t) for n, t in times.items()}
    nbytes = tk.kv_bytes(layout, batch * ctx)
    share = {n: nbytes / (us * 1e-6) / read_bw for n, us in med.items()}
    print(f"{fmt} {batch} x {ctx}: " + ", ".join(
        f"{n} {us:.1f} us ({100 * share[n]:.1f}%)" for n, us in med.items()), flush=True)
    return {"fmt": fmt, "batch": batch, "ctx": ctx, "page": page, "us_per_layer": med,
            "share_of_read_ceiling": share, "rel_err": errs, "rounds": times}


def plot(data: dict, path: pathlib.Path) -> None:
    """Time per layer of each form, per format and batch (forms differ per format)."""
    res = data["results"]
    names = list(dict.fromkeys(n for r in res for n in r["us_per_layer"]))
    grouped_bars([f"{r['fmt']}\n{r['batch']} x {r['ctx']}" for r in res],
                 {n: [r["us_per_layer"].get(n, float("nan")) for r in res] for n in names},
                 path, "us per layer", "decode kernel forms (variant x splits), CUDA graphs",
                 "{:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 8, 32])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", type=int, nargs="+", default=[10424])
    ap.add_argument("--fp8-variants", type=int, nargs="+", default=[110602])
    ap.add_argument("--whole-waves", action="store_true",
                    help="also time each variant at the fewest splits filling whole waves")
    ap.add_argument("--out", default="out/decode_forms.json")
    a = ap.parse_args()
    tk.ONE = torch.ones(1, dtype=torch.float32, device="cuda")
    read_bw = tk.read_ceiling()
    res = []
    for b in a.batch:
        for fmt, vs in (("nvfp4", a.variants), ("fp8_e4m3", a.fp8_variants)):
            if vs:
                res.append(run(fmt, b, a.context, a.page_size, vs, a.rounds, read_bw,
                               a.whole_waves))
                torch.cuda.empty_cache()          # the last case's pool is gone with run()
    save({"read_ceiling": read_bw, "results": res}, a.out, plot)


if __name__ == "__main__":
    main()
