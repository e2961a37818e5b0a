"""``nibble serve --grpc-port`` as a real process (the fake engine, no model): both APIs
on one engine, shared metrics and in-flight set, keys, clean shutdown, port in use."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from nibble.client import Client, PermissionDenied, RetryPolicy, Unauthenticated
from tests.services.gateway.test_cli import FAKE, LAUNCHER, free_port

NO_RETRY = RetryPolicy(max_attempts=1)


def _start(tmp_path, *args):
    port, grpc_port = free_port(), free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(FAKE), "serve", "--port", str(port),
         "--grpc-port", str(grpc_port), *args], stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"server exited early with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.1)
    return proc, log, url, f"127.0.0.1:{grpc_port}"


def _stop(proc, log) -> str:
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    return log.read()


def test_grpc_beside_http(tmp_path):
    proc, log, url, target = _start(tmp_path, "--api-key", "sk-u", "--admin-api-key", "sk-a")
    try:
        with Client(target, api_key="sk-u", retry=NO_RETRY, timeout=10) as c:
            assert c.health() == "SERVING"
            assert c.generate("ab", max_tokens=2).text == "He"
            with pytest.raises(PermissionDenied):
                c.server_info()
        with Client(target, retry=NO_RETRY, timeout=10) as c:
            with pytest.raises(Unauthenticated):
                c.generate("ab", max_tokens=2)
        with Client(target, api_key="sk-a", retry=NO_RETRY, timeout=10) as c:
            assert c.server_info().model == "fake-model"
        metrics = httpx.get(f"{url}/metrics").text       # the gRPC request is counted too
        assert 'nibble:num_requests_total{finish_reason="length"} 1.0' in metrics
    finally:
        out = _stop(proc, log)
    assert "gRPC API (nibble.v1.Nibble" in out and "API keys required" in out
    assert "gRPC server stopped" in out and "FAKE ENGINE SHUT DOWN" in out


def test_grpc_port_in_use_exits_1(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        grpc_port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-c", LAUNCHER, str(FAKE), "serve", "--port", str(free_port()),
             "--grpc-port", str(grpc_port)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    assert f"cannot listen for gRPC on 127.0.0.1:{grpc_port}" in out
    assert "FAKE ENGINE SHUT DOWN" in out
