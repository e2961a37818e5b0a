"""Disaggregated serving on two GPUs: prefill actor on GPU 0, decode actor on GPU 1.

The Qwen3-8B-shaped benchmark model with random weights (``--load-format
dummy``), NVFP4 KV, pages over NIXL from VRAM to VRAM. Checks the transfer
(page bytes at NVFP4's page size, checksums verified by the decode worker),
then kills the prefill actor mid-prefill and the decode actor mid-stream: the
request ends in a recomputed answer or a clear error, the server stays up, Ray
restarts the actor, and no pages stay held. Needs two CUDA GPUs, Ray and NIXL.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import pathlib
import time

import httpx
import pytest

from .conftest import Server

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.slow]

MODEL = pathlib.Path(__file__).resolve().parents[2] / "bench" / "models" / "qwen3-8b"
ARGS = ["--model-path", str(MODEL), "--load-format", "dummy", "--kv-cache-dtype", "nvfp4",
        "--mem-fraction-static", "0.5", "--chunked-prefill-size", "16384",
        "--max-prefill-tokens", "16384", "--disaggregate", "--kv-transport", "nixl",
        "--kv-transfer-timeout", "60"]
STARTUP_S = 600


def _two_gpus() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


if not _two_gpus() or importlib.util.find_spec("ray") is None:
    pytest.skip("needs two CUDA GPUs and Ray", allow_module_level=True)


def complete(url: str, n_prompt: int, max_tokens: int, stream: bool = False, seed: int = 0):
    body = {"model": "qwen3-8b", "prompt": [(seed * 7919 + 31 * i) % 150000 + 100
                                            for i in range(n_prompt)],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("disagg-gpu"), ARGS)
    try:
        srv.wait_healthy(STARTUP_S)    # two 8B actors load and capture
        yield srv
    finally:
        srv.stop()


def _ray():
    import ray
    if not ray.is_initialized():
        ray.init(address="auto", namespace="nibble", logging_level="ERROR", log_to_driver=False)
    return ray


def test_nvfp4_pages_move_gpu_to_gpu_over_nixl(server):
    from nibble.kernels import PageLayout

    r = complete(server.url, 4096, 16)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    t = server.info()["transfers"]
    nv = PageLayout("nvfp4", 36, 8, 128, 16).page_nbytes
    assert t["transfer_success"] >= 1 and t.get("transfer_failed", 0) == 0
    assert t["transfer_bytes"] % nv == 0 and t["transfer_bytes"] >= 4096 // 16 * nv
    server.wait_workers_idle(60, 0.5)


def test_prefill_actor_killed_mid_prefill(server):
    ray = _ray()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(complete, server.url, 32768, 32, False, 1)
        time.sleep(0.7)                                 # a 32K-token prefill is running
        ray.kill(ray.get_actor("nibble-prefill-0"), no_restart=False)
        killed = time.monotonic()
        r = fut.result(timeout=300)
    if r.status_code == 200:                            # recomputed on the decode worker
        assert r.json()["usage"]["completion_tokens"] == 32
    else:                                               # or a clear error, fast
        assert time.monotonic() - killed < 5 and "error" in r.json()
    assert complete(server.url, 256, 4).status_code == 200
    deadline = time.monotonic() + STARTUP_S
    while "nibble-prefill-0" not in server.info()["transfers"]["alive_workers"]:
        assert time.monotonic() < deadline, "Ray did not restart the prefill actor"
        time.sleep(1)
    server.wait_workers_idle(60, 0.5)


def test_decode_actor_killed_mid_stream(server):
    ray = _ray()
    got, killed, ended = 0, None, None
    body = {"model": "qwen3-8b", "prompt": list(range(100, 2148)), "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3 and killed is None:
                    ray.kill(ray.get_actor("nibble-decode-0"), no_restart=False)
                    killed = time.monotonic()
            if line == "data: [DONE]":
                ended = time.monotonic()
    assert killed is not None and ended is not None and ended - killed < 5 + 120
    deadline = time.monotonic() + STARTUP_S
    while "nibble-decode-0" not in server.info()["transfers"]["alive_workers"]:
        assert time.monotonic() < deadline, "Ray did not restart the decode actor"
        time.sleep(1)
    assert complete(server.url, 256, 4).status_code == 200
    server.wait_workers_idle(60, 0.5)
