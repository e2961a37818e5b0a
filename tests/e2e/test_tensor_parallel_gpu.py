"""End to end on one GPU: ``nibble serve --tp-size 2 --tp-backend gloo --device cuda`` (both
ranks share the GPU; NCCL refuses that), the Qwen3-8B shape with random weights and NVFP4
KV, overlap scheduling on (the default on CUDA): it answers, streams every asked token, and
its follower ends with it. The NCCL form (one GPU per rank, captured all-reduces) needs two
GPUs."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import torch

from .conftest import child_pids, running_server

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ARGS = ["--model-path", "bench/models/qwen3-8b", "--load-format", "dummy", "--device", "cuda",
        "--kv-cache-dtype", "nvfp4", "--mem-fraction-static", "0.2", "--context-length", "4096",
        "--tp-size", "2", "--tp-backend", "gloo"]


def test_tp2_sharing_one_gpu_serves_and_stops_its_rank(tmp_path_factory):
    with running_server(tmp_path_factory, "tp2-gpu", ARGS) as srv:
        followers = [p for p in child_pids(srv.proc.pid)
                     if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert len(followers) == 1
        for n in (24, 40):          # decode steps launched ahead, then a second request
            r = httpx.post(f"{srv.url}/v1/completions", timeout=300, json={
                "model": "qwen3-8b", "prompt": "The capital of France is", "max_tokens": n,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == n
        assert srv.info()["tensor_parallel"]["size"] == 2
        assert "tensor-parallel rank 1 of 2 following rank 0" in srv.log_tail(1 << 20)
        assert srv.stop() == 0, srv.log_tail()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{followers[0]}/stat"):
        if open(f"/proc/{followers[0]}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{followers[0]}/stat") or \
        open(f"/proc/{followers[0]}/stat").read().split()[2] == "Z", "the rank outlived the server"
