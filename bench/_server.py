"""A ``nibble serve`` subprocess for HTTP benchmarks: free loopback port, /health, stop by PID.

    with launched(["--kv-cache-dtype", "fp8_e4m3"], out_dir / "fp8.log") as url:
        ...  # url = "http://127.0.0.1:<port>"

The server is stopped with SIGINT (graceful), then SIGKILL after ``STOP_TIMEOUT_S``, by the
PID this module started, never by name.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx

from nibble.services.errors import ConfigError, FatalError

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
SERVE_CMD = (sys.executable, "-m", "nibble.services.cli", "serve")


class BenchServerError(FatalError):
    """A benchmark's server did not start, died, or answered with something unusable."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_server_args(text: str) -> list[str]:
    """``"--kv-cache-dtype fp8_e4m3 --max-total-tokens 4096"`` -> argv list (shell quoting)."""
    return shlex.split(text)


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def config_label(argv: Sequence[str]) -> str:
    """A short name for a server config: KV dtype, tiers, pool size (e.g. ``fp8_e4m3 L1+L2 4096t``)."""
    kv = _flag_value(argv, "--kv-cache-dtype") or "nvfp4"
    parts = [kv]
    if "--enable-hierarchical-cache" in argv:
        backend = _flag_value(argv, "--hicache-storage-backend") or "file"
        parts.append("L1+L2" if backend == "none" else f"L1+L2+L3({backend})")
    if "--disable-radix-cache" in argv:
        parts.append("no-cache")
    pool = _flag_value(argv, "--max-total-tokens")
    if pool is not None:
        parts.append(f"{pool}t")
    return " ".join(parts)


def isolate_storage(argv: Sequence[str], scratch: pathlib.Path) -> list[str]:
    """Give a file L3 store a fresh directory under ``scratch`` unless the args name one, so a
    run never reads pages an earlier run left in the default store."""
    argv = list(argv)
    if ("--enable-hierarchical-cache" in argv
            and (_flag_value(argv, "--hicache-storage-backend") or "file") == "file"
            and _flag_value(argv, "--hicache-storage-url") is None):
        path = scratch / f"l3-{free_port()}"
        path.mkdir(parents=True, exist_ok=True)
        argv += ["--hicache-storage-url", str(path)]
    return argv


class ServerProcess:
    """One server subprocess; ``cmd`` defaults to ``nibble serve`` (tests pass a stand-in);
    ``env`` adds variables (secrets go there, never into argv)."""

    def __init__(self, argv: Sequence[str], log_path: pathlib.Path,
                 cmd: Sequence[str] = SERVE_CMD, env: dict[str, str] | None = None):
        for flag in ("--port", "--host"):
            if _flag_value(argv, flag) is not None:
                raise ConfigError(f"{flag} is chosen by the benchmark; leave it out of --server-args")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [*cmd, "--host", "127.0.0.1", "--port", str(self.port), *argv],
            stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchServerError(f"server exited with {self.proc.returncode}; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            try:
                # our server, not another process that took the port between free_port() and
                # the bind (Ray starts many; one answered /health once): it logs the URL
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200 \
                        and f"at {self.url} " in self.log_tail(1 << 20):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise BenchServerError(f"server not healthy after {timeout_s:.0f}s; log {self.log_path}")

    def stop(self) -> int:
        """SIGINT, wait, SIGKILL if it hangs; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def launched(argv: Sequence[str], log_path: pathlib.Path,
             cmd: Sequence[str] = SERVE_CMD) -> Iterator[str]:
    """A healthy server for the duration of the block; yields its base URL."""
    srv = ServerProcess(argv, log_path, cmd)
    try:
        srv.wait_healthy()
        yield srv.url
    finally:
        srv.stop()


def server_configs(base_url: str | None, server_args: Sequence[str] | None,
                   labels: Sequence[str] | None) -> list[tuple[str, list[str] | None]]:
    """(label, server argv) per config; argv None = the running server at ``base_url``
    (label "" then: the benchmark names it from the server)."""
    if base_url and server_args:
        raise ConfigError("give either --base-url or --server-args, not both")
    argvs = [split_server_args(s) for s in server_args] if server_args else [None]
    names = list(labels) if labels else [config_label(a) if a is not None else "" for a in argvs]
    if len(names) != len(argvs):
        raise ConfigError(f"{len(names)} --labels for {len(argvs)} configs")
    if len(set(names)) != len(names):
        names = [f"{n} #{i}" for i, n in enumerate(names)]
    return list(zip(names, argvs))


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The "server" option group every HTTP benchmark shares (consumed by :func:`for_each_server`)."""
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help="a running server (else one is started per config)")
    g.add_argument("--server-args", action="append", default=None,
                   help='flags for one `nibble serve` config (KV format, tiers, pool), e.g. '
                        '"--kv-cache-dtype fp8_e4m3 --max-total-tokens 4096" (a single flag: '
                        '--server-args=--flag=value); repeatable: one run per config')
    g.add_argument("--labels", nargs="+", default=None, help="one name per config")


def step_trace_path(log_dir: pathlib.Path, log_stem: str, i: int) -> pathlib.Path:
    return log_dir / f"{log_stem}_steps{i}.jsonl"


SweepFn = Callable[[str, str, "str | None", int], list[dict[str, Any]]]


def for_each_server(base_url: str | None, server_args: Sequence[str] | None,
                    labels: Sequence[str] | None, log_dir: pathlib.Path, log_stem: str,
                    sweep: SweepFn, step_trace: bool = False) -> list[dict[str, Any]]:
    """Call ``sweep(url, label, server_args_text, index)`` per config: against ``base_url``, or
    against a server started for that config (file L3 stores isolated in a temp dir, server
    log at ``log_dir/<log_stem>_server<i>.log``) and stopped right after. ``step_trace``: a
    started server also writes ``log_dir/<log_stem>_steps<i>.jsonl`` (``--step-trace-file``,
    unless the config names its own)."""
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="nibble-bench-") as scratch:
        for i, (label, argv) in enumerate(server_configs(base_url, server_args, labels)):
            if argv is None:
                records += sweep(base_url, label, None, i)
                continue
            argv_i = isolate_storage(argv, pathlib.Path(scratch))
            if step_trace and _flag_value(argv_i, "--step-trace-file") is None:
                argv_i += ["--step-trace-file", str(step_trace_path(log_dir, log_stem, i))]
            with launched(argv_i, log_dir / f"{log_stem}_server{i}.log") as url:
                records += sweep(url, label, " ".join(argv), i)
    return records
