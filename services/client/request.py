"""``build_request``: the SDK's keyword arguments -> a ``nibble.v1.GenerateRequest``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from nibble.proto.nibble.v1 import nibble_pb2 as pb

SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_p", "min_tokens")
TOOL_MODES = ("none", "auto", "required")


def _message(m: Mapping[str, Any]) -> pb.ChatMessage:
    """An OpenAI-style chat message (``tool_calls`` as the OpenAI API returns them)."""
    calls = []
    for c in m.get("tool_calls") or ():
        fn = c.get("function", c)
        args = fn["arguments"]
        calls.append(pb.ToolCall(id=c.get("id", ""), name=fn["name"],
                                 arguments=args if isinstance(args, str) else json.dumps(args)))
    return pb.ChatMessage(role=m["role"], content=m.get("content") or "", name=m.get("name", ""),
                          tool_calls=calls, tool_call_id=m.get("tool_call_id", ""))


def _tool(t: Mapping[str, Any]) -> pb.Tool:
    """``{"type": "function", "function": {...}}`` or the function dict itself."""
    fn = t.get("function", t)
    params = fn.get("parameters")
    return pb.Tool(name=fn["name"], description=fn.get("description", ""),
                   parameters_json="" if params is None else json.dumps(params))


def _tool_choice(choice: str | Mapping[str, Any]) -> pb.ToolChoice:
    """none | auto | required, or ``{"type": "function", "function": {"name": ...}}``."""
    if isinstance(choice, str):
        if choice not in TOOL_MODES:
            raise ValueError(f"tool_choice is one of {TOOL_MODES} or a function dict")
        return pb.ToolChoice(mode=choice)
    return pb.ToolChoice(function=choice["function"]["name"])


def _response_format(rf: Mapping[str, Any]) -> pb.ResponseFormat:
    """OpenAI's response_format: ``{"type": "json_schema", "json_schema": {"schema", "strict"}}``."""
    js = rf.get("json_schema") or {}
    schema = js.get("schema")
    return pb.ResponseFormat(type=rf["type"], strict=bool(js.get("strict")),
                             json_schema="" if schema is None else json.dumps(schema))


def build_request(prompt: str | Sequence[int] | None, messages: Sequence[Mapping[str, Any]] | None,
                  *, stop: str | Sequence[str] | None = None,
                  stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                  logit_bias: Mapping[int, float] | None = None,
                  tools: Sequence[Mapping[str, Any]] | None = None,
                  tool_choice: str | Mapping[str, Any] | None = None,
                  parallel_tool_calls: bool | None = None,
                  response_format: Mapping[str, Any] | None = None, regex: str | None = None,
                  ebnf: str | None = None, logprobs: int | None = None, n: int | None = None,
                  echo: bool = False, cache_salt: str | None = None, model: str | None = None,
                  request_id: str | None = None, **sampling: Any) -> pb.GenerateRequest:
    """A GenerateRequest from ``prompt`` (text or token ids) or chat ``messages``; unset
    parameters take the server's defaults. ``sampling``: max_tokens, temperature, top_p,
    top_k, seed, presence_penalty, frequency_penalty, repetition_penalty, min_p, min_tokens.
    ``logprobs``: each token's logprob and this many alternatives."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt (text or token ids) or messages")
    unknown = set(sampling) - set(SAMPLING)
    if unknown:
        raise TypeError(f"unknown parameters: {', '.join(sorted(unknown))}")
    params = pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None},
                               stop=[stop] if isinstance(stop, str) else list(stop or ()),
                               stop_token_ids=list(stop_token_ids or ()),
                               ignore_eos=ignore_eos, logit_bias=dict(logit_bias or {}))
    req = pb.GenerateRequest(request_id=request_id or "", model=model or "", sampling=params,
                             tools=[_tool(t) for t in tools or ()], echo=echo)
    optional = {"cache_salt": cache_salt, "parallel_tool_calls": parallel_tool_calls,
                "regex": regex, "ebnf": ebnf, "logprobs": logprobs, "n": n}
    for key, value in optional.items():
        if value is not None:
            setattr(req, key, value)
    if tool_choice is not None:
        req.tool_choice.CopyFrom(_tool_choice(tool_choice))
    if response_format is not None:
        req.response_format.CopyFrom(_response_format(response_format))
    if messages is not None:
        req.chat.messages.extend(_message(m) for m in messages)
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req
