"""The registered tool-call parsers: ``hermes``, ``llama3_json`` (JSON calls, streamed as
they are written) and ``pythonic`` (a Python list of calls, parsed when it is complete).
See tool_parsers.py for the contract."""

from __future__ import annotations

import json
import re
from typing import Any

from .tool_json import members, value_end
from .tool_parsers import (Parsed, StreamEvents, ToolCall, ToolDelta, ToolParser, ToolStream,
                           arguments_json, call_from_object, register_tool_parser)
from .tool_pythonic import PythonicParser  # noqa: F401  (registers itself)


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could start ``marker`` (kept until the next
    token tells whether the marker follows)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class _CallEmitter:
    """Streams one JSON call object (``body``: its text so far, growing): the id and name
    once the name is complete, then the arguments value's text as it is written.
    A call that turns out not to be one (no object, an unknown function) becomes ``raw``:
    its text is returned as content when it ends."""

    def __init__(self, parser: ToolParser, index: int, drop: bool):
        self.p, self.index, self.drop = parser, index, drop
        self.named = self.raw = False
        self.sent = 0                     # characters of the arguments value already sent

    def step(self, body: str, closed: bool, ev: StreamEvents) -> None:
        mems, _ = members(body)
        by_key = {m.key: m for m in mems}
        if not self.named and not self.raw:
            name = by_key.get("name")
            if name is not None and name.end is not None:
                value = _loads(body[name.start:name.end])
                if not isinstance(value, str) or value not in self.p.names:
                    self.raw = True
                else:
                    self.named, self.id = True, ToolCall(value, "").id
                    if not self.drop:
                        ev.deltas.append(ToolDelta(self.index, self.id, value))
            elif closed or (body.strip() and not body.lstrip().startswith("{")):
                self.raw = True
        if not self.named or self.drop:
            return
        args = next((by_key[k] for k in self.p.arg_keys if k in by_key), None)
        if args is None:
            if closed:
                self._send(ev, "{}")
            return
        if body[args.start] == '"':       # arguments as a JSON string: sent when complete
            if args.end is not None and self.sent == 0:
                self._send(ev, arguments_json(_loads(body[args.start:args.end])) or "{}")
            return
        upto = args.end if args.end is not None else len(body)
        self._send(ev, body[args.start + self.sent:upto])

    def _send(self, ev: StreamEvents, text: str) -> None:
        if text:
            self.sent += len(text)
            ev.deltas.append(ToolDelta(self.index, arguments=text))


def _loads(text: str) -> Any:
    """JSON, taking raw control characters in strings (a grammar's JSON strings admit them;
    the arguments are re-serialized, escaped, before they reach the client)."""
    try:
        return json.loads(text, strict=False)
    except ValueError:
        return None


class _JsonCallsStream(ToolStream):
    """The text so far, how far it is emitted, and the JSON call being written; ``_advance``
    turns new text into events (``final``: the output ended)."""

    def __init__(self, parser: ToolParser):
        self.p = parser
        self.buf, self.pos = "", 0        # all text; what is emitted (or consumed) before pos
        self.call: _CallEmitter | None = None

    def feed(self, text: str) -> StreamEvents:
        self.buf += text
        return self._advance(final=False)

    def finish(self) -> StreamEvents:
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamEvents:
        raise NotImplementedError


class _TaggedStream(_JsonCallsStream):
    """Content, with calls as ``begin {json} end`` blocks anywhere in it (hermes)."""

    def _advance(self, final: bool) -> StreamEvents:
        ev, begin, end = StreamEvents(), self.p.begin, self.p.end
        while True:
            if self.call is None:
                i = self.buf.find(begin, self.pos)
                if i < 0:
                    keep = 0 if final else _held_back(self.buf[self.pos:], begin)
                    ev.content += self.buf[self.pos:len(self.buf) - keep]
                    self.pos = len(self.buf) - keep
                    return ev
                ev.content += self.buf[self.pos:i]
                self.pos = i + len(begin)
                drop = not self.p.parallel and self.calls > 0
                self.call = _CallEmitter(self.p, self.calls, drop)
                continue
            j = self.buf.find(end, self.pos)
            closed = j >= 0 or final
            stop = j if j >= 0 else len(self.buf)
            self.call.step(self.buf[self.pos:stop], closed, ev)
            if not closed:
                return ev
            if self.call.raw or not self.call.named:
                ev.content += begin + self.buf[self.pos:stop] + (end if j >= 0 else "")
            elif not self.call.drop:
                self.calls += 1
            self.pos, self.call = (j + len(end) if j >= 0 else len(self.buf)), None


