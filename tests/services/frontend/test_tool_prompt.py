"""A chat request's tools: validation, the template's view (native or written in the parser's
syntax), and the forced-call grammar."""

from __future__ import annotations

import json

import pytest

from nibble.services.errors import InvalidRequestError
from nibble.services.frontend.protocol import ChatCompletionRequest
from nibble.services.frontend.tool_prompt import plan_tools, resolve_parser_name, template_messages
from nibble.services.models.chat_template import ChatTemplate

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}")
# renders tools and tool_calls itself, as Qwen-style templates do
NATIVE = ("{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}{% for m in messages %}"
          "[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
          "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
          "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}\n{% endfor %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
]


def body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [TOOL], **kw})


def render(template: str, b: ChatCompletionRequest, parser="auto") -> str:
    plan = plan_tools(b, parser, template)
    extra = {"tools": plan.template_tools} if plan.template_tools else {}
    return ChatTemplate(template, {}).render(template_messages(b, plan), **extra)


def test_fallback_writes_tools_calls_and_results_in_the_parsers_syntax():
    text = render(CHATML, body())
    assert text.startswith("<|im_start|>system\n# Tools") and '"get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>" in text


def test_a_template_that_renders_tools_gets_them_natively():
    text = render(NATIVE, body())
    assert text.startswith("TOOLS=[{\"type\": \"function\"")
    assert 'CALL get_weather {"city": "Paris"}' in text         # arguments as an object
    assert "[tool]18C, sunny (for call_1)" in text and "# Tools" not in text


def test_tool_choice_none_describes_no_tools_and_parses_nothing():
    plan = plan_tools(body(tool_choice="none"), "auto", CHATML)
    assert plan.parser is None and plan.system_prompt is None and plan.grammar is None
    assert "<tool_call>" in render(CHATML, body(tool_choice="none"))   # history stays


def test_forced_choices_get_a_grammar_and_named_calls_once():
    required = plan_tools(body(tool_choice="required"), "hermes", CHATML)
    named = plan_tools(body(tool_choice={"type": "function", "function": {
        "name": "get_weather"}}), "hermes", CHATML)
    assert required.grammar.kind == named.grammar.kind == "structural_tag"
    assert json.loads(required.grammar.source)["format"]["stop_after_first"] is False
    assert json.loads(named.grammar.source)["format"]["stop_after_first"] is True
    assert plan_tools(body(), "hermes", CHATML).grammar is None       # auto: free text


@pytest.mark.parametrize("kw,parser,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "auto", "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "auto", "tools"),
    ({"tools": None, "tool_choice": "required"}, "auto", "tool_choice"),
    ({}, "none", "tools"),
])
def test_bad_tool_requests_name_their_field(kw, parser, param):
    with pytest.raises(InvalidRequestError) as e:
        plan_tools(body(**kw), parser, CHATML)
    assert e.value.param == param


def test_auto_parser_follows_the_template():
    assert resolve_parser_name("auto", "{{ '<|python_tag|>' }}") == "llama3_json"
    assert resolve_parser_name("auto", CHATML) == "hermes"
    assert resolve_parser_name("pythonic", CHATML) == "pythonic"
