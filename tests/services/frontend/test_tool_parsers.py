"""Tool-call parsers: whole outputs and token-by-token streams agree; malformed calls are text."""

from __future__ import annotations

import json

import pytest

from nibble.services.frontend.tool_json import members, value_end
from nibble.services.frontend.tool_parsers import make_tool_parser, tool_parser_names

NAMES = frozenset({"get_weather", "get_time"})
HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"days": [1, 2], "q": "a}\\"b"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
              '"arguments": {}}\n</tool_call>')
OUTPUTS = {
    "hermes": HERMES_TWO,
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                   '"days": [1, 2], "q": "a}\\"b"}}; {"name": "get_time", "parameters": {}}',
    "pythonic": '[get_weather(city="Paris", days=[1, 2], q="a}\\"b"), get_time()]',
}
EXPECTED = [("get_weather", {"city": "Paris", "days": [1, 2], "q": 'a}"b'}), ("get_time", {})]


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def _stream(parser, text, pieces):
    """Feed ``text`` in ``pieces``-character pieces; returns (content, {index: [name, args]})."""
    stream, content, calls = parser.stream(), "", {}
    events = [stream.feed(text[i:i + pieces]) for i in range(0, len(text), pieces)]
    for ev in events + [stream.finish()]:
        content += ev.content
        for d in ev.deltas:
            if d.id is not None:
                assert d.index not in calls and d.name and d.arguments == ""   # name first
                calls[d.index] = [d.name, ""]
            else:
                calls[d.index][1] += d.arguments
    return content, calls, stream.called


def test_the_parsers_are_registered():
    assert {"hermes", "llama3_json", "pythonic"} <= set(tool_parser_names())


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_whole_output(name):
    parsed = make_tool_parser(name, NAMES).parse(OUTPUTS[name])
    assert _calls(parsed) == EXPECTED
    assert parsed.content == ("Let me check." if name == "hermes" else None)
    assert len({c.id for c in parsed.calls}) == 2 and parsed.calls[0].id.startswith("call_")


@pytest.mark.parametrize("pieces", [1, 3, 7, 1000])
@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_stream_matches_whole_output(name, pieces):
    content, calls, called = _stream(make_tool_parser(name, NAMES), OUTPUTS[name], pieces)
    assert called
    assert [(n, json.loads(a)) for n, a in calls.values()] == EXPECTED
    assert content.strip() == ("Let me check." if name == "hermes" else "")


def test_hermes_streams_arguments_as_they_are_written():
    stream = make_tool_parser("hermes", NAMES).stream()
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    ev = stream.feed(head)
    assert [d.name for d in ev.deltas if d.id] == ["get_weather"]
    assert "".join(d.arguments for d in ev.deltas) == '{"city": "Pa'
    assert stream.feed('ris"}}\n</tool_call>').deltas[0].arguments == 'ris"}'


def test_content_that_only_looks_like_a_marker_is_not_held_forever():
    parser = make_tool_parser("hermes", NAMES)
    stream = parser.stream()
    assert stream.feed("a <tool").content == "a "           # could be <tool_call>
    assert stream.feed("box> b").content == "<toolbox> b"
    assert stream.finish().content == "" and not stream.called


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "launch_missiles", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n[1, 2]\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"} trailing'),
    ("llama3_json", '{"name": "get_weather", "parameters": "not an object"}'),
    ("pythonic", '[get_weather("Paris")]'),
    ("pythonic", '[get_weather(city=open("/etc/passwd"))]'),
    ("pythonic", '[os.system(cmd="rm")]'),
    ("pythonic", '[get_weather(city="Paris"'),
])
def test_malformed_calls_are_content(name, text):
    parser = make_tool_parser(name, NAMES)
    parsed = parser.parse(text)
    assert parsed.calls == [] and parsed.content == text
    content, calls, called = _stream(parser, text, 2)
    if not called:
        assert content == text


def test_plain_text_is_content_everywhere():
    for name in OUTPUTS:
        parser = make_tool_parser(name, NAMES)
        assert parser.parse("The weather is fine.").content == "The weather is fine."
        content, calls, called = _stream(parser, "The weather is fine.", 1)
        assert content == "The weather is fine." and not calls and not called


def test_parallel_false_keeps_the_first_call():
    parser = make_tool_parser("hermes", NAMES, parallel=False)
    assert [c.name for c in parser.parse(HERMES_TWO).calls] == ["get_weather"]
    _, calls, _ = _stream(parser, HERMES_TWO, 5)
    assert [n for n, _ in calls.values()] == ["get_weather"]


def test_a_last_call_cut_off_by_max_tokens_leaves_the_complete_ones():
    text = HERMES_TWO.split("\n<tool_call>\n{\"name\": \"get_time\"")[0] + \
        '\n<tool_call>\n{"name": "get_time", "argu'
    parsed = make_tool_parser("hermes", NAMES).parse(text)
    assert [c.name for c in parsed.calls] == ["get_weather"]


def test_string_encoded_arguments_are_unwrapped():
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    parser = make_tool_parser("hermes", NAMES)
    assert json.loads(parser.parse(text).calls[0].arguments) == {"tz": "UTC"}
    _, calls, _ = _stream(parser, text, 4)
    assert json.loads(calls[0][1]) == {"tz": "UTC"}


def test_render_call_round_trips():
    for name in OUTPUTS:
        parser = make_tool_parser(name, NAMES)
        text = parser.render_call("get_weather", {"city": "Paris", "n": 2})
        assert _calls(parser.parse(text)) == [("get_weather", {"city": "Paris", "n": 2})]


def test_json_scanner_on_partial_text():
    assert value_end('{"a": [1, "]"]} x', 0) == 15
    assert value_end('{"a": [1, "]"', 0) is None
    assert value_end("12", 0) is None and value_end("12,", 0) == 2
    mems, closed = members('{"name": "f", "arguments": {"x": "}')
    assert [(m.key, m.end is None) for m in mems] == [("name", False), ("arguments", True)]
    assert not closed
    assert members('{"a": 1}')[1] and members("nope") == ([], False)
