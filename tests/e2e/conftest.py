"""A real ``nibble serve`` process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator, Sequence

import httpx
import pytest

from nibble.bench._server import SERVE_CMD, BenchServerError, ServerProcess
from nibble.services.models.weight_quant import cpu_has_native_bf16

STARTUP_TIMEOUT_S = 120
# The servers' model dtype: bf16 where the CPU multiplies it in hardware (AVX512-BF16, AMX),
# float32 elsewhere, where torch's bf16 GEMMs are ~50x slower (0.7 against 34 GFLOP/s on an
# AVX2 EPYC) and a prompt's prefill outlasts the tests' deadlines.
CPU_DTYPE = "bfloat16" if cpu_has_native_bf16() else "float32"


class Server(ServerProcess):
    """``nibble serve`` on a free loopback port with its log in ``tmp`` (stopped by PID)."""

    def __init__(self, tmp: Path, args: list[str], cmd: Sequence[str] = SERVE_CMD,
                 env: dict[str, str] | None = None):
        super().__init__(args, tmp / "nibble-serve.log", cmd, env)

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        try:
            super().wait_healthy(timeout_s)
        except BenchServerError as exc:
            pytest.fail(f"{exc}\n{self.log_tail(4000)}")

    def info(self) -> dict:
        """``/get_server_info`` as JSON."""
        return httpx.get(f"{self.url}/get_server_info", timeout=10).json()

    def wait_workers_idle(self, timeout: float, poll: float) -> dict:
        """The two disaggregated workers once every page is free and nothing is reserved or held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = self.info()["workers"]
            if len(workers) == 2 and all(
                    w["free_pages"] == w["total_pages"] and w["reservations"] == 0
                    and w["held"] == 0 for w in workers.values()):
                return workers
            time.sleep(poll)
        pytest.fail(f"pages still held: {self.info()['workers']}")


@contextlib.contextmanager
def running_server(tmp_path_factory, name: str, args: list[str]) -> Iterator[Server]:
    """A healthy ``nibble serve`` for the duration of the block; stopped by PID after it."""
    srv = Server(tmp_path_factory.mktemp(name), args)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def openai_client(server: Server):
    import openai
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def child_pids(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out
