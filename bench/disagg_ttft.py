"""TTFT and decode speed through the real server: colocated vs disaggregated (gRPC, NIXL).

Starts ``nibble serve`` as a subprocess per mode on a free loopback port,
sends ``--requests`` streaming chat requests one at a time with a
``--prompt-words``-word prompt (cache_salt per request, so nothing is reused),
and records TTFT and inter-token latency. Writes JSON and a bar chart.

    python -m nibble.bench.disagg_ttft --requests 5 --prompt-words 400 --out out/disagg
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

MODES = {"colocated": [], "disagg-grpc": ["--disaggregate", "--kv-transport", "grpc"],
         "disagg-nixl": ["--disaggregate", "--kv-transport", "nixl"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(mode: str, log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nibble.services.cli", "serve", "--port", str(port),
                             "--max-total-tokens", "16384", *MODES[mode]],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{mode} server exited; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{mode} server did not come up; see {log}")


def one(url: str, words: int, i: int, max_tokens: int) -> tuple[float, float]:
    body = {"messages": [{"role": "user", "content": f"Request {i}. " + "lorem ipsum " * words}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "cache_salt": f"bench-{i}-{time.time()}"}
    t0 = time.perf_counter()
    stamps = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.perf_counter())
    itl = statistics.mean(b - a for a, b in zip(stamps, stamps[1:])) if len(stamps) > 1 else 0
    return stamps[0] - t0, itl


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--prompt-words", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--out", default="out/disagg")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in args.modes:
        proc, url = start(mode, out / f"{mode}.log")
        try:
            one(url, 8, -1, 4)                                        # warm-up
            runs = [one(url, args.prompt_words, i, args.max_tokens) for i in range(args.requests)]
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        results.append({"mode": mode, "ttft_median_s": statistics.median(r[0] for r in runs),
                        "itl_mean_s": statistics.mean(r[1] for r in runs),
                        "prompt_words": args.prompt_words, "requests": args.requests})
        print(json.dumps(results[-1]), flush=True)
    (out / "disagg.json").write_text(json.dumps(results, indent=2))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar([r["mode"] for r in results], [r["ttft_median_s"] for r in results], color="tab:blue")
    a.set_ylabel("median TTFT (s)")
    b.bar([r["mode"] for r in results], [1e3 * r["itl_mean_s"] for r in results], color="tab:green")
    b.set_ylabel("mean inter-token latency (ms)")
    fig.suptitle("SmolLM2-135M, NVFP4 KV, 2-core CPU")
    fig.tight_layout()
    fig.savefig(out / "disagg.png", dpi=120)
    print(f"{'mode':<14}{'TTFT p50':>10}{'ITL':>10}")
    for r in results:
        print(f"{r['mode']:<14}{r['ttft_median_s']:>9.2f}s{1e3 * r['itl_mean_s']:>8.1f}ms")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
