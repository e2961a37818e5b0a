"""Does cuDNN build a plan inside a server step that :func:`warm_plans` should have built?

The warm-up prompt of a 2K-chunk serving run showed steps at odd multiples of 2048 prefix
rows about 70 ms slower than their neighbours, as if cuDNN built an execution plan there
(docs/benchmarks.md, "cuDNN prefill attention on the H200"). This probe, on one GPU:

1. ``keys``: times the first and the second call of one dense cuDNN shape while changing
   one thing at a time against the warmed call (another softmax scale, a K view at a row
   offset, K and V as distinct tensors, a padded query copy), to see what the plan key holds;
2. ``prompt``: warms the plans as the server does, then walks one prompt through
   ``ragged_causal_attention(kernel="cudnn")`` in chunks, with the server's scale and a
   gather workspace, timing every chunk's first and second call.

    python -m nibble.bench.cudnn_plans --output-file $OUT/cudnn_plans.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nibble.kernels import ragged_cudnn as rc
from nibble.kernels.ragged import ragged_causal_attention


def _ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def _first_second(fn) -> tuple[float, float]:
    return _ms(fn), _ms(fn)


def probe_keys(hq: int, hk: int, d: int, dev: torch.device) -> dict[str, list[float]]:
    """First/second call ms of one square shape under each change to the warmed call."""
    hf = rc._heads_first
    n, scale = 4096, d ** -0.5
    q = torch.randn(n + 4096, hq, d, dtype=torch.bfloat16, device=dev)
    kv = torch.randn(n + 4096, hk, d, dtype=torch.bfloat16, device=dev)
    k2 = torch.randn_like(kv)
    cases = {
        "warm (scale 1.0, K is V)": lambda: rc.cudnn_dense(hf(q[:n]), hf(kv[:n]), hf(kv[:n]),
                                                           True, 1.0),
        "server scale": lambda: rc.cudnn_dense(hf(q[:n]), hf(kv[:n]), hf(kv[:n]), True, scale),
        "K, V distinct": lambda: rc.cudnn_dense(hf(q[:n]), hf(kv[:n]), hf(k2[:n]), True, scale),
        "K, V at row 2048": lambda: rc.cudnn_dense(hf(q[:n]), hf(kv[2048:2048 + n]),
                                                   hf(k2[2048:2048 + n]), True, scale),
        "K, V at row 1807": lambda: rc.cudnn_dense(hf(q[:n]), hf(kv[1807:1807 + n]),
                                                   hf(k2[1807:1807 + n]), True, scale),
        "Q at row 1807": lambda: rc.cudnn_dense(hf(q[1807:1807 + n]), hf(kv[:n]), hf(k2[:n]),
                                                True, scale),
        "Q padded copy": lambda: rc.cudnn_dense(hf(rc._padded(q[:n - 1000], 1000, n)),
                                                hf(kv[:n]), hf(k2[:n]), True, scale),
        "new shape 4608 (control)": lambda: rc.cudnn_dense(hf(q[:4608]), hf(kv[:4608]),
                                                           hf(k2[:4608]), True, scale),
    }
    return {name: list(_first_second(fn)) for name, fn in cases.items()}


def probe_prompt(hq: int, hk: int, d: int, dev: torch.device, prompt: int, chunk: int,
                 context: int, decodes: int) -> dict:
    """Warm as the server does, then each chunk of one prompt: first and second call ms."""
    t = time.perf_counter()
    shapes = rc.warm_plans(hq, hk, d, torch.bfloat16, dev, chunk, context)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t
    ws_k = torch.randn(context, hk, d, dtype=torch.bfloat16, device=dev)
    ws_v = torch.randn_like(ws_k)
    rows, c = [], 0
    n_chunk = chunk - decodes
    while c < prompt:
        n = min(n_chunk, prompt - c)
        q = torch.randn(n, hq, d, dtype=torch.bfloat16, device=dev)
        cu_q = torch.tensor([0, n], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, c + n], dtype=torch.int32, device=dev)
        kk, vv = ws_k[:c + n], ws_v[:c + n]

        def call(q=q, kk=kk, vv=vv, cu_q=cu_q, cu_k=cu_k, n=n, c=c):
            with torch.inference_mode():
                ragged_causal_attention(q, kk, vv, cu_q, cu_k, n, c + n, d ** -0.5,
                                        spans=[(0, n, 0, c + n)], kernel="cudnn")
        first, second = _first_second(call)
        rows.append({"prefix": c, "rows": n, "first_ms": first, "second_ms": second})
        c += n
    return {"warm_shapes": shapes, "warm_s": warm_s, "chunks": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs=3, default=(32, 8, 128), metavar=("HQ", "HK", "D"))
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--context", type=int, default=40960)
    ap.add_argument("--decodes", type=int, nargs="+", default=(0, 11))
    ap.add_argument("--output-file", required=True)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    hq, hk, d = args.heads
    out = {"keys": probe_keys(hq, hk, d, dev)}
    for name, (a, b) in out["keys"].items():
        print(f"{name:28s} first {a:8.2f} ms  second {b:6.2f} ms")
    for dec in args.decodes:
        res = probe_prompt(hq, hk, d, dev, args.prompt, args.chunk, args.context, dec)
        out[f"prompt_decodes_{dec}"] = res
        print(f"decodes {dec}: warm {res['warm_shapes']} shapes {res['warm_s']:.1f}s")
        for r in res["chunks"]:
            flag = "  <-- slow first call" if r["first_ms"] > r["second_ms"] + 20 else ""
            print(f"  prefix {r['prefix']:6d} rows {r['rows']:5d} first {r['first_ms']:7.2f} "
                  f"second {r['second_ms']:6.2f}{flag}")
    with open(args.output_file, "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
