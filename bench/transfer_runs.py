"""KV transfer of one long request: descriptors per request and GB/s, fresh against
fragmented pools, pages in the free list's order against pages in runs.

One request of ``--tokens`` tokens (default 32K: 2,048 Qwen3-8B NVFP4 pages of
663,552 bytes, 1.36 GB) moves from a sending pool here to a receiving pool in
a spawned process (``LoopbackPeer``), both ``--pool-pages`` pages. Which pages
it uses on each side comes from a ``PageAllocator`` per side:

* ``fresh``: a new allocator on both sides;
* ``fragmented``: first ``--churn-steps`` steps of a workload, then streams
  are freed (tail-first) until the request fits: on the receiving (decode)
  side streams admitted with a prompt grow one page per step, interleaved with
  the others; on the sending (prefill) side streams take their pages at once,
  in 8K-token chunks.

and is taken in two orders: ``list`` (the source in 8K-token prefill chunks
from the head of the free list, the destination in one ``allocate``: the
allocation before runs) and ``runs`` (``grow``'s sorted chunks,
``allocate_runs`` on the source; ``reserve``'s ``allocate_runs(n, 2.0)`` on the
destination). ``runs`` is the number of runs adjacent on both sides
(``merge_runs``): what NIXL posts after merging. Each transport mode then
moves it: ``nixl`` (one descriptor per run, ``coalesce``), ``nixl-pages``
(one prepped descriptor per page, the path before runs) and ``grpc``.

Before any timing, the first (warm-up) write of every case is checked
bit-identical at the destination (page-set checksums of source and
destination pages); each figure is the median of ``--reps`` timed writes,
from ``write_pages`` until the sender's poll says success. GB = 10^9 bytes.
Writes ``transfer_runs.json`` to ``--out``; loopback only. ``--device`` and
``--peer-device`` put the two pools in VRAM (``cuda:0 cuda:0``: both on one GPU).

    python -m nibble.bench.transfer_runs --out out/transfer_runs
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import time

import torch

from nibble.kernels import PageLayout
from nibble.tiering.allocator import PageAllocator
from nibble.tiering.page_runs import merge_runs
from nibble.tiering.transfer import (TransferState, TransportUnavailableError, create_transport,
                                     page_set_checksum)
from nibble.tiering.transfer.loopback import LoopbackPeer, PoolSpec

from .transfer import GEOMETRIES, _version

MODES = {"nixl": ("nixl", {"coalesce": True}), "nixl-pages": ("nixl", {"coalesce": False}),
         "grpc": ("grpc", {})}
PREFILL_CHUNK_PAGES = 512          # 8K-token prefill chunks of 16-token pages


def churn(alloc: PageAllocator, need: int, steps: int, rng: random.Random, decode: bool
          ) -> None:
    """Fragment ``alloc`` for ``steps`` steps, then free streams (tail-first, as sequences
    do) until ``need`` pages are free. ``decode``: streams start with a prompt and grow one
    page per step, interleaved (a decode worker); else each takes its pages at once in
    8K-token chunks and only waits (a prefill worker holding pages until sent)."""
    streams: list[list[int]] = []
    cap = alloc.num_pages - need // 2
    for _ in range(steps):
        if len(streams) < 8 and alloc.num_used < cap // 2:
            size = rng.randint(8, 160) if decode else rng.randint(16, 1024)
            s: list[int] = []
            while len(s) < size and alloc.num_free:
                s += alloc.allocate_runs(min(PREFILL_CHUNK_PAGES, size - len(s), alloc.num_free))
            streams.append(s)
        for s in streams:
            if decode and alloc.num_used < cap:
                s.extend(alloc.allocate(1))
        if streams and rng.random() < 0.08:
            alloc.free(list(reversed(streams.pop(rng.randrange(len(streams))))))
    while alloc.num_free < need:
        alloc.free(list(reversed(streams.pop(rng.randrange(len(streams))))))


def request_pages(pool_pages: int, n: int, fragmented: bool, order: str, steps: int,
                  seed: int) -> tuple[list[int], list[int]]:
    """(source, destination) pages of an ``n``-page request (see the module docstring)."""
    src_alloc, dst_alloc = PageAllocator(pool_pages), PageAllocator(pool_pages)
    if fragmented:
        churn(src_alloc, n, steps, random.Random(seed), decode=False)
        churn(dst_alloc, n, steps, random.Random(seed + 1), decode=True)
    src: list[int] = []
    while len(src) < n:
        take = min(PREFILL_CHUNK_PAGES, n - len(src))
        src += (src_alloc.allocate(take) if order == "list"
                else src_alloc.allocate_runs(take, 1.0))
    dst = dst_alloc.allocate(n) if order == "list" else dst_alloc.allocate_runs(n, 2.0)
    return [int(p) for p in src], [int(p) for p in dst]


def _write(peer: LoopbackPeer, tr, src: list[int], dst: list[int], checksum: str
           ) -> tuple[float, int]:
    """Seconds and descriptors of one write of ``src`` into ``dst``, installed by the peer."""
    ticket = peer.call("issue", "pool", "bench", dst, 300.0)
    t0 = time.perf_counter()
    handle = tr.write_pages(peer.endpoints["pool"], ticket, src, checksum=checksum)
    status = tr.wait(handle, poll_interval_s=0.0)
    sec = time.perf_counter() - t0
    if status.state != TransferState.SUCCESS:
        raise RuntimeError(f"{tr.name} transfer failed: {status.error}")
    done = peer.call("wait", "pool", ticket.ticket_id, 300.0, timeout_s=330)
    if done is None or getattr(done, "reason", None) is not None:
        raise RuntimeError(f"{tr.name}: receiver did not install the pages: {done}")
    return sec, handle.descriptors


def bench_mode(mode: str, args, layout: PageLayout, cases: dict, src_pool: torch.Tensor,
               secret: bytes) -> list[dict]:
    name, opts = MODES[mode]
    if name == "grpc":
        opts = {**opts, "chunk_bytes": args.chunk_bytes}
    try:
        peer = LoopbackPeer({"pool": PoolSpec(name, layout, args.pool_pages, opts=(
            {"max_chunk_bytes": args.chunk_bytes} if name == "grpc" else {}),
            device=args.peer_device)}, secret)
    except TransportUnavailableError as e:
        print(f"skipping {mode}: {e}")
        return []
    rows = []
    with peer:
        tr = create_transport(name, secret=secret, **opts)
        try:
            tr.attach(src_pool)
            for (pool_state, order), (src, dst) in cases.items():
                peer.call("zero", "pool")
                checksum = page_set_checksum(src_pool, src)
                _write(peer, tr, src, dst, checksum)                  # warm-up, then verify
                if peer.call("checksum", "pool", dst, timeout_s=300) != checksum:
                    raise RuntimeError(f"{mode}/{pool_state}/{order}: pages differ at the peer")
                timed = [_write(peer, tr, src, dst, checksum) for _ in range(args.reps)]
                sec = statistics.median(t for t, _ in timed)
                nbytes = len(src) * layout.page_nbytes
                rows.append({"mode": mode, "pool": pool_state, "order": order,
                             "pages": len(src), "bytes": nbytes, "runs": len(merge_runs(src, dst)),
                             "descriptors": timed[0][1], "seconds": sec,
                             "all_seconds": [t for t, _ in timed], "gb_s": nbytes / sec / 1e9})
                r = rows[-1]
                print(f"{mode:<10} {pool_state:<10} {order:<5} runs {r['runs']:>5} "
                      f"descriptors {r['descriptors']:>5} {sec * 1e3:9.1f} ms "
                      f"{r['gb_s']:6.2f} GB/s  {[round(t * 1e3) for t, _ in timed]}")
        finally:
            tr.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/transfer_runs")
    ap.add_argument("--geometry", default="qwen3-8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--pool-pages", type=int, default=3072)
    ap.add_argument("--churn-steps", type=int, default=400)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20, help="gRPC chunk size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="sender's pool (e.g. cuda:0)")
    ap.add_argument("--peer-device", default="cpu", help="receiver's pool (e.g. cuda:0)")
    args = ap.parse_args(argv)

    layout = PageLayout(args.format, **GEOMETRIES[args.geometry])
    n = -(-args.tokens // layout.page_size)
    cases = {(state, order): request_pages(args.pool_pages, n, state == "fragmented", order,
                                           args.churn_steps, args.seed)
             for state in ("fresh", "fragmented") for order in ("list", "runs")}
    for (state, order), (src, dst) in cases.items():
        print(f"{state:<10} {order:<5} {n} pages: {len(merge_runs(src, dst))} runs")
    src_pool = torch.randint(0, 256, (args.pool_pages, layout.num_layers, layout.layer_nbytes),
                             dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
                             ).to(args.device)
    secret = os.urandom(32)
    rows = [r for mode in args.modes
            for r in bench_mode(mode, args, layout, cases, src_pool, secret)]
    meta = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "nixl": _version("nixl-cu13") or _version("nixl"),
            "grpcio": _version("grpcio"), "geometry": GEOMETRIES[args.geometry],
            "format": args.format, "page_nbytes": layout.page_nbytes, "tokens": args.tokens,
            "pool_pages": args.pool_pages, "churn_steps": args.churn_steps, "reps": args.reps,
            "grpc_chunk_bytes": args.chunk_bytes, "seed": args.seed, "gb": 1e9,
            "device": args.device, "peer_device": args.peer_device,
            "timing": "write_pages until the sender's poll reports success; warm-up excluded, "
                      "pages verified bit-identical after it"}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer_runs.json").write_text(json.dumps({"meta": meta, "results": rows},
                                                       indent=1))
    print(f"wrote {out / 'transfer_runs.json'}")


if __name__ == "__main__":
    main()
