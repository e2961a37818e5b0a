"""``nibble serve`` as a process: refusing an exposed host without keys, draining on SIGTERM
(503 for new requests, exit 0), and exiting 1 when the engine dies. The engine is the fake
(no model loads); the real-model versions are in tests/e2e/test_drain_and_faults.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from .test_cli import FAKE, _wait_healthy, free_port

# `nibble serve` with build_engine swapped for the fake engine; a prompt starting with "die"
# kills the engine (as a device fault does: the request fails, is_healthy() turns False),
# "slow" streams one character every 50 ms.
LAUNCHER = textwrap.dedent("""
    import importlib.util, sys, types
    spec = importlib.util.spec_from_file_location("fake_engine", sys.argv[1])
    fake = importlib.util.module_from_spec(spec); spec.loader.exec_module(fake)
    from nibble.services.engine.types import FinishReason

    class Engine(fake.FakeEngine):
        dead_reason = None

        async def generate(self, req):
            text = self.tokenizer.decode(req.prompt_token_ids)
            if text.startswith("die"):
                self.healthy = False
                self.dead_reason = "engine stopped after a device fault: injected"
                yield self._out(req, [], 0, FinishReason.ABORT, self.dead_reason)
                return
            self.delay = 0.05 if text.startswith("slow") else 0.0
            async for out in super().generate(req):
                yield out

        async def shutdown(self):
            print("FAKE ENGINE SHUT DOWN", flush=True)

    mod = types.ModuleType("nibble.services.engine.async_engine")
    mod.build_engine = lambda cfg: Engine("x" * 200)
    sys.modules[mod.__name__] = mod
    from nibble.services.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def launch(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log_path = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(FAKE), "serve", "--port", str(port), *args],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}", log_path


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("extra", [[], ["--grpc-port", str(free_port())],
                                   ["--admin-api-key-file", "K"]],
                         ids=["http", "grpc", "admin-key-only"])
def test_exposed_host_without_keys_refuses_to_start(extra, tmp_path):
    if "K" in extra:
        (tmp_path / "admin").write_text("sk-admin\n")
        os.chmod(tmp_path / "admin", 0o600)
        extra = [e.replace("K", str(tmp_path / "admin")) for e in extra]
    env = {k: v for k, v in os.environ.items() if k not in ("NIBBLE_API_KEY",)}
    proc = subprocess.run([sys.executable, "-m", "nibble.services.cli", "serve", "--host",
                           "0.0.0.0", "--port", str(free_port()), *extra],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to serve on --host 0.0.0.0 without an API key" in proc.stderr
    assert "--allow-unauthenticated" in proc.stderr
    assert "Loading" not in proc.stderr and "sk-admin" not in proc.stderr


def test_allow_unauthenticated_starts_on_every_interface(tmp_path):
    proc, url, log_path = launch(tmp_path, "--host", "0.0.0.0", "--allow-unauthenticated")
    try:
        _wait_healthy(url, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        stop(proc)
    assert "SECURITY WARNING" in log_path.read_text()


def test_sigterm_drains_then_exits_0(tmp_path):
    proc, url, log_path = launch(tmp_path, "--graceful-shutdown-timeout", "1")
    try:
        _wait_healthy(url, proc)
        lines: list[str] = []
        body = {"prompt": "slow", "max_tokens": 50, "stream": True}    # 2.5 s of output

        def read_stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                lines.extend(r.iter_lines())

        reader = threading.Thread(target=read_stream)
        reader.start()
        while not any(line.startswith("data: {") for line in lines[:]):
            assert reader.is_alive(), lines
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "ServerDrainingError"
        assert httpx.get(f"{url}/health").status_code == 503
        reader.join(timeout=30)
        assert proc.wait(timeout=30) == 0
    finally:
        stop(proc)
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "ServerDrainingError" in events[-2], events[-3:]
    out = log_path.read_text()
    assert "SIGTERM received: draining" in out and "1 cut" in out
    assert "FAKE ENGINE SHUT DOWN" in out


def test_dead_engine_exits_1(tmp_path):
    proc, url, log_path = launch(tmp_path)
    try:
        _wait_healthy(url, proc)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "die", "max_tokens": 2})
        assert r.status_code == 500 and "device fault" in r.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1
    finally:
        stop(proc)
    out = log_path.read_text()
    assert "the engine died" in out and "FAKE ENGINE SHUT DOWN" in out
