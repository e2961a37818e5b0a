"""NVFP4 quantize-and-store on one GPU: bit-exactness, then a launch-shape sweep.

    python3 bench/store_sweep.py            # from the repository root; $OUT/store_sweep.json

Checks ``store_kv`` (defaults), the CUDA store's variants (rows ``cuda``: variant 0,
``cuda-v1``: variant 1, see ``kernels/cuda/store.py``) and every swept Triton configuration
(rows per tile, num_warps, tiles per program; see ``kernels/triton/store.py``) against
``store_kv_ref`` (poisoned pool, random slot permutation, global scales 0.5 / 2.0)
for bf16 and float8_e4m3fn input, then times each configuration at T=65536, H=8,
D=128, page 16 (random page order, 10 calls per CUDA graph, do_bench median of
replays / 10) against a measured device-to-device copy of 1 GiB.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch
import triton

try:
    import nibble.kernels  # noqa: F401
except ImportError:  # not installed: map nibble.* onto the repository's folders
    _pkg = types.ModuleType("nibble")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[1])]
    sys.modules["nibble"] = _pkg

from nibble.bench.kernels import graph_time  # noqa: E402
from nibble.kernels import PageLayout, store_kv_ref  # noqa: E402
from nibble.kernels.cuda import store_kv_nvfp4_cuda  # noqa: E402
from nibble.kernels.triton import store as S  # noqa: E402
from nibble.kernels.triton import store_kv  # noqa: E402

DEV = torch.device("cuda")
IN_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
# (rows per tile, num_warps, tiles per program)
CONFIGS = [(8, 2, 1), (8, 1, 1), (16, 2, 1), (16, 4, 1), (32, 8, 1), (8, 2, 2), (8, 2, 4),
           (16, 4, 2), (8, 1, 2), (4, 1, 1)]
CUDA_ROWS = {"cuda": 0, "cuda-v1": 1}          # row name -> store_kv_nvfp4_cuda variant


def inputs(t: int, h: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn((t, h, d), device=DEV, generator=gen)
    x = x * torch.exp(torch.randn((t, h, d), device=DEV, generator=gen) * 2)
    return x.clamp(-440, 440).to(dtype)


def check(in_dtype: torch.dtype, config: tuple | None, t: int = 4096, h: int = 8,
          d: int = 128) -> bool:
    """Every pool byte equal to the CPU reference after one store (``config`` None: store_kv)."""
    gen = torch.Generator(DEV).manual_seed(1234)
    layout = PageLayout("nvfp4", 2, h, d, 16)
    k, v = inputs(t, h, d, in_dtype, gen), inputs(t, h, d, in_dtype, gen)
    k[0, 0, :16] = -0.0
    v[1, 2, 16:32] = 0.0
    pool = layout.allocate(t // 16, DEV).random_(0, 256, generator=gen)
    expect = pool.cpu()
    slots = torch.randperm(t, device=DEV, generator=gen)
    view = layout.layer_view(pool, 1)
    if config is None:
        store_kv(layout, view, k, v, slots, 0.5, 2.0)
    elif config in CUDA_ROWS:
        store_kv_nvfp4_cuda(layout, view, k, v, slots, 0.5, 2.0, variant=CUDA_ROWS[config])
    else:
        S._launch(layout, view, k, v, slots, 0.5, 2.0, *config)
    store_kv_ref(layout, layout.layer_view(expect, 1), k.cpu(), v.cpu(), slots.cpu(), 0.5, 2.0)
    return bool(torch.equal(pool.cpu(), expect))


def copy_bw() -> tuple[float, float]:
    """Bytes/s (read + written) of a 1 GiB uint8 device-to-device copy: timed like the store
    (graph replay) and eagerly (do_bench median; a captured copy may run on a copy engine)."""
    src = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    eager = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=150,
                                    return_mode="median") * 1e-3
    return 2 * src.numel() / graph_time(lambda: dst.copy_(src)), 2 * src.numel() / eager


def time_store(in_dtype: torch.dtype, config: tuple, t: int = 65536, h: int = 8,
               d: int = 128) -> dict:
    gen = torch.Generator(DEV).manual_seed(5)
    layout = PageLayout("nvfp4", 1, h, d, 16)
    pool = layout.allocate(t // 16, DEV)
    view = layout.layer_view(pool, 0)
    k, v = inputs(t, h, d, in_dtype, gen), inputs(t, h, d, in_dtype, gen)
    slots = (torch.randperm(t // 16, device=DEV, generator=gen)[:, None] * 16
             + torch.arange(16, device=DEV)).flatten()
    one = torch.ones(1, device=DEV)
    if config in CUDA_ROWS:
        sec = graph_time(lambda: store_kv_nvfp4_cuda(layout, view, k, v, slots, one, one,
                                                     variant=CUDA_ROWS[config]))
    else:
        sec = graph_time(lambda: S._launch(layout, view, k, v, slots, one, one, *config))
    read = 2 * k.numel() * k.element_size()
    written = 2 * t * h * (d // 2 + d // 16)
    return {"us": sec * 1e6, "bytes": read + written, "bw": (read + written) / sec}


def main() -> None:
    props = torch.cuda.get_device_properties(DEV)
    res = {"device": props.name, "default": [S.ROWS, S.NUM_WARPS, S.TILES], "check": {},
           "time": []}
    ok = True
    for dt in IN_DTYPES:
        name = str(dt)[6:]
        for cfg in [None, *CUDA_ROWS] + CONFIGS:
            good = check(dt, cfg)
            ok &= good
            res["check"][f"{name} {cfg or 'default'}"] = good
            if not good:
                print(f"FAIL {name} {cfg or 'store_kv default'}", flush=True)
    print(("PASS" if ok else "FAIL") + f": bit-exact vs store_kv_ref "
          f"({len(CONFIGS) + len(CUDA_ROWS) + 1} configs "
          f"x bf16/fp8)", flush=True)
    graph_bw, eager_bw = copy_bw()
    cbw = max(graph_bw, eager_bw)
    res.update(copy_bw=cbw, copy_bw_graph=graph_bw, copy_bw_eager=eager_bw)
    print(f"{props.name}: copy {graph_bw / 1e12:.2f} TB/s graph-replayed, {eager_bw / 1e12:.2f} "
          f"eager (1 GiB, read + written); ceiling = the larger", flush=True)
    for dt in IN_DTYPES:
        for cfg in [*CUDA_ROWS] + CONFIGS:
            r = time_store(dt, cfg)
            shape = (cfg, "-", "-") if cfg in CUDA_ROWS else cfg
            r.update(dtype=str(dt)[6:], rows=shape[0], num_warps=shape[1], tiles=shape[2],
                     pct=100 * r["bw"] / cbw)
            res["time"].append(r)
            print(f"{r['dtype']:14s} rows={shape[0]!s:>4} warps={shape[1]!s:>2} tiles={shape[2]} "
                  f"{r['us']:7.1f} us {r['bw'] / 1e9:7.0f} GB/s {r['pct']:5.1f}%", flush=True)
    print("\n| input | rows | warps | tiles | us | GB/s | % copy |\n|---|---|---|---|---|---|---|")
    for r in sorted(res["time"], key=lambda r: (r["dtype"], r["us"])):  # rows "cuda*": CUDA C++
        print(f"| {r['dtype']} | {r['rows']} | {r['num_warps']} | {r['tiles']} | {r['us']:.1f} | "
              f"{r['bw'] / 1e9:.0f} | {r['pct']:.1f} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "store_sweep.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
