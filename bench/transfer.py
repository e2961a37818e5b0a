"""KV transfer bandwidth: NIXL against gRPC on loopback, between two processes.

For SmolLM2-135M pages (30 layers, 3 KV heads, head_dim 64, page_size 16) in
nvfp4 and fp8_e4m3, ``--total-mib`` of pages per format (whole pages: 647
nvfp4 pages of 103,680 bytes, 364 fp8 pages of 184,320 bytes for 64 MiB):
this process holds the sending pool (random bytes) and a spawned process the
receiving one, each with its own transport, as a prefill and a decode worker
would. Each run is one ticket for every page, timed from ``write_pages`` until
the sender's ``poll`` says ``success`` (gRPC: the receiver acknowledged the
last byte written into its pool; NIXL: the RDMA WRITE completed). One warm-up
run (connection set-up) is excluded; the figure is the median of ``--reps``.
After the runs the receiver's pages are checked to be bit-identical
(checksums). MB = 10^6 bytes. Writes ``transfer.json`` and ``transfer.png`` to
``--out`` and prints a table. Loopback only.

    python -m nibble.bench.transfer --out out/transfer
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import time

import torch

from nibble.kernels import PageLayout
from nibble.tiering.transfer import (TransferState, TransportUnavailableError, create_transport,
                                     page_set_checksum)
from nibble.tiering.transfer.grpc_wire import DEFAULT_CHUNK_BYTES
from nibble.tiering.transfer.loopback import LoopbackPeer, PoolSpec

GEOMETRIES = {
    "smollm2-135m": dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16),
    "qwen3-8b": dict(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16),
}
FORMATS = ("nvfp4", "fp8_e4m3")
TRANSPORTS = ("nixl", "grpc")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def bench_transport(name: str, args, secret: bytes) -> list[dict]:
    """Median page-write time per format for one transport; [] if it cannot start here."""
    layouts = {f: PageLayout(f, **GEOMETRIES[args.geometry]) for f in FORMATS}
    pages = {f: (args.total_mib << 20) // lay.page_nbytes for f, lay in layouts.items()}
    opts = {"grpc": {"chunk_bytes": args.chunk_bytes}}.get(name, {})
    try:
        peer = LoopbackPeer({f: PoolSpec(name, layouts[f], pages[f], device=args.peer_device)
                             for f in FORMATS}, secret)
    except TransportUnavailableError as e:
        print(f"skipping {name}: {e}")
        return []
    rows = []
    with peer:
        for fmt in FORMATS:
            n, lay = pages[fmt], layouts[fmt]
            src = torch.randint(0, 256, (n, lay.num_layers, lay.layer_nbytes), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(1)).to(args.device)
            tr = create_transport(name, secret=secret, **opts)
            try:
                tr.attach(src)
                # Computed once outside the timer, as the prefill worker does before sending;
                # the receiver's verification of it is part of every timed write.
                checksum = page_set_checksum(src, list(range(n))[::-1])
                times = [_one_write(peer, tr, fmt, n, checksum)
                         for _ in range(args.reps + 1)][1:]
                if peer.call("checksum", fmt, list(range(n))) != page_set_checksum(src, range(n)):
                    raise RuntimeError(f"{name}/{fmt}: received pages differ from the sent ones")
            finally:
                tr.close()
            sec = statistics.median(times)
            nbytes = n * lay.page_nbytes
            rows.append({"transport": name, "format": fmt, "pages": n,
                         "page_nbytes": lay.page_nbytes, "bytes": nbytes, "seconds": sec,
                         "all_seconds": times, "mb_s": nbytes / sec / 1e6, "pages_s": n / sec})
            ms = [round(t * 1e3, 1) for t in times]
            print(f"{name:<5} {fmt:<9} median {sec * 1e3:.1f} ms of {ms}")
    return rows


def _one_write(peer: LoopbackPeer, tr, fmt: str, n: int, checksum: str) -> float:
    """Seconds for one ticket covering every page (receiver pages in reverse order)."""
    ticket = peer.call("issue", fmt, "bench", list(range(n))[::-1], 120.0)
    t0 = time.perf_counter()
    status = tr.wait(tr.write_pages(peer.endpoints[fmt], ticket, list(range(n))[::-1],
                                    checksum=checksum), poll_interval_s=0.0)
    sec = time.perf_counter() - t0
    if status.state != TransferState.SUCCESS:
        raise RuntimeError(f"{tr.name}/{fmt} transfer failed: {status.error}")
    done = peer.call("wait", fmt, ticket.ticket_id, 30.0)
    if done is None or getattr(done, "reason", None) is not None:
        raise RuntimeError(f"{tr.name}/{fmt}: receiver did not install the pages: {done}")
    return sec


def plot(rows: list[dict], path: pathlib.Path, total_mib: int, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["transport"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    width = 0.8 / len(FORMATS)
    for ax, key, label in ((axes[0], "mb_s", "MB/s"), (axes[1], "pages_s", "pages/s")):
        for j, fmt in enumerate(FORMATS):
            val = {r["transport"]: r[key] for r in rows if r["format"] == fmt}
            ax.bar([i + j * width for i in range(len(names))], [val.get(t, 0) for t in names],
                   width, label=fmt)
        ax.set_xticks([i + width * (len(FORMATS) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names)
        ax.set_ylabel(label)
        ax.legend()
    where = ("host memory" if args.device == "cpu" else f"{args.device} -> {args.peer_device}")
    fig.suptitle(f"Nibble KV transfer, two processes, {where}: {total_mib} MiB of "
                 f"{args.geometry} pages per format")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    print(f"{'transport':<10} {'format':<9} {'pages':>6} {'MiB':>6} {'ms':>8} {'MB/s':>8} "
          f"{'pages/s':>9}")
    for r in rows:
        print(f"{r['transport']:<10} {r['format']:<9} {r['pages']:>6} {r['bytes'] / 2**20:>6.1f} "
              f"{r['seconds'] * 1e3:>8.1f} {r['mb_s']:>8.0f} {r['pages_s']:>9.0f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/transfer", help="directory for transfer.json/.png")
    ap.add_argument("--total-mib", type=int, default=64, help="page bytes per format")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    ap.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                    help="gRPC chunk size")
    ap.add_argument("--geometry", default="smollm2-135m", choices=sorted(GEOMETRIES),
                    help="page shape: the model whose KV pages move")
    ap.add_argument("--device", default="cpu", help="sender's pool (e.g. cuda:0)")
    ap.add_argument("--peer-device", default="cpu", help="receiver's pool (e.g. cuda:1)")
    args = ap.parse_args(argv)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    secret = os.urandom(32)
    rows = [r for name in args.transports for r in bench_transport(name, args, secret)]
    meta = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "nixl": _version("nixl-cu13") or _version("nixl"),
            "grpcio": _version("grpcio"), "geometry": GEOMETRIES[args.geometry],
            "device": args.device, "peer_device": args.peer_device, "reps": args.reps,
            "total_mib": args.total_mib, "grpc_chunk_bytes": args.chunk_bytes,
            "ucx_tls": os.environ.get("UCX_TLS"), "mb": 1e6,
            "timing": "write_pages until the sender's poll reports success; warm-up excluded"}
    (out / "transfer.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    plot(rows, out / "transfer.png", args.total_mib, args)
    print_table(rows)
    print(f"wrote {out / 'transfer.json'} and {out / 'transfer.png'}")


if __name__ == "__main__":
    main()
