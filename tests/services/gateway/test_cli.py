"""``nibble`` CLI: argument handling in-process; ``nibble serve`` lifecycle as a real
process (the engine replaced by the fake, so no model loads)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from nibble.services.cli import build_parser, main
from nibble.services.config import config_from_args

FAKE = Path(__file__).with_name("fake_engine.py")

# Runs `nibble serve` with build_engine swapped for the fake engine.
LAUNCHER = textwrap.dedent("""
    import importlib.util, sys, types
    spec = importlib.util.spec_from_file_location("fake_engine", sys.argv[1])
    fake = importlib.util.module_from_spec(spec); spec.loader.exec_module(fake)

    class Engine(fake.FakeEngine):
        async def shutdown(self):
            print("FAKE ENGINE SHUT DOWN", flush=True)

    def build_engine(cfg):
        print("BUILD", cfg.cache.max_total_tokens, cfg.server.port, flush=True)
        return Engine()

    mod = types.ModuleType("nibble.services.engine.async_engine")
    mod.build_engine = build_engine
    sys.modules[mod.__name__] = mod
    from nibble.services.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_flags_build_the_config():
    args = build_parser().parse_args(["serve", "--port", "1234", "--max-total-tokens", "4096",
                                      "--kv-cache-dtype", "fp8_e4m3", "--log-level", "debug"])
    cfg = config_from_args(args)
    assert (cfg.server.port, cfg.server.log_level) == (1234, "debug")
    assert (cfg.cache.max_total_tokens, cfg.cache.kv_cache_dtype) == (4096, "fp8_e4m3")
    assert cfg.cache.page_size == 16 and cfg.server.host == "127.0.0.1"


@pytest.mark.parametrize("argv", [[], ["bogus"], ["serve", "--page-size", "3"],
                                  ["serve", "--log-level", "loud"], ["serve", "--port", "x"]])
def test_bad_command_lines_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_serve_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model-path", "--kv-cache-dtype", "--max-total-tokens", "--host", "--port",
                 "--log-level"):
        assert flag in out


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited early with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not become healthy")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_runs_and_shuts_down_cleanly(sig, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(FAKE), "serve", "--port", str(port),
         "--max-total-tokens", "4096"], stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == "He"
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    out = log.read()
    assert f"BUILD 4096 {port}" in out
    assert f"Nibble is serving 'fake-model' at {url}" in out
    assert "FAKE ENGINE SHUT DOWN" in out
    assert "unauthenticated" in out and "loopback" in out


def test_serve_port_in_use_exits_nonzero(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-c", LAUNCHER, str(FAKE), "serve", "--port", str(port)],
            capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "FAKE ENGINE SHUT DOWN" in proc.stdout


def test_api_key_flags_repeat():
    args = build_parser().parse_args(["serve", "--api-key", "k1", "--api-key", "k2",
                                      "--admin-api-key", "adm"])
    cfg = config_from_args(args)
    assert cfg.server.api_keys == ("k1", "k2") and cfg.server.admin_api_keys == ("adm",)
    assert config_from_args(build_parser().parse_args(["serve"])).server.api_keys == ()


@pytest.mark.parametrize("flag", ["--api-key", "--admin-api-key"])
def test_unusable_key_exits_2_before_loading(flag, capsys, monkeypatch):
    import nibble.services.cli as cli

    monkeypatch.setattr(cli, "run_serve", lambda cfg: pytest.fail("the engine was built"))
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, "two words"])
    assert e.value.code == 2
    assert f"{flag} values must be" in capsys.readouterr().err


def test_serve_with_api_keys_end_to_end(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(FAKE), "serve", "--port", str(port),
         "--api-key", "sk-cli-user", "--admin-api-key", "sk-cli-admin"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        body = {"prompt": "ab", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json=body,
                       headers={"Authorization": "Bearer sk-cli-user"})
        assert r.status_code == 200
        info = httpx.get(f"{url}/get_server_info", headers={"x-api-key": "sk-cli-user"})
        assert info.status_code == 403             # a tenant key is not an admin key
        info = httpx.get(f"{url}/get_server_info", headers={"x-api-key": "sk-cli-admin"})
        assert info.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    out = log.read()
    assert "API keys: 1 guard /v1" in out and "need a key from --admin-api-key" in out
    assert "unauthenticated" not in out
    assert "sk-cli-user" not in out and "sk-cli-admin" not in out
