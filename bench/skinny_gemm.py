"""Decode-step projections (M = batch rows, bf16) as cuBLAS runs them, against a Triton split-K
GEMM swept over tile shapes: is there bandwidth left in the step's weight reads?

Qwen3-8B's five projections of a decode step (QKV, O, gate+up, down, LM head) at M = 16.
Every weight is replicated until the copies exceed the L2 twice over and the timed CUDA graph
walks through them, so each call reads its weight from HBM, as a decode step does. Each Triton
config is checked against ``torch.nn.functional.linear`` first (max |diff| over max |ref|
below 1e-2); the share is the weight bytes over the time at ``--read-tbs``.

``--chain``: a layer's four projections in order, each reading the last one's output, over
``--layers`` cold layers, with cuBLAS, the Triton GEMM, and the Triton GEMM under programmatic
dependent launch (the next grid released at once or after the main loop, with or without an
L2 prefetch of its first weight columns before it waits); checked against the first variant.

    python -m nibble.bench.skinny_gemm --out out/skinny_gemm.json
    python -m nibble.bench.skinny_gemm --chain --layers 8 --out out/chain.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib

import torch
import triton
import triton.language as tl

from ._plots import grouped_bars

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096)}


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
                                     "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, k_per, sxm, swn, sym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ATOMIC: tl.constexpr,
                 PDL: tl.constexpr = 0, PREF: tl.constexpr = 0):
    """y[M, N] (+)= x[M, K] @ w[N, K]^T over K slice ``program_id(1)`` of ``k_per`` values.

    PDL (programmatic dependent launch, with ``launch_pdl=True``): 1 = prefetch the first
    ``PREF`` columns of this program's weight rows into L2, wait for the previous grid, let
    the next grid launch at once; 2 = the same, the next grid launched after the main loop."""
    pn, pk = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    k0 = pk * k_per
    if PDL:
        if PREF > 0:
            rp = k0 + tl.arange(0, PREF // 64) * 64
            _prefetch_l2(w_ptr + rn[:, None] * swn + rp[None, :])
        tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(k0, k0 + k_per, BK):
        rk = k + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * swn + rk[None, :])
        acc += tl.dot(x, tl.trans(w))
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    ptrs = y_ptr + rm[:, None] * sym + rn[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=rm[:, None] < M, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


def triton_linear(x, w, cfg, ws=None):
    """``x [M, K] bf16 @ w [N, K]^T`` with ``cfg = (BN, BK, split, warps, stages)``; a split
    above 1 adds fp32 partials into ``ws [M, N]`` (zeroed here) and casts at the end."""
    bn, bk, split, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    k_per = k // split
    grid = (n // bn, split)
    if split == 1:
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        _gemm_kernel[grid](x, w, y, m, n, k, k_per, x.stride(0), w.stride(0), y.stride(0),
                           BM=16, BN=bn, BK=bk, ATOMIC=False, num_warps=warps, num_stages=stages)
        return y
    ws.zero_()
    _gemm_kernel[grid](x, w, ws, m, n, k, k_per, x.stride(0), w.stride(0), ws.stride(0),
                       BM=16, BN=bn, BK=bk, ATOMIC=True, num_warps=warps, num_stages=stages)
    return ws.to(x.dtype)


def linear_into(x, w, y, cfg, pdl: int = 0, pref: int = 0) -> None:
    """``y[M, N] = x @ w^T`` without a split; ``pdl``/``pref`` as in :func:`_gemm_kernel`."""
    bn, bk, _, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    extra = {"launch_pdl": True} if pdl else {}
    _gemm_kernel[(n // bn, 1)](x, w, y, m, n, k, k, x.stride(0), w.stride(0), y.stride(0),
                               BM=16, BN=bn, BK=bk, ATOMIC=False, PDL=pdl, PREF=pref,
                               num_warps=warps, num_stages=stages, **extra)


# The chain's per-shape configs: the best no-split configs of the first sweep (2026-12-04).
CHAIN_CFG = {"qkv": (64, 256, 1, 4, 4), "o": (32, 256, 1, 4, 4), "gate_up": (32, 128, 1, 4, 3),
             "down": (32, 128, 1, 4, 4)}


def chain(m: int, read_tbs: float, layers: int, variants: list[str]) -> dict:
    """A decode layer's four projections in order, each reading the last one's output, over
    ``layers`` distinct layers (cold weights), graph-captured; per-layer time per variant."""
    dev = torch.device("cuda")
    ws = [{n: torch.randn(*SHAPES[n], device=dev, dtype=torch.bfloat16) * 0.02
           for n in ("qkv", "o", "gate_up", "down")} for _ in range(layers)]
    x0 = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    bufs = {n: torch.empty(m, SHAPES[n][0], device=dev, dtype=torch.bfloat16) for n in CHAIN_CFG}
    ins = {"qkv": lambda: x0, "o": lambda: bufs["qkv"][:, :4096],
           "gate_up": lambda: bufs["o"], "down": lambda: bufs["gate_up"][:, :12288]}

    def run_variant(v: str, layer: int) -> None:
        for n in ("qkv", "o", "gate_up", "down"):
            x, w = ins[n](), ws[layer][n]
            if v == "cublas":
                torch.mm(x, w.t(), out=bufs[n])
            else:
                pdl, pref = {"triton": (0, 0), "pdl1": (1, 0), "pdl2": (2, 0),
                             "pdl1_pref": (1, 512), "pdl2_pref": (2, 512)}[v]
                linear_into(x, w, bufs[n], CHAIN_CFG[n], pdl, pref)

    floor_us = sum(SHAPES[n][0] * SHAPES[n][1] * 2 for n in CHAIN_CFG) / (read_tbs * 1e12) * 1e6
    out = {"layers": layers, "floor_us_per_layer": floor_us, "variants": {}}
    ref = None
    for v in variants:
        for i in range(layers):
            run_variant(v, i)
        torch.cuda.synchronize()
        y = bufs["down"].float()
        ref = y if ref is None else ref
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        if err > 2e-2:
            raise AssertionError(f"chain {v}: relative error {err:.3g} against {variants[0]}")
        us = _graph_us(lambda i, v=v: run_variant(v, i), layers)
        out["variants"][v] = {"us_per_layer": us, "share": floor_us / us, "err": err}
        print(f"chain {v}: {us:.1f} us per layer ({100 * floor_us / us:.1f}% of {floor_us:.1f})",
              flush=True)
    return out


def _graph_us(fn, copies: int, reps: int = 20) -> float:
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    return sorted(times)[len(times) // 2]


def _configs(n: int, k: int):
    for bn, bk, split, warps, stages in itertools.product(
            (32, 64, 128), (128, 256), (1, 2, 4), (4,), (3, 4)):
        if n % bn or (k // split) % bk or bn * bk * 2 * stages > 200_000:
            continue
        if split > 1 and n // bn * split > 8 * 132:    # enough CTAs already without a split
            continue
        yield bn, bk, split, warps, stages


def run(m: int, read_tbs: float, names: list[str]) -> list[dict]:
    dev = torch.device("cuda")
    out = []
    for name in names:
        n, k = SHAPES[name]
        copies = max(2, -(-240_000_000 // (n * k * 2)))
        ws_ = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, ws_[0]).float()
        floor_us = n * k * 2 / (read_tbs * 1e12) * 1e6
        rec = {"name": name, "m": m, "n": n, "k": k, "copies": copies, "floor_us": floor_us}
        rec["cublas_us"] = _graph_us(lambda i: torch.nn.functional.linear(x, ws_[i]), copies)
        acc = torch.empty(m, n, device=dev, dtype=torch.float32)
        best = None
        for cfg in _configs(n, k):
            try:
                y = triton_linear(x, ws_[0], cfg, acc).float()
            except Exception as e:  # a config the compiler refuses (shared memory): skip it
                print(f"  {name} {cfg}: {type(e).__name__}")
                continue
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                raise AssertionError(f"{name} {cfg}: relative error {err:.3g}")
            us = _graph_us(lambda i, c=cfg: triton_linear(x, ws_[i], c, acc), copies)
            if best is None or us < best[1]:
                best = (cfg, us, err)
        rec.update(triton_us=best[1], triton_cfg=list(best[0]), triton_err=best[2],
                   cublas_share=floor_us / rec["cublas_us"], triton_share=floor_us / best[1])
        print(f"{name}: floor {floor_us:.1f} us, cuBLAS {rec['cublas_us']:.1f} us "
              f"({100 * rec['cublas_share']:.1f}%), Triton {best[1]:.1f} us "
              f"({100 * rec['triton_share']:.1f}%) {best[0]}", flush=True)
        out.append(rec)
        del ws_
        torch.cuda.empty_cache()
    return out


def plot(data: dict, path: pathlib.Path) -> None:
    """Share of the read ceiling per projection (cuBLAS, Triton) or per chain variant."""
    res = data["results"]
    if res and "variants" in res[0]:
        names = list(res[0]["variants"])
        series = {"chain": [100 * res[0]["variants"][v]["share"] for v in names]}
        title = f"QKV, O, gate+up, down in order, {res[0]['layers']} cold layers"
    else:
        names = [r["name"] for r in res]
        series = {"cuBLAS": [100 * r["cublas_share"] for r in res],
                  "Triton (best config)": [100 * r["triton_share"] for r in res]}
        title = f"decode-step projections, M = {res[0]['m'] if res else '?'}, cold weights"
    grouped_bars(names, series, path, f"% of {data['read_tbs']} TB/s", title)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--read-tbs", type=float, default=4.47)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--chain", nargs="*", default=None,
                    help="time the layer chain with these variants instead of the sweep")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default="out/skinny_gemm.json")
    a = ap.parse_args()
    if a.chain is not None:
        res = [chain(a.m, a.read_tbs, a.layers, a.chain or
                     ["cublas", "triton", "pdl1", "pdl2", "pdl1_pref", "pdl2_pref"])]
    else:
        res = run(a.m, a.read_tbs, a.shapes)
    path = pathlib.Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"read_tbs": a.read_tbs, "results": res}
    path.write_text(json.dumps(data, indent=1))
    plot(data, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
