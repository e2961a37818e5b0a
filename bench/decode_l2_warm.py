"""The decode kernel warming L2 with the O projection's weight, against not, side by side
(CUDA graphs, one H200).

A decode step runs, per layer, the paged decode kernel and then the O projection, a skinny
GEMM (M = batch) that must pull its 4096 x 4096 bf16 weight (33.5 MB) from HBM and loses
4-6 us of its 13.7 us to the ramp of that read (docs/benchmarks.md, "the step's GEMMs").
The NVFP4 decode kernel is bound by integer issue, not by bandwidth (ncu: 75% of the memory
floor), so its CTAs, once their pages are read, can bulk-prefetch the weight into L2
(``decode_attention_cuda(l2_prefetch=W)``) and the GEMM reads it from there.

Per layer: decode (Qwen3-8B's attention shape, ``--batch`` x ``--context``, one layer's
pages re-read by every layer: 0.3-1.2 GB, far past the L2) then ``out @ W_l^T`` with a weight
of its own per layer (36 x 33.5 MB, cold). Timed per 36-layer graph for: the decode alone,
the GEMM alone, and the pair without the warm-up and with it (issued as the CTAs finish, at
normal or evict_last priority; or before their first page, at evict_last), alternated
``--rounds`` times (median). Outputs are checked to be the same bytes.

    python -m nibble.bench.decode_l2_warm --out out/decode_l2_warm.json
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import torch

from nibble.kernels.cuda import decode_attention_cuda

from . import kernels as tk
from ._plots import grouped_bars
from ._timing import replay_us, save

HQ, H, D, LAYERS, HIDDEN = 32, 8, 128, 36, 4096
WARMS = {"pair, warm at end": ("end", False), "pair, warm at end, evict_last": ("end", True),
         "pair, warm at start, evict_last": ("start", True)}
FORMS = ("decode alone", "O GEMM alone", "pair", *WARMS)


def _setup(fmt: str, batch: int, ctx: int, page: int) -> dict:
    dev = torch.device("cuda")
    tables, lens, pages = tk.tables_for([ctx] * batch, page, seed=batch + ctx)
    layout, pool, view = tk.filled_pool(fmt, H, D, page, pages, seed=batch)
    gen = torch.Generator(dev).manual_seed(0)
    q = torch.randn(batch, HQ, D, generator=gen, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(HIDDEN, HQ * D, generator=gen, device=dev, dtype=torch.bfloat16) * 0.02
          for _ in range(LAYERS)]
    return {"layout": layout, "pool": pool, "view": view, "q": q, "tables": tables,
            "lens": lens, "ws": ws, "out": torch.empty_like(q),
            "y": torch.empty(batch, HIDDEN, device=dev, dtype=torch.bfloat16)}


def _layer(c: dict, form: str, splits: int, i: int) -> None:
    if form != "O GEMM alone":
        at, last = WARMS.get(form, ("end", True))
        decode_attention_cuda(c["layout"], c["view"], c["q"], c["tables"], c["lens"],
                              D ** -0.5, tk.ONE, tk.ONE, out=c["out"], num_splits=splits,
                              l2_prefetch=c["ws"][i] if form in WARMS else None,
                              l2_evict_last=last, l2_prefetch_at=at)
    if form != "decode alone":
        torch.mm(c["out"].view(-1, HQ * D), c["ws"][i].t(), out=c["y"])


def _graph(c: dict, form: str, splits: int) -> torch.cuda.CUDAGraph:
    _layer(c, form, splits, 0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(LAYERS):
            _layer(c, form, splits, i)
    return g


def _time(g: torch.cuda.CUDAGraph) -> float:
    return replay_us(g, LAYERS)


def _check(c: dict, splits: int) -> None:
    """Every form writes the same attention output and the same GEMM output."""
    got = []
    for form in ("pair", *WARMS):
        _layer(c, form, splits, LAYERS - 1)
        torch.cuda.synchronize()
        got.append((c["out"].clone(), c["y"].clone()))
    for o, y in got[1:]:
        if not (torch.equal(o, got[0][0]) and torch.equal(y, got[0][1])):
            raise AssertionError("the L2 warm-up changed an output")


def run(fmt: str, batch: int, ctx: int, page: int, rounds: int) -> dict:
    from nibble.kernels.cuda import decode as cd
    c = _setup(fmt, batch, ctx, page)
    splits = cd.default_num_splits(batch, H, ctx, c["q"].device, cd.default_variant(c["layout"]))
    _check(c, splits)
    graphs = {f: _graph(c, f, splits) for f in FORMS}
    times: dict[str, list[float]] = {f: [] for f in FORMS}
    for _ in range(rounds):
        for f in FORMS:
            times[f].append(_time(graphs[f]))
    med = {f: statistics.median(v) for f, v in times.items()}
    best = min(WARMS, key=med.get)
    saved = med["pair"] - med[best]
    print(f"{fmt} {batch} x {ctx}: " + ", ".join(f"{f} {v:.1f}" for f, v in med.items())
          + f" us per layer; the best warm-up ({best}) saves {saved:+.1f} us per layer "
          f"({LAYERS * saved / 1e3:+.3f} ms per step)", flush=True)
    return {"fmt": fmt, "batch": batch, "ctx": ctx, "page": page, "splits": splits,
            "us_per_layer": med, "best": best, "saved_us": saved, "rounds": times}


def plot(data: dict, path: pathlib.Path) -> None:
    """Time per layer of each form, per format and batch."""
    res = data["results"]
    grouped_bars([f"{r['fmt']}\n{r['batch']} x {r['ctx']}" for r in res],
                 {f: [r["us_per_layer"][f] for r in res] for f in FORMS}, path,
                 "us per layer", "decode + O projection, CUDA graphs, 36 layers per replay",
                 "{:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 4])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--formats", nargs="+", default=["nvfp4", "fp8_e4m3"])
    ap.add_argument("--out", default="out/decode_l2_warm.json")
    a = ap.parse_args()
    tk.ONE = torch.ones(1, dtype=torch.float32, device="cuda")
    res = [run(fmt, b, a.context, a.page_size, a.rounds) for b in a.batch for fmt in a.formats]
    save({"results": res}, a.out, plot)


if __name__ == "__main__":
    main()
