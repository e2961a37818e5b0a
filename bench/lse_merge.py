"""The cuDNN prefill route's merge, torch form against the fused Triton kernel (issue 16).

For each (chunk rows n, cached prefix c) the two parts come from real cuDNN calls (their
strides are what the server merges). Checks the fused merge against the torch form first,
then times, with ``triton.testing.do_bench``: the merge alone in both forms, and one whole
layer's ``split_attention`` (both cuDNN calls and the merge) with each. JSON to
``--output-file``, a bar plot beside it::

    python -m nibble.bench.lse_merge --output-file $OUT/lse_merge.json
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
import triton

from nibble.kernels import ragged_cudnn as rc
from nibble.kernels.triton.lse_merge import merge_lse_into

CASES = ((2048, 2048), (2048, 14336), (2048, 30720), (512, 30720))


def _case(n: int, c: int, hq: int, hk: int, d: int, dev: torch.device) -> dict:
    gen = torch.Generator(dev).manual_seed(n + c)
    q = torch.randn(n, hq, d, generator=gen, device=dev, dtype=torch.bfloat16)
    k = torch.randn(c + n, hk, d, generator=gen, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    hf, scale = rc._heads_first, d ** -0.5
    o1, l1 = rc.cudnn_dense(hf(q), hf(k[:c]), hf(v[:c]), False, scale)
    o2, l2 = rc.cudnn_dense(hf(q), hf(k[c:]), hf(v[c:]), True, scale)
    want, got = torch.empty_like(q), torch.empty_like(q)
    rc.merge_into(want, o1, l1, o2, l2)
    merge_lse_into(got, o1, l1, o2, l2)
    err = float((got.double() - want.double()).norm() / want.double().norm())
    spans = [(0, n, 0, c + n)]

    def layer(merge):
        return lambda: rc.split_attention(q, k, v, spans, scale, rc.cudnn_dense, rc.Q_BUCKET,
                                          rc.KEY_BLOCK, merge=merge)
    ms = {
        "merge_torch": triton.testing.do_bench(lambda: rc.merge_into(want, o1, l1, o2, l2)),
        "merge_fused": triton.testing.do_bench(lambda: merge_lse_into(got, o1, l1, o2, l2)),
        "layer_torch": triton.testing.do_bench(layer(rc.merge_into)),
        "layer_fused": triton.testing.do_bench(layer(merge_lse_into)),
    }
    moved = 2 * o1.numel() * o1.element_size() + q.numel() * q.element_size()
    return {"n": n, "c": c, "rel_err": err, "ms": ms,
            "fused_gb_s": moved / (ms["merge_fused"] * 1e-3) / 1e9}


def _plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"n={r['n']}\nc={r['c']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for i, (kind, title) in enumerate((("merge", "merge alone"), ("layer", "one layer's attention"))):
        ax[i].bar([j - 0.2 for j in x], [r["ms"][f"{kind}_torch"] for r in rows], 0.4, label="torch")
        ax[i].bar([j + 0.2 for j in x], [r["ms"][f"{kind}_fused"] for r in rows], 0.4, label="fused")
        ax[i].set_xticks(list(x), labels)
        ax[i].set_ylabel("ms")
        ax[i].set_title(title)
        ax[i].legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-file", type=pathlib.Path, default=None)
    ap.add_argument("--heads", type=int, nargs=3, default=(32, 8, 128), metavar=("HQ", "HK", "D"))
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    with torch.inference_mode():
        for n, c in CASES:
            rows.append(_case(n, c, *a.heads, dev))
            r = rows[-1]
            print(f"n={n} c={c} err={r['rel_err']:.1e} " + " ".join(
                f"{k}={v:.3f}ms" for k, v in r["ms"].items()) + f" fused {r['fused_gb_s']:.0f} GB/s",
                flush=True)
    if a.output_file:
        a.output_file.write_text(json.dumps({"cases": rows}, indent=1))
        _plot(rows, a.output_file.with_suffix(".png"))


if __name__ == "__main__":
    main()
