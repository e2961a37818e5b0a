"""Tier bandwidth: L1<->L2 page copies and L2<->L3 page records (Redis, file).

For SmolLM2-135M pages (30 layers, 3 KV heads, head_dim 64, page_size 16) in
nvfp4 and fp8_e4m3, about ``--total-mib`` of random pages per format:

* L1->L2 / L2->L1: ``torch`` copies between a pool tensor (the GPU when there
  is one) and a host tensor (pinned with CUDA), page by page in batches of
  ``--batch`` as the tier worker does, and as one bulk copy (the ceiling).
* encode / decode: ``page_record.encode_page`` / ``decode_page`` (HMAC-SHA256).
* Redis / file put and get: pre-encoded records in batches of ``--batch``;
  every record read back is checked to decode to its page bit for bit.

MB = 10^6 bytes; each figure is the median of ``--reps`` runs. Writes
``tiers.json`` and ``tiers.png`` to ``--out`` and prints a table. The file
backend's reads come from the OS page cache, as they will in service.

    python -m nibble.bench.tiers --out out/tiers [--redis-url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time
import uuid

import torch
from tqdm import tqdm

from nibble.kernels import PageLayout
from nibble.tiering.page_record import (PageHeader, chain_keys, decode_page, encode_page,
                                        namespace_root)
from nibble.tiering.secret import KVSecret
from nibble.tiering.storage import create_storage_backend

GEOMETRY = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16)  # SmolLM2-135M
FORMATS = ("nvfp4", "fp8_e4m3")
SECRET = KVSecret.generate()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, reps: int, bar, setup=None) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` runs (``setup()`` untimed before each)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        bar.update(1)
    return statistics.median(times)


def _row(fmt: str, op: str, n_pages: int, nbytes: int, seconds: float) -> dict:
    return {"format": fmt, "op": op, "pages": n_pages, "bytes": nbytes, "seconds": seconds,
            "mb_s": nbytes / seconds / 1e6, "pages_s": n_pages / seconds}


def bench_copies(fmt: str, host_pages: torch.Tensor, dev: torch.device, args, bar) -> list[dict]:
    """L1<->L2: ``pool[p]`` <-> ``host[p]`` per page in batches, and one bulk copy."""
    n = host_pages.shape[0]
    pool = torch.empty_like(host_pages, device=dev)
    host = torch.empty_like(host_pages, pin_memory=dev.type == "cuda")
    pool.copy_(host_pages)
    order = torch.randperm(n).tolist()
    batches = [order[i:i + args.batch] for i in range(0, n, args.batch)]

    def per_page(dst, src):
        for batch in batches:
            for p in batch:
                dst[p].copy_(src[p], non_blocking=True)
            _sync(dev)

    def bulk(dst, src):
        dst.copy_(src, non_blocking=True)
        _sync(dev)

    nbytes, rows = host_pages.numel(), []
    for op, fn, dst, src in (("L1->L2 per page", per_page, host, pool),
                             ("L2->L1 per page", per_page, pool, host),
                             ("L1->L2 bulk", bulk, host, pool), ("L2->L1 bulk", bulk, pool, host)):
        fn(dst, src)  # warm up
        rows.append(_row(fmt, op, n, nbytes, _timed(lambda: fn(dst, src), args.reps, bar)))
    assert torch.equal(host.cpu(), host_pages) and torch.equal(pool.cpu(), host_pages)
    return rows


def bench_store(fmt: str, kind: str, target: str, keys, records, header, host_pages, args,
                bar) -> list[dict]:
    """Put and get every record through a backend in batches; check the reads."""
    opts = {"prefix": f"nibble:bench:{uuid.uuid4().hex}:"} if kind == "redis" else {}
    store = create_storage_backend(kind, target, **opts)
    try:
        if not store.health().up:
            print(f"skipping {kind}: {store.health().last_error}")
            bar.update(2 * args.reps)
            return []
        items = list(zip(keys, records))
        chunks = [items[i:i + args.batch] for i in range(0, len(items), args.batch)]
        key_chunks = [keys[i:i + args.batch] for i in range(0, len(keys), args.batch)]
        stored = []

        def put():
            stored.append(sum(store.put_batch(c) for c in chunks))

        got: list = []

        def get():
            got[:] = [b for c in key_chunks for b in store.get_batch(c)]

        t_put = _timed(put, args.reps, bar, setup=store.clear)
        t_get = _timed(get, args.reps, bar)
        if set(stored) != {len(items)} or got != records:
            raise RuntimeError(f"{kind}: stored {stored}, read {sum(b is not None for b in got)}"
                               f" of {len(items)} records")
        for i in range(0, len(got), max(1, len(got) // 8)):
            payload = decode_page(got[i], header, key=keys[i], secret=SECRET)
            body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            assert torch.equal(body.view_as(host_pages[i]), host_pages[i])
        nbytes = sum(len(r) for r in records)
        return [_row(fmt, f"{kind} put", len(items), nbytes, t_put),
                _row(fmt, f"{kind} get", len(items), nbytes, t_get)]
    finally:
        store.clear()
        store.close()


def bench_format(fmt: str, dev: torch.device, file_dir: str, args, bar) -> list[dict]:
    layout = PageLayout(fmt, **GEOMETRY)
    n = max(args.batch, (args.total_mib << 20) // layout.page_nbytes)
    g = torch.Generator().manual_seed(0)
    host_pages = torch.randint(0, 256, (n, layout.num_layers, layout.layer_nbytes),
                               dtype=torch.uint8, generator=g)
    scales = torch.rand((layout.num_layers, 2), generator=g) + 0.5
    header = PageHeader.for_pool(layout, 1, scales)
    tokens = torch.randint(0, 49_152, (n * layout.page_size,), generator=g).tolist()
    root = namespace_root("bench-smollm2", layout, "bench", secret=SECRET)
    keys = chain_keys(root, tokens, layout.page_size, secret=SECRET)
    rows = bench_copies(fmt, host_pages, dev, args, bar)

    records: list[bytes] = []

    def encode():
        records[:] = [encode_page(header, host_pages[i], key=keys[i], secret=SECRET)
                      for i in range(n)]

    t_enc = _timed(encode, args.reps, bar)
    t_dec = _timed(lambda: [decode_page(r, header, key=k, secret=SECRET)
                            for k, r in zip(keys, records)], args.reps, bar)
    nbytes = sum(len(r) for r in records)
    rows += [_row(fmt, "encode", n, nbytes, t_enc), _row(fmt, "decode", n, nbytes, t_dec)]
    rows += bench_store(fmt, "redis", args.redis_url, keys, records, header, host_pages, args, bar)
    rows += bench_store(fmt, "file", f"{file_dir}/{fmt}", keys, records, header, host_pages,
                        args, bar)
    return rows


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, len(ops) * 0.9), 4.5))
    width = 0.8 / len(FORMATS)
    for j, fmt in enumerate(FORMATS):
        val = {r["op"]: r["mb_s"] for r in rows if r["format"] == fmt}
        ax.bar([i + j * width for i in range(len(ops))], [val.get(op, 0) for op in ops],
               width, label=fmt)
    ax.set_xticks([i + width * (len(FORMATS) - 1) / 2 for i in range(len(ops))])
    ax.set_xticklabels(ops, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("MB/s (log)")
    ax.set_title("Nibble KV tiers: bandwidth of SmolLM2-135M pages")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    print(f"{'op':<16} {'format':<9} {'pages':>6} {'MiB':>7} {'ms':>8} {'MB/s':>9} {'pages/s':>9}")
    for r in rows:
        print(f"{r['op']:<16} {r['format']:<9} {r['pages']:>6} {r['bytes'] / 2**20:>7.1f} "
              f"{r['seconds'] * 1e3:>8.1f} {r['mb_s']:>9.0f} {r['pages_s']:>9.0f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/tiers", help="directory for tiers.json and tiers.png")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--file-dir", default=None, help="file backend directory (default: a temp dir)")
    ap.add_argument("--total-mib", type=int, default=64, help="page bytes per format")
    ap.add_argument("--batch", type=int, default=64, help="pages per batch")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    steps = len(FORMATS) * args.reps * 10
    with tempfile.TemporaryDirectory(prefix="nibble-tiers-", dir=args.file_dir) as file_dir, \
            tqdm(total=steps, desc="tiers", unit="run") as bar:
        for fmt in FORMATS:
            rows += bench_format(fmt, dev, file_dir, args, bar)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "pinned_host": dev.type == "cuda", "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "geometry": GEOMETRY, "batch": args.batch, "reps": args.reps,
            "total_mib": args.total_mib, "mb": 1e6}
    (out / "tiers.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    plot(rows, out / "tiers.png")
    print_table(rows)
    print(f"wrote {out / 'tiers.json'} and {out / 'tiers.png'}")


if __name__ == "__main__":
    main()
