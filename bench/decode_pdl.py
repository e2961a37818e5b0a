"""The fused QKV kernel and the CUDA decode kernel of a decode step, with and without
programmatic dependent launch (PDL), side by side (CUDA graphs, one H200).

A decode step's attention per layer is two launches: ``qkv_rope_store`` (QK-norm, RoPE, the
K recipe, the NVFP4/FP8 store of the new token, q') and ``decode_attention_cuda``. With PDL
the decode kernel is launched as the QKV kernel's programmatic dependent: its CTAs start and
fill their rings from the cached pages while the QKV kernel runs, and wait for it before
reading q and the newest token. Qwen3-8B's attention shape (32 query / 8 KV heads, head dim
128), ``--batch`` sequences of ``--context`` tokens, 36 layers' pairs per graph (one layer's
pages, re-read by each pair: 0.6-1.1 GB, far past the L2). The two forms are checked to give
the same bytes first, then timed alternately (``--rounds`` each, median).

    python -m nibble.bench.decode_pdl --out out/decode_pdl.json
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import torch

from nibble.kernels.cuda import decode_attention_cuda
from nibble.kernels.triton import qkv_rope_store

from . import kernels as tk
from ._plots import grouped_bars
from ._timing import replay_us, save
from .fused_layers import _recipe

HQ, H, D, LAYERS = 32, 8, 128, 36


def _setup(fmt: str, batch: int, ctx: int, page: int) -> dict:
    dev = torch.device("cuda")
    tables, lens, pages = tk.tables_for([ctx] * batch, page, seed=batch + ctx)
    layout, pool, view = tk.filled_pool(fmt, H, D, page, pages, seed=batch)
    gen = torch.Generator(dev).manual_seed(0)
    qkv = torch.randn(batch, (HQ + 2 * H) * D, generator=gen, device=dev, dtype=torch.bfloat16)
    cos, sin = (torch.rand(batch, 1, D, generator=gen, device=dev, dtype=torch.bfloat16)
                for _ in range(2))
    last = lens.long() - 1
    slots = tables[torch.arange(batch, device=dev), last // page].long() * page + last % page
    recipe = {}
    if fmt == "nvfp4":                         # as served: fp32 shift, bf16 maps
        p32 = _recipe(dev)
        p16 = p32.to(dev, torch.bfloat16)
        recipe = {"k_shift": p32.k_shift[0], "k_map": p16.k_map[0], "q_map": p16.q_map[0]}
    return {"layout": layout, "pool": pool, "view": view, "qkv": qkv, "cos": cos, "sin": sin,
            "slots": slots, "tables": tables, "lens": lens, "recipe": recipe,
            "out": torch.empty(batch, HQ, D, device=dev, dtype=torch.bfloat16)}


def _pair(c: dict, pdl: bool, splits: int) -> None:
    q = qkv_rope_store(c["layout"], c["view"], c["qkv"], HQ, c["cos"], c["sin"], c["slots"],
                       tk.ONE, tk.ONE, **c["recipe"], pdl_trigger=pdl)
    decode_attention_cuda(c["layout"], c["view"], q, c["tables"], c["lens"], D ** -0.5,
                          tk.ONE, tk.ONE, out=c["out"], num_splits=splits, pdl=pdl)


def _graph(c: dict, pdl: bool, splits: int) -> torch.cuda.CUDAGraph:
    _pair(c, pdl, splits)                      # compiles the Triton variant off the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(LAYERS):
            _pair(c, pdl, splits)
    return g


def _time(g: torch.cuda.CUDAGraph) -> float:
    return replay_us(g, LAYERS)


def run(fmt: str, batch: int, ctx: int, page: int, rounds: int) -> dict:
    from nibble.kernels.cuda import decode as cd
    c = _setup(fmt, batch, ctx, page)
    splits = cd.default_num_splits(batch, H, ctx, c["qkv"].device,
                                   cd.default_variant(c["layout"]))
    outs = []
    for pdl in (False, True):                  # same bytes both ways, eagerly and replayed
        _pair(c, pdl, splits)
        torch.cuda.synchronize()
        outs.append(c["out"].clone())
    graphs = {pdl: _graph(c, pdl, splits) for pdl in (False, True)}
    graphs[True].replay()
    torch.cuda.synchronize()
    if not (torch.equal(outs[0], outs[1]) and torch.equal(outs[0], c["out"])):
        raise AssertionError(f"{fmt}: the PDL launch changed the output")
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for pdl in (False, True):
            times[pdl].append(_time(graphs[pdl]))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    rec = {"fmt": fmt, "batch": batch, "ctx": ctx, "page": page, "splits": splits,
           "us_per_layer_plain": off, "us_per_layer_pdl": on, "saved_us": off - on,
           "rounds": {"plain": times[False], "pdl": times[True]}}
    print(f"{fmt} {batch} x {ctx}: QKV + decode {off:.1f} us plain, {on:.1f} us PDL "
          f"({off - on:+.1f} us per layer, {LAYERS * (off - on) / 1e3:+.3f} ms per step)",
          flush=True)
    return rec


def plot(data: dict, path: pathlib.Path) -> None:
    """QKV + decode time per layer, plain launch against PDL, per format and batch."""
    res = data["results"]
    grouped_bars([f"{r['fmt']}\n{r['batch']} x {r['ctx']}" for r in res],
                 {"plain launch": [r["us_per_layer_plain"] for r in res],
                  "PDL": [r["us_per_layer_pdl"] for r in res]}, path,
                 "us per layer (QKV kernel + decode)",
                 "decode step attention, CUDA graphs, 36 layers per replay", "{:.1f}")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="out/decode_pdl.json")
    a = ap.parse_args()
    tk.ONE = torch.ones(1, dtype=torch.float32, device="cuda")
    res = [run(fmt, b, a.context, a.page_size, a.rounds)
           for b in a.batch for fmt in ("fp8_e4m3", "nvfp4")]
    save({"results": res}, a.out, plot)


if __name__ == "__main__":
    main()