@register_tool_parser("hermes")
class HermesParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, after any text."""

    begin, end = "<tool_call>", "</tool_call>"
    arg_keys = ("arguments", "parameters")
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        calls = []
        for m in self._block.finditer(text):
            call = call_from_object(_loads(m.group(1)), self.names, self.arg_keys)
            if call is None and calls and m.end() == len(text) and not text.endswith(self.end):
                break                     # a last call cut off by max_tokens: the others stand
            if call is None:
                return Parsed(text, [])
            calls.append(call)
        if not calls:
            return Parsed(text, [])
        content = self._block.sub("", text).strip()
        return Parsed(content or None, self._limit(calls))

    def stream(self) -> ToolStream:
        return _TaggedStream(self)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.begin}\n{call}\n{self.end}"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to answer the user. The "
                "functions are described inside <tools></tools> as JSON:\n<tools>\n"
                f"{listed}\n</tools>\n\nTo call a function, reply with a JSON object holding "
                "its name and arguments inside <tool_call></tool_call> tags, one block per "
                "call:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as "
                "a JSON object>}\n</tool_call>")

    def forced_grammar(self, tools: list[dict[str, Any]]) -> tuple[str, str]:
        tags = [_tag(f'{self.begin}\n{{"name": {json.dumps(t["name"])}, "arguments": ',
                     t.get("parameters"), f"}}\n{self.end}") for t in tools]
        return "structural_tag", _tags_with_separator(tags, "\n", self.parallel)


def _tag(begin: str, schema: Any, end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "end": end,
            "content": {"type": "json_schema", "json_schema": schema or {"type": "object"},
                        "max_whitespace_cnt": 1}}


def _tags_with_separator(tags: list[dict], separator: str, parallel: bool) -> str:
    return json.dumps({"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": tags, "separator": separator,
        "at_least_one": True, "stop_after_first": not parallel}})


class _JsonListStream(_JsonCallsStream):
    """Calls as the whole output: ``[<|python_tag|>] {json} [; {json}]...`` (llama3_json).
    An output that does not start with ``{`` (or the tag) is content throughout."""

    TAG = "<|python_tag|>"

    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self.mode = "start"              # start | calls | content

    def _advance(self, final: bool) -> StreamEvents:
        ev = StreamEvents()
        while True:
            rest = self.buf[self.pos:].lstrip()
            skipped = len(self.buf) - self.pos - len(rest)
            if self.mode == "content":
                ev.content += self.buf[self.pos:]
                self.pos = len(self.buf)
                return ev
            if self.mode == "start":
                if rest.startswith(self.TAG):
                    self.pos += skipped + len(self.TAG)
                    self.mode = "calls"
                elif rest.startswith("{"):
                    self.mode = "calls"
                elif final or (rest and not self.TAG.startswith(rest)):
                    self.mode = "content"
                else:
                    return ev
                continue
            if self.call is None:
                if rest.startswith(";"):
                    self.pos += skipped + 1
                    continue
                if rest.startswith("{"):
                    self.pos += skipped
                    self.call = _CallEmitter(self.p, self.calls,
                                             not self.p.parallel and self.calls > 0)
                    continue
                if rest or final:
                    self.mode = "content"
                    continue
                return ev
            end = value_end(self.buf, self.pos)
            closed = end is not None or final
            stop = end if end is not None else len(self.buf)
            self.call.step(self.buf[self.pos:stop], closed, ev)
            if not closed:
                return ev
            if self.call.raw or not self.call.named:
                ev.content += self.buf[self.pos:stop]
                self.mode = "content"
            elif not self.call.drop:
                self.calls += 1
            self.pos, self.call = stop, None


@register_tool_parser("llama3_json")
class Llama3JsonParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` as the whole output (Llama 3.1/3.3 JSON tool
    calling), optionally after ``<|python_tag|>``, several separated by ``;``."""

    arg_keys = ("parameters", "arguments")

    def parse(self, text: str) -> Parsed:
        s = text.strip().removeprefix(_JsonListStream.TAG).strip()
        calls, i = [], 0
        while i < len(s):
            if s[i] in "; \t\r\n":
                i += 1
                continue
            end = value_end(s, i) if s[i] == "{" else None
            call = None if end is None else call_from_object(_loads(s[i:end]), self.names,
                                                             self.arg_keys)
            if call is None:
                return Parsed(text, [])
            calls.append(call)
            i = end
        return Parsed(None, self._limit(calls)) if calls else Parsed(text, [])

    def stream(self) -> ToolStream:
        return _JsonListStream(self)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You have access to the following functions. To call one, reply with only a "
                "JSON object of the form {\"name\": function name, \"parameters\": dictionary "
                "of argument names and values}; separate several calls with \"; \". Do not use "
                f"variables.\n\n{listed}")

    def forced_grammar(self, tools: list[dict[str, Any]]) -> tuple[str, str]:
        tags = [_tag(f'{{"name": {json.dumps(t["name"])}, "parameters": ',
                     t.get("parameters"), "}") for t in tools]
        return "structural_tag", _tags_with_separator(tags, "; ", self.parallel)
