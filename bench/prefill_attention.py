"""Prefill/extend attention of one chunk over its cached prefix: FlashAttention-2 varlen
against cuDNN's fused attention (Hopper kernels), on one GPU.

A chunk of ``n`` new tokens attends over ``c`` cached prefix rows plus itself
(bottom-right causal). The cuDNN route splits that into the prefix part (no mask,
``n x c``) and the chunk's own causal square (``n x n``) and merges the two by their
log-sum-exp (:mod:`nibble.kernels.ragged_cudnn`). Each route is checked against
FlashAttention-2 before it is timed; its first call on a new shape (cuDNN builds its
execution plans then) is reported apart as ``*_first_ms``.

    python -m nibble.bench.prefill_attention --output-file $OUT/prefill_attention.json

writes the JSON and a bar chart beside it (``prefill_attention.png``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nibble.kernels import ragged

CASES = ((2048, 0), (2048, 14336), (2048, 30720), (512, 30720), (1024, 30720),
         (4096, 28672), (8192, 24576))


def _time_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _flops(n: int, c: int, hq: int, d: int) -> float:
    """Useful attention FLOPs: QK^T and PV over the visible keys (causal square halved)."""
    return 4.0 * hq * d * n * (c + (n + 1) / 2)


def run_case(n: int, c: int, hq: int, hkv: int, d: int) -> dict:
    """Checks and times both routes for one ``(n, c)``; returns one JSON row."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(n + c)
    q = torch.randn(n, hq, d, device=dev, dtype=dt)
    k = torch.randn(c + n, hkv, d, device=dev, dtype=dt)
    v = torch.randn(c + n, hkv, d, device=dev, dtype=dt)
    cu_q = torch.tensor([0, n], device=dev, dtype=torch.int32)
    cu_k = torch.tensor([0, c + n], device=dev, dtype=torch.int32)
    scale = d ** -0.5
    spans = [(0, n, 0, c + n)]

    def route(kernel):
        return lambda: ragged.ragged_causal_attention(q, k, v, cu_q, cu_k, n, c + n, scale,
                                                      spans=spans, kernel=kernel)

    routes = {"fa2": route("fa2"), "cudnn": route("cudnn")}
    want = routes["fa2"]()
    row = {"n": n, "c": c, "hq": hq, "hkv": hkv, "d": d}
    flops = _flops(n, c, hq, d)
    for name, fn in routes.items():
        try:
            # the first call of a new shape: cuDNN builds (and caches) its execution plans
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = fn()
            torch.cuda.synchronize()
            row[f"{name}_first_ms"] = (time.perf_counter() - t0) * 1e3
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        except Exception as e:  # noqa: BLE001 - an unsupported route is a finding, reported
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        row[f"{name}_err"] = err
        if err > 2e-2:
            row[f"{name}_error"] = "output differs from FlashAttention-2"
            continue
        ms = _time_ms(fn)
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / ms / 1e9
    if "cudnn_ms" in row:
        row["speedup"] = row["fa2_ms"] / row["cudnn_ms"]
    return row


def plot(rows: list[dict], path: str) -> None:
    """Grouped bars of each route's TFLOP/s per ``(n, c)`` case, speed-ups written above."""
    from ._plots import pyplot, style
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.4
    for i, route in enumerate(("fa2", "cudnn")):
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        ax.bar(xs, [r.get(f"{route}_tflops", 0.0) for r in rows], width, label=route,
               color=style(i)["color"])
    for j, r in enumerate(rows):
        if "speedup" in r:
            ax.annotate(f"{r['speedup']:.2f}x", (j, r.get("cudnn_tflops", 0.0)), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [f"n={r['n']}\nc={r['c']}" for r in rows], fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("chunk attention over a cached prefix (32 q / 8 KV heads, d=128, bf16)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--output-file", default="prefill_attention.json")
    args = ap.parse_args(argv)
    rows = []
    for n, c in CASES:
        row = run_case(n, c, args.heads, args.kv_heads, args.head_dim)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.output_file, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "cudnn": torch.backends.cudnn.version(), "rows": rows}, f, indent=1)
    plot(rows, args.output_file.rsplit(".", 1)[0] + ".png")


if __name__ == "__main__":
    main()
