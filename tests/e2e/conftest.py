"""A real ``nibble serve`` process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

STARTUP_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, args: list[str]):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "nibble-serve.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nibble.services.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text()[-n:]

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"nibble serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        pytest.fail(f"nibble serve not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


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
