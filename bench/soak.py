"""Soak run: many concurrent streams for a while, with disconnects, aborts and injected faults.

    python -m nibble.bench.soak --duration 600 --concurrency 64          # the issue's run
    python -m nibble.bench.soak --duration 30 --concurrency 8 --l3 file   # a quick look

The benchmark starts its own ``nibble serve`` (two tenant keys and an admin key, given
through the environment), and with ``--l3 redis`` its own ``redis-server`` (never the
shared one). Every prompt carries a secret code of its own; an answer that contains
another prompt's code is a **wrong answer** (a swapped or forged cache record served to
the wrong request). Streams are cut by the client (``--disconnect-rate``) or aborted with
``/abort_request`` by their own tenant (``--abort-rate``). Faults, at fixed fractions of
the run: records swapped / overwritten / flipped in Redis (30%), Redis killed (50%) and
restarted (60%), in ``--disaggregate`` mode a decode worker killed (75%). The KV pool
(``--pool-tokens``) and L2 are small, so pages cycle down to L3 and back within the run.

Reported (JSON + plot): outcomes by kind, TTFT and end-to-end p99, wrong answers,
errors outside a fault's 5 s window (should be none), and whether in-use KV pages,
the server's RSS and its open file descriptors return to their baseline once idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import secrets
import tempfile
import time
from collections import Counter
from typing import Any

import httpx

from ._faults import PrivateRedis, corrupt_records, process_figures
from ._soak_client import RequestPlan, SoakResult, make_prompts, run_one
from ._server import ServerProcess

FAULT_WINDOW_S = 5.0
RETRY_CAP_S = 5.0           # longest Retry-After the load honours before trying again
PREFIX = "soak:kv:"
RSS_SLACK = 0.15            # RSS may end this much above baseline (allocator caches)
FD_SLACK = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nibble bench soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--max-requests", type=int, default=100_000, help="stop after this many")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disconnect-rate", type=float, default=0.1)
    p.add_argument("--abort-rate", type=float, default=0.05)
    p.add_argument("--l3", choices=["redis", "file", "none"], default="redis")
    p.add_argument("--pool-tokens", type=int, default=4096, help="KV pool (L1) size; L2 = L1")
    p.add_argument("--disaggregate", action="store_true")
    p.add_argument("--no-faults", action="store_true", help="load only, no injected faults")
    p.add_argument("--server-args", default="", help="extra `nibble serve` flags")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench_out/soak")
    return p.parse_args(argv)


def server_argv(args: argparse.Namespace, redis_url: str | None, scratch: str) -> list[str]:
    """Small L1 and L2 so pages cycle down to L3 within the run."""
    argv = ["--max-total-tokens", str(args.pool_tokens),
            "--max-running-requests", str(args.concurrency)]
    if args.l3 != "none":
        argv += ["--enable-hierarchical-cache", "--hicache-ratio", "1.0",
                 "--hicache-storage-backend", args.l3]
        argv += (["--hicache-storage-url", redis_url, "--hicache-storage-prefix", PREFIX]
                 if args.l3 == "redis" else ["--hicache-storage-url", f"{scratch}/l3"])
    if args.disaggregate:
        argv += ["--disaggregate"]
    return argv + args.server_args.split()


def fault_plan(args: argparse.Namespace) -> list[tuple[float, str]]:
    """(fraction of the run, fault) in time order."""
    if args.no_faults:
        return []
    plan = []
    if args.l3 == "redis":
        plan += [(0.30, "corrupt-records"), (0.50, "redis-kill"), (0.60, "redis-restart")]
    if args.disaggregate:
        plan.append((0.75, "kill-decode-worker"))
    return plan


class Soak:
    """One run: the server, its keys, the load, the faults and what they did."""

    def __init__(self, args: argparse.Namespace, srv: ServerProcess, keys: dict[str, str],
                 redis_srv: PrivateRedis | None):
        self.args, self.srv, self.keys, self.redis = args, srv, keys, redis_srv
        self.rng = random.Random(args.seed)
        self.prompts = make_prompts(args.num_prompts, self.rng)
        self.results: list[SoakResult] = []
        self.faults: list[dict[str, Any]] = []
        self.t0 = 0.0

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys['admin']}"}

    def info(self) -> dict[str, Any]:
        r = httpx.get(f"{self.srv.url}/get_server_info", headers=self.admin(), timeout=30)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout_s: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            if busy(info) == 0 or time.monotonic() > deadline:
                return info
            time.sleep(0.5)

    def plan_request(self) -> RequestPlan:
        a = self.args
        roll = self.rng.random()
        action = ("disconnect" if roll < a.disconnect_rate else
                  "abort" if roll < a.disconnect_rate + a.abort_rate else "finish")
        tenant = self.rng.choice(("tenant-a", "tenant-b"))
        return RequestPlan(self.rng.randrange(len(self.prompts)), tenant, self.keys[tenant],
                           action, self.rng.randint(1, 4))

    async def worker(self, client: httpx.AsyncClient, deadline: float, budget: list[int]) -> None:
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 1
            plan = self.plan_request()
            res = await run_one(client, self.srv.url, self.prompts, plan, self.args.max_tokens,
                                self.t0)
            self.results.append(res)
            if res.outcome == "refused":        # a real client honours Retry-After
                await asyncio.sleep(min(RETRY_CAP_S, max(0.1, res.retry_after)))

    async def inject(self, deadline: float) -> None:
        for frac, fault in fault_plan(self.args):
            at = self.t0 + frac * self.args.duration
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if time.monotonic() >= deadline:
                return
            detail = await asyncio.to_thread(self.apply_fault, fault)
            self.faults.append({"t": time.monotonic() - self.t0, "fault": fault,
                                "detail": detail})

    def apply_fault(self, fault: str) -> Any:
        if fault == "redis-kill":
            self.redis.kill()
            return None
        if fault == "redis-restart":
            self.redis.start()
            return None
        if fault == "corrupt-records":
            done = corrupt_records(self.redis.url, PREFIX, self.rng)
            return [{"kind": c.kind, "keys": list(c.keys)} for c in done]
        if fault == "kill-decode-worker":
            return kill_decode_worker(self.info())
        raise ValueError(fault)

    async def load(self) -> None:
        a = self.args
        self.t0 = time.monotonic()
        deadline = self.t0 + a.duration
        budget = [a.max_requests]
        limits = httpx.Limits(max_connections=a.concurrency + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
            tasks = [asyncio.create_task(self.worker(client, deadline, budget))
                     for _ in range(a.concurrency)]
            tasks.append(asyncio.create_task(self.inject(deadline)))
            await progress_until(deadline, tasks, self.results)


async def progress_until(deadline: float, tasks: list[asyncio.Task], results: list) -> None:
    """Show progress while ``tasks`` run; return when all are done."""
    from rich.progress import Progress

    total = max(1.0, deadline - time.monotonic())
    with Progress() as bar:
        job = bar.add_task("soak", total=total)
        while not all(t.done() for t in tasks):
            left = max(0.0, deadline - time.monotonic())
            bar.update(job, completed=total - left,
                       description=f"soak: {len(results)} requests")
            await asyncio.sleep(0.5)
    for t in tasks:
        t.result()


def kill_decode_worker(info: dict[str, Any]) -> dict[str, Any] | None:
    """SIGKILL one decode worker's process (a PID this run's server started)."""
    import signal

    workers = info.get("workers") or {}
    for name, w in sorted(workers.items()):
        if name.startswith("nibble-decode") and w.get("pid"):
            os.kill(int(w["pid"]), signal.SIGKILL)
            return {"worker": name, "pid": w["pid"]}
    return None


def classify(results: list[SoakResult], faults: list[dict[str, Any]], prompts) -> dict[str, Any]:
    """Outcomes by kind, wrong answers, and errors outside every fault window."""
    codes = [p.code for p in prompts]
    wrong = [r for r in results if any(c in r.text for i, c in enumerate(codes)
                                       if i != r.prompt)]
    errors = [r for r in results if r.outcome.startswith("error")]
    # 503 + Retry-After: admitted nothing, lost nothing (no worker of a role is up, e.g. while
    # Ray restarts a killed one); reported apart from errors, with the span they cover
    refused = [r for r in results if r.outcome == "refused"]
    windows = [(f["t"], f["t"] + FAULT_WINDOW_S) for f in faults]
    stray = [r for r in errors if not any(lo <= r.end <= hi for lo, hi in windows)]
    return {"outcomes": dict(Counter(r.outcome for r in results)),
            "wrong_answers": len(wrong),
            "wrong_examples": [{"prompt": r.prompt, "text": r.text[:120]} for r in wrong[:5]],
            "errors": len(errors), "errors_outside_fault_windows": len(stray),
            "refused": len(refused),
            "refused_span_s": [min(r.start for r in refused), max(r.end for r in refused)]
            if refused else None,
            "error_examples": sorted({r.detail[:160] for r in errors})[:10]}


def latency(results: list[SoakResult]) -> dict[str, Any]:
    from ._stats import distribution

    done = [r for r in results if r.outcome == "ok"]
    out = distribution([r.ttft for r in done if r.ttft is not None], "ttft")
    out.update(distribution([r.end - r.start for r in done], "e2e"))
    return out


def leak_check(base: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """Pages, RSS and fds at idle against the baseline taken after warm-up."""
    rss_ok = end["rss_mib"] <= base["rss_mib"] * (1 + RSS_SLACK)
    fds_ok = end["open_fds"] <= base["open_fds"] + FD_SLACK
    pages_ok = end.get("pages_in_use", 0) == 0
    return {"baseline": base, "idle_after": end, "pages_returned": pages_ok,
            "rss_returned": rss_ok, "fds_returned": fds_ok}


def busy(info: dict[str, Any]) -> int:
    """Requests running or queued, plus L1 pages that tier backups still pin (they come back
    when the backup lands, so a snapshot before that would count them as leaked); colocated
    or summed over disaggregated workers."""
    def pinned(stats: dict[str, Any]) -> int:
        return int((stats.get("tiers") or {}).get("backup_pinned_pages", 0))
    if "workers" in info:
        return sum(int(w.get("num_running", 0)) + int(w.get("num_queued", 0)) + pinned(w)
                   for w in info["workers"].values())
    return (int(info.get("running_requests", 0)) + int(info.get("queued_requests", 0))
            + pinned(info.get("stats") or {}))


def pages_in_use(info: dict[str, Any]) -> int:
    """KV pages referenced by anything (cached-but-free pages do not count)."""
    pools = ([info.get("kv_pool") or {}] if "workers" not in info else
             list(info["workers"].values()))
    return sum(int(p.get("total_pages", 0)) - int(p.get("free_pages", 0)) for p in pools)


def snapshot(soak: Soak) -> dict[str, Any]:
    info = soak.wait_idle()
    fig = process_figures(soak.srv.proc.pid)
    return {"rss_mib": fig.rss_mib, "open_fds": fig.open_fds, "pages_in_use": pages_in_use(info)}


def plot(results: list[SoakResult], faults: list[dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    kinds = sorted({r.outcome for r in results})
    for i, kind in enumerate(kinds):
        rs = [r for r in results if r.outcome == kind]
        ax.scatter([r.start for r in rs], [r.end - r.start for r in rs], s=6, label=kind,
                   color=f"C{i}", alpha=0.6)
    for f in faults:
        ax.axvline(f["t"], color="k", ls="--", lw=0.8)
        ax.text(f["t"], ax.get_ylim()[1] * 0.95, f" {f['fault']}", rotation=90, va="top",
                fontsize=8)
    ax.set(xlabel="request start (s)", ylabel="request duration (s)",
           title="every request of the soak run, by outcome")
    ax.legend(fontsize=8, markerscale=2)
    counts = Counter(r.outcome for r in results)
    bx.barh(list(counts), list(counts.values()), color=[f"C{kinds.index(k)}" for k in counts])
    bx.set(xlabel="requests", title="outcomes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = {name: secrets.token_urlsafe(24) for name in ("tenant-a", "tenant-b", "admin")}
    env = {"NIBBLE_API_KEY": f"{keys['tenant-a']},{keys['tenant-b']}",
           "NIBBLE_ADMIN_API_KEY": keys["admin"]}
    with tempfile.TemporaryDirectory(prefix="nibble-soak-") as scratch:
        redis_srv = PrivateRedis(scratch) if args.l3 == "redis" else None
        srv = ServerProcess(server_argv(args, redis_srv and redis_srv.url, scratch),
                            out / "server.log", env=env)
        try:
            srv.wait_healthy()
            soak = Soak(args, srv, keys, redis_srv)
            asyncio.run(warm_up(soak))
            base = snapshot(soak)
            asyncio.run(soak.load())
            end = snapshot(soak)
        finally:
            code = srv.stop()
            if redis_srv is not None:
                redis_srv.stop()
    record = {"args": vars(args), "requests": len(soak.results), "faults": soak.faults,
              **classify(soak.results, soak.faults, soak.prompts), **latency(soak.results),
              "leaks": leak_check(base, end), "server_exit_code": code}
    (out / "soak.json").write_text(json.dumps(record, indent=2))
    plot(soak.results, soak.faults, out / "soak.png")
    return record


async def warm_up(soak: Soak) -> None:
    """Each prompt once per tenant, so the baseline includes a warm cache."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        for i in range(len(soak.prompts)):
            for tenant in ("tenant-a", "tenant-b"):
                plan = RequestPlan(i, tenant, soak.keys[tenant], "finish", 0)
                await run_one(client, soak.srv.url, soak.prompts, plan, soak.args.max_tokens,
                              time.monotonic())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rec = run(args)
    summary = {k: rec[k] for k in ("requests", "outcomes", "wrong_answers", "errors",
                                   "errors_outside_fault_windows", "e2e_p99_ms", "ttft_p99_ms")}
    summary["leaks"] = {k: v for k, v in rec["leaks"].items() if k.endswith("returned")}
    print(json.dumps(summary, indent=2))
    print(f"wrote {pathlib.Path(args.out_dir) / 'soak.json'} and soak.png")


if __name__ == "__main__":
    main()
