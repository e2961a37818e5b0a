"""How much attention the cuDNN prefill route computes for nothing, chunk by chunk (no GPU).

The route (``kernels/ragged_cudnn.split_plan``) attends a chunk of ``n`` rows after ``c``
cached ones in up to three dense calls; the causal square's dummy leading rows and the
padding to query buckets are work that no real score needs. This counts, for one prompt of
``--input-len`` tokens in chunks of ``--chunk`` tokens less the decode rows riding in each
step's budget (``--riders``: a step budget of ``--chunk`` tokens counts each decode), the
score pairs each chunk computes against the causal pairs it needs, with and without the
middle part (``--mid-block``), and turns them into milliseconds at the Qwen3-8B shape.

``--fit PREFILL_PROFILE.json`` also fits ``chunk_ms = a + b * needed + w * wasted`` (pairs
counted as the kernels that ran computed them, ``--fit-mid-block``) to the chunk times that
``bench/prefill_profile.py`` measured, to see whether the waste shows in them.

    python -m nibble.bench.split_work --riders 0 8 --fit docs/results/h200/prefill_profile_s9_riders.json \\
        --out out/split_work.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from nibble.kernels.ragged import CUDNN_AUTO_MIN_ROWS
from nibble.kernels.ragged_cudnn import KEY_BLOCK, MID_BLOCK, Q_BUCKET, split_plan

from ._timing import save


def chunk_pairs(c: int, n: int, mid_block: int, q_bucket: int = Q_BUCKET,
                key_block: int = KEY_BLOCK) -> tuple[float, float]:
    """``(needed, computed)`` score pairs per head of one chunk: ``n * c + n^2 / 2`` against
    the split's calls (an unmasked call all its rows x keys, the square half of rows^2). A
    chunk below ``CUDNN_AUTO_MIN_ROWS`` rows takes FlashAttention-2, which computes what it
    needs (``choose_kernel``)."""
    if n < CUDNN_AUTO_MIN_ROWS:
        return n * c + n * n / 2, n * c + n * n / 2
    computed = 0.0
    for call in split_plan(c, n, q_bucket, key_block, mid_block):
        computed += call.rows * call.rows / 2 if call.causal else call.rows * call.keys
    return n * c + n * n / 2, computed


def chunks_of(input_len: int, chunk: int) -> list[tuple[int, int]]:
    """``(cached, n)`` of each chunk of a prompt."""
    return [(c, min(chunk, input_len - c)) for c in range(0, input_len, chunk)]


def scenario(args, riders: int, mid_block: int) -> dict:
    n = args.chunk - riders
    rows = [chunk_pairs(c, m, mid_block) for c, m in chunks_of(args.input_len, n)]
    ms_per_pair = args.flop_per_pair / (args.tflops * 1e12) * 1e3
    wasted = [comp - need for need, comp in rows]
    return {"riders": riders, "chunk_tokens": n, "mid_block": mid_block, "chunks": len(rows),
            "needed_mpairs": [need / 1e6 for need, _ in rows],
            "wasted_mpairs": [w / 1e6 for w in wasted],
            "wasted_ms": [w * ms_per_pair for w in wasted],
            "wasted_ms_total": sum(wasted) * ms_per_pair,
            "needed_ms_total": sum(need for need, _ in rows) * ms_per_pair}


def fit(path: str, mid_block: int, input_len: int, riders: int, skipped: int) -> dict:
    """Least squares of ``prefill_profile``'s chunk times on needed and wasted pairs: its run
    of one ``input_len`` prompt beside ``riders`` decodes, ``skipped`` profiled chunks left
    out of its list (those after the first half, as its ``run_format`` does)."""
    res = json.load(open(path))
    res = res[0] if isinstance(res, list) else res
    step = res["chunk"] - riders
    total = -(-input_len // step)
    mid = max(1, -(-input_len // res["chunk"]) // 2)
    index = list(range(mid)) + list(range(mid + skipped, total))
    x, y = [], []
    for k, t in zip(index, res["chunk_ms"]):
        c = k * step
        if c + step > input_len:
            continue                         # the short last chunk samples the prompt too
        need, comp = chunk_pairs(c, step, mid_block)
        x.append([1.0, need / 1e6, (comp - need) / 1e6])
        y.append(t)
    x, y = np.array(x), np.array(y)
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    base = np.linalg.lstsq(x[:, :2], y, rcond=None)[0]

    def r2(pred):
        return float(1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    return {"file": path, "chunks_fitted": len(y), "ms_fixed": float(coef[0]),
            "ms_per_mpair_needed": float(coef[1]), "ms_per_mpair_wasted": float(coef[2]),
            "r2": r2(x @ coef), "r2_without_waste": r2(x[:, :2] @ base),
            "residual_ms": [float(v) for v in y - x @ coef]}


def plot(data: dict, png) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for s in data["scenarios"]:
        label = (f"{s['chunk_tokens']}-token chunks ({s['riders']} decodes), "
                 f"{'mid block ' + str(s['mid_block']) if s['mid_block'] else 'no mid block'}: "
                 f"{s['wasted_ms_total']:.0f} ms in all")
        ax.plot(range(len(s["wasted_ms"])), s["wasted_ms"], marker="o", ms=3, label=label)
    ax.set_xlabel("chunk of the prompt")
    ax.set_ylabel(f"wasted attention, ms at {data['tflops']:.0f} TFLOP/s")
    ax.set_title(f"Dummy and padded score pairs of the cuDNN split, {data['input_len']}-token "
                 "prompt (Qwen3-8B shape)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=2048, help="the step budget, tokens")
    ap.add_argument("--riders", type=int, nargs="+", default=[0, 8])
    ap.add_argument("--mid-block", type=int, nargs="+", default=[0, MID_BLOCK])
    ap.add_argument("--tflops", type=float, default=500.0,
                    help="attention rate for the ms figures (cuDNN on the H200: ~500)")
    ap.add_argument("--flop-per-pair", type=float, default=4 * 128 * 32 * 36,
                    help="FLOPs per (query, key) pair and step: QK and PV, head_dim 128, "
                         "32 query heads, 36 layers (Qwen3-8B)")
    ap.add_argument("--fit", default=None, help="a prefill_profile JSON to fit")
    ap.add_argument("--fit-mid-block", type=int, default=0,
                    help="the mid block of the tree that measured --fit")
    ap.add_argument("--fit-riders", type=int, default=8, help="its --decode-riders")
    ap.add_argument("--fit-profile-chunks", type=int, default=2, help="its --profile-chunks")
    ap.add_argument("--out", default="out/split_work.json")
    args = ap.parse_args(argv)
    data = {"input_len": args.input_len, "tflops": args.tflops,
            "scenarios": [scenario(args, r, m) for r in args.riders for m in args.mid_block]}
    if args.fit:
        data["fit"] = fit(args.fit, args.fit_mid_block, args.input_len, args.fit_riders,
                          args.fit_profile_chunks)
    for s in data["scenarios"]:
        print(f"{s['chunk_tokens']:>5}-token chunks, mid block {s['mid_block']:>4}: "
              f"{s['chunks']} chunks, wasted {s['wasted_ms_total']:6.1f} ms of "
              f"{s['needed_ms_total']:6.1f} ms needed, worst chunk {max(s['wasted_ms']):5.1f} ms")
    if "fit" in data:
        f = data["fit"]
        print(f"fit of {f['chunks_fitted']} chunks: {f['ms_fixed']:.1f} ms + "
              f"{f['ms_per_mpair_needed']:.3f} ms/Mpair needed + {f['ms_per_mpair_wasted']:.3f} "
              f"ms/Mpair wasted; R^2 {f['r2']:.3f} (without the waste term {f['r2_without_waste']:.3f})")
    save(data, args.out, plot)


if __name__ == "__main__":
    main()
