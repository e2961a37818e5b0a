"""A chat request's tools: which parser reads the output, what the template sees, and the
grammar that forces a call.

``plan_tools`` resolves ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
against the server's ``--tool-call-parser``; ``template_messages`` turns the
request's messages (assistant ``tool_calls``, ``tool`` results) into what the
chat template renders. A template that renders ``tools`` itself (Qwen2.5/3,
Llama 3.1+, Hermes) gets them as transformers passes them; for one that does
not (SmolLM2's plain ChatML) the parser's own syntax is written into the system
message, and earlier calls and results into the turns, so the model still sees
its tools and its history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..engine.grammar_spec import GrammarSpec
from ..errors import InvalidRequestError
from .protocol import ChatCompletionRequest, ChatMessage
from .tool_parsers import ToolParser, make_tool_parser

TOOL_PARSER_AUTO, TOOL_PARSER_NONE = "auto", "none"
# 400s for tool fields that contradict each other or the history (no schema can state them)
INVALID_TOOLS = "invalid_tools"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, sampling and response."""

    parser: ToolParser | None            # reads calls out of the output (None: plain text)
    history: ToolParser | None           # writes earlier calls for templates without tools
    template_tools: list[dict] | None    # ``tools`` for a template that renders them
    system_prompt: str | None            # the tools' description where the template has none
    grammar: GrammarSpec | None          # forces a call (tool_choice required or named)


def resolve_parser_name(configured: str, template_source: str | None) -> str:
    """``--tool-call-parser auto`` -> the syntax the model's chat template uses."""
    if configured != TOOL_PARSER_AUTO:
        return configured
    source = template_source or ""
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return "hermes"                      # <tool_call> blocks; also what our fallback teaches


def _template_renders_tools(source: str | None) -> bool:
    return bool(source) and "tools" in source


def _choice(body: ChatCompletionRequest) -> tuple[str, str | None]:
    """``(mode, function name)``: mode is none | auto | required | named."""
    tc = body.tool_choice
    if tc is None:
        return ("auto" if body.tools else "none"), None
    if isinstance(tc, str):
        return tc, None
    return "named", tc.function.name


def plan_tools(body: ChatCompletionRequest, configured: str, template_source: str | None
               ) -> ToolPlan:
    """Check the request's tool fields and decide how they are served (400s name the field)."""
    mode, named = _choice(body)
    tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
    if body.tool_choice is not None and not tools and mode != "none":
        raise InvalidRequestError("tool_choice needs tools", param="tool_choice",
                                  code=INVALID_TOOLS)
    if len({t["name"] for t in tools}) != len(tools):
        raise InvalidRequestError("tools: function names must be unique", param="tools",
                                  code=INVALID_TOOLS)
    if configured == TOOL_PARSER_NONE:
        if tools and mode != "none":
            raise InvalidRequestError("tool calling is off on this server "
                                      "(--tool-call-parser none)", param="tools",
                                      code=INVALID_TOOLS)
        return ToolPlan(None, None, None, None, None)
    # a named function is called once; otherwise parallel_tool_calls (default true) decides
    history = make_tool_parser(resolve_parser_name(configured, template_source),
                               frozenset(t["name"] for t in tools),
                               body.parallel_tool_calls is not False and named is None)
    if named is not None and named not in history.names:
        raise InvalidRequestError(f"tool_choice names function '{named}', which is not "
                                  "among tools", param="tool_choice", code=INVALID_TOOLS)
    native = _template_renders_tools(template_source)
    template_tools = [{"type": "function", "function": t} for t in tools] or None
    system = None
    if tools and not native and mode != "none":
        system = history.system_prompt(template_tools)
    grammar = None
    if mode in ("required", "named"):
        forced = [t for t in tools if named is None or t["name"] == named]
        grammar = GrammarSpec(*history.forced_grammar(forced))
    return ToolPlan(history if tools and mode != "none" else None, history,
                    template_tools if native else None, system, grammar)


def _text(m: ChatMessage, i: int) -> str:
    content = m.content
    if not isinstance(content, list):
        return content or ""
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(f"messages[{i}]: only 'text' content parts are "
                                      f"supported, got '{part.type}'",
                                      param=f"messages[{i}].content")
    return "\n".join(part.text for part in content)


def _calls(m: ChatMessage, i: int) -> list[dict[str, Any]]:
    out = []
    for j, call in enumerate(m.tool_calls or []):
        try:
            args = json.loads(call.function.arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise InvalidRequestError(
                f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object",
                param=f"messages[{i}].tool_calls[{j}].function.arguments", code=INVALID_TOOLS)
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": args}})
    return out


def template_messages(body: ChatCompletionRequest, plan: ToolPlan) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (text content, tool turns written out
    in the parser's syntax when the template cannot render them)."""
    native = plan.template_tools is not None
    out: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        role, text = ("system" if m.role == "developer" else m.role), _text(m, i)
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError(f"messages[{i}]: only assistant messages carry "
                                      "tool_calls", param=f"messages[{i}].tool_calls",
                                      code=INVALID_TOOLS)
        calls = _calls(m, i)
        if native:
            msg: dict[str, Any] = {"role": role, "content": text}
            if calls:
                msg["tool_calls"] = calls
            if m.role == "tool":
                msg.update(tool_call_id=m.tool_call_id or "", name=m.name or "")
            out.append(msg)
            continue
        if calls and plan.history is not None:
            written = [plan.history.render_call(c["function"]["name"], c["function"]["arguments"])
                       for c in calls]
            text = "\n".join([text, *written] if text else written)
        if role == "tool":
            role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    if plan.system_prompt:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{plan.system_prompt}"}
        else:
            out.insert(0, {"role": "system", "content": plan.system_prompt})
    return out
