"""Tool-call parsers (``--tool-call-parser``): generated text -> OpenAI ``tool_calls``.

A parser knows one model family's call syntax and does four things with it:
- ``parse(text)``: a finished output -> content and calls. Malformed calls (bad
  JSON, an unknown function) leave the whole text as content, never an error.
- ``stream()``: a ``ToolStream`` fed token texts, emitting content text and
  OpenAI tool-call deltas (the id and name first, then argument fragments).
- ``render_call`` / ``system_prompt``: the syntax, for chat templates that do not
  render ``tools`` themselves (tool_prompt.py).
- ``forced_grammar``: the grammar that makes the model call one of the given
  tools (``tool_choice`` required or named; tool_grammar.py compiles it).

Registered by name, the names vLLM and SGLang use: ``hermes``
(``<tool_call>{"name", "arguments"}</tool_call>``: Qwen2.5/Qwen3, Hermes,
SmolLM2-style ChatML), ``llama3_json`` (``{"name", "parameters"}``, optionally
after ``<|python_tag|>``, several joined by ``;``) and ``pythonic``
(``[f(a=1), g(b="x")]``: Llama 3.2/4 pythonic, Gemma style).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError


@dataclass
class ToolCall:
    """One function call, in OpenAI's shape."""

    name: str
    arguments: str                       # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class Parsed:
    """A finished output: ``content`` (None when only calls remain) and the calls."""

    content: str | None
    calls: list[ToolCall]


@dataclass
class ToolDelta:
    """One streamed piece of call ``index``: the first carries ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            fn = {"name": self.name, "arguments": self.arguments}
        out["function"] = fn
        return out


@dataclass
class StreamEvents:
    """What one ``feed`` produced: content text and tool-call deltas, in that order."""

    content: str = ""
    deltas: list[ToolDelta] = field(default_factory=list)


def arguments_json(value: Any) -> str | None:
    """A call's arguments as JSON object text (a JSON string holding an object is unwrapped),
    or None when they are no object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: Any, names: frozenset[str], arg_keys: tuple[str, ...]
                     ) -> ToolCall | None:
    """``{"name": ..., <arg key>: {...}}`` -> a call to a known function, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in names:
        return None
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    text = arguments_json(args)
    return None if text is None else ToolCall(obj["name"], text)


class ToolStream:
    """Streaming state of one output; ``feed`` per token text, ``finish`` at the end."""

    calls = 0                            # calls emitted so far

    def feed(self, text: str) -> StreamEvents:
        raise NotImplementedError

    def finish(self) -> StreamEvents:
        raise NotImplementedError

    @property
    def called(self) -> bool:
        """Whether any tool call was emitted (the finish reason becomes tool_calls)."""
        return self.calls > 0


class ToolParser:
    """One call syntax. ``names``: the request's function names (calls to others are text);
    ``parallel``: False keeps only the first call (OpenAI's parallel_tool_calls)."""

    name = ""

    def __init__(self, names: frozenset[str], parallel: bool = True):
        self.names = names
        self.parallel = parallel

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def stream(self) -> ToolStream:
        raise NotImplementedError

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        raise NotImplementedError

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        raise NotImplementedError

    def forced_grammar(self, tools: list[dict[str, Any]]) -> tuple[str, str]:
        """``(grammar kind, source)`` that admits only calls to ``tools`` (function dicts
        ``{"name", "parameters"}``): a ``structural_tag`` JSON or an ``ebnf`` text."""
        raise NotImplementedError

    def _limit(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.parallel else calls[:1]


TOOL_PARSERS: dict[str, Callable[..., ToolParser]] = {}


def register_tool_parser(name: str):
    def deco(cls):
        cls.name = name
        TOOL_PARSERS[name] = cls
        return cls
    return deco


def tool_parser_names() -> list[str]:
    from . import tool_formats  # noqa: F401  (registers the parsers)
    return sorted(TOOL_PARSERS)


def make_tool_parser(name: str, names: frozenset[str], parallel: bool = True) -> ToolParser:
    tool_parser_names()
    if name not in TOOL_PARSERS:
        raise ConfigError(f"unknown tool-call parser {name!r}; choose one of "
                          f"{', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name](names, parallel)
