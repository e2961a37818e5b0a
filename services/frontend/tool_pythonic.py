"""The ``pythonic`` tool-call parser: ``[get_weather(city="Paris"), get_time()]``.

The calls are Python syntax, so they are parsed with ``ast`` (never evaluated):
keyword arguments whose values are literals (strings, numbers, True/False/None,
lists, dicts). A list is only known to be calls once it is complete, so the
stream holds an output that starts with ``[`` until it ends.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from .tool_parsers import (Parsed, StreamEvents, ToolCall, ToolDelta, ToolParser, ToolStream,
                           register_tool_parser)

# Python literals as the forced grammar admits them (JSON-like values with Python's words)
_VALUE_EBNF = r'''
value ::= string | number | "True" | "False" | "None" | list | dict
string ::= "\"" schar* "\""
schar ::= [^"\\\n] | "\\" ["\\nrt]
number ::= "-"? [0-9]+ ("." [0-9]+)?
list ::= "[" (value (", " value)*)? "]"
dict ::= "{" (string ": " value (", " string ": " value)*)? "}"
'''


def _calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    s = text.strip()
    if not (s.startswith("[") and s.endswith("]")):
        return None
    try:
        tree = ast.parse(s, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    out = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in names and not node.args):
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        try:
            out.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        except (TypeError, ValueError):       # a set or bytes literal: no JSON
            return None
    return out


class _ListStream(ToolStream):
    def __init__(self, parser: "PythonicParser"):
        self.p, self.buf = parser, ""
        self.holding: bool | None = None     # None until the first non-space character

    def feed(self, text: str) -> StreamEvents:
        self.buf += text
        if self.holding is None and self.buf.strip():
            self.holding = self.buf.lstrip().startswith("[")
        if self.holding is False:
            out, self.buf = self.buf, ""
            return StreamEvents(out)
        return StreamEvents()

    def finish(self) -> StreamEvents:
        calls = _calls(self.buf, self.p.names) if self.holding else None
        if calls is None:
            out, self.buf = self.buf, ""
            return StreamEvents(out)
        ev = StreamEvents()
        for i, call in enumerate(self.p._limit(calls)):
            ev.deltas += [ToolDelta(i, call.id, call.name), ToolDelta(i, arguments=call.arguments)]
            self.calls += 1
        return ev


@register_tool_parser("pythonic")
class PythonicParser(ToolParser):
    """A Python list of keyword-argument calls as the whole output."""

    def parse(self, text: str) -> Parsed:
        calls = _calls(text, self.names)
        return Parsed(text, []) if calls is None else Parsed(None, self._limit(calls))

    def stream(self) -> ToolStream:
        return _ListStream(self)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        return f"[{name}({args})]"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You can call these functions, described as JSON:\n"
                f"{listed}\n\nTo call functions, reply with only a Python list of calls with "
                "keyword arguments, such as [func_a(x=1, y=\"text\"), func_b()].")

    def forced_grammar(self, tools: list[dict[str, Any]]) -> tuple[str, str]:
        """EBNF: a list of calls to ``tools`` whose keywords are the schemas' property names
        (the values are Python literals; their types are not checked against the schema)."""
        rules = []
        for i, t in enumerate(tools):
            props = sorted(((t.get("parameters") or {}).get("properties") or {}).keys())
            if props:
                kw = " | ".join(json.dumps(p) for p in props)
                rules.append(f'kw{i} ::= ({kw}) "=" value')
                rules.append(f'fn{i} ::= {json.dumps(t["name"])} "(" (kw{i} (", " kw{i})*)? ")"')
            else:
                rules.append(f'fn{i} ::= {json.dumps(t["name"] + "()")}')
        call = " | ".join(f"fn{i}" for i in range(len(tools)))
        more = '(", " call)*' if self.parallel else ""
        head = f'root ::= "[" call {more} "]"\ncall ::= {call}\n'
        return "ebnf", head + "\n".join(rules) + _VALUE_EBNF
