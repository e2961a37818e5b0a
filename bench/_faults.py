"""Faults a soak run injects, and the process figures it watches.

- ``PrivateRedis``: a ``redis-server`` of the benchmark's own on a free loopback port,
  which it may kill (SIGKILL, as a crash) and restart; stopped by PID, never by name.
- ``corrupt_records``: what an attacker with Redis write access does to page records
  (swap two values, plant random bytes, flip one byte).
- ``process_figures``: RSS and open file descriptors of a PID (from ``/proc``).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

import redis

from ._server import BenchServerError, free_port


class PrivateRedis:
    """``redis-server`` on 127.0.0.1:<free port>, no persistence, owned by this process."""

    def __init__(self, workdir: str):
        exe = shutil.which("redis-server")
        if exe is None:
            raise BenchServerError("redis-server is not installed; run with --l3 file")
        self.exe, self.workdir = exe, workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise BenchServerError(f"private redis-server on port {self.port} did not start")

    def kill(self) -> None:
        """SIGKILL, as a crash: every stored record is gone, connections break."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass(frozen=True)
class Corruption:
    kind: str            # "swap" | "random" | "flip"
    keys: tuple[str, ...]


def corrupt_records(url: str, prefix: str, rng: random.Random, count: int = 3
                    ) -> list[Corruption]:
    """Tamper with up to ``count`` page records under ``prefix``: swap two records' values,
    overwrite one with random bytes, flip one byte of another. Returns what was done."""
    client = redis.Redis.from_url(url, socket_timeout=2)
    keys = sorted(client.scan_iter(match=prefix + "*", count=1000))
    rng.shuffle(keys)
    done: list[Corruption] = []
    while len(done) < count and len(keys) >= 2:
        kind = ("swap", "random", "flip")[len(done) % 3]
        if kind == "swap":
            a, b = keys.pop(), keys.pop()
            va, vb = client.get(a), client.get(b)
            if va is None or vb is None:
                continue
            client.set(a, vb)
            client.set(b, va)
            done.append(Corruption(kind, (a.decode(), b.decode())))
            continue
        k = keys.pop()
        v = client.get(k)
        if v is None:
            continue
        if kind == "random":
            new = rng.randbytes(len(v))
        else:
            i = rng.randrange(len(v))
            new = v[:i] + bytes([v[i] ^ 0x40]) + v[i + 1:]
        client.set(k, new)
        done.append(Corruption(kind, (k.decode(),)))
    return done


@dataclass(frozen=True)
class ProcessFigures:
    rss_mib: float
    open_fds: int


def process_figures(pid: int) -> ProcessFigures:
    """RSS and open file descriptors of ``pid`` right now."""
    rss_kib = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
                break
    return ProcessFigures(rss_kib / 1024.0, len(os.listdir(f"/proc/{pid}/fd")))
