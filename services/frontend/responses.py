"""OpenAI response objects: one formatter per endpoint, driven by the serving code.

Responses are plain dicts in OpenAI's exact schema. The serving code drives
either formatter through the same calls (``start_chunks``, ``text_chunks``,
``finish_chunks``, ``usage_chunk`` while streaming; ``full`` otherwise), one
choice ``index`` at a time, so it never branches on the endpoint. The chat
formatter turns tool calls in the text into ``tool_calls`` when the request
gave tools (tool_parsers.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..engine.types import FinishReason, TokenLogprob, Usage
from .tool_parsers import StreamEvents, ToolParser, ToolStream


@dataclass
class Choice:
    """One finished choice of a non-streamed response."""

    text: str
    reason: FinishReason | None
    logprobs: list[TokenLogprob]


def _prompt_details(usage) -> dict:
    """OpenAI's cached_tokens, plus Nibble's split by tier when the tiers are on (extension)."""
    details = {"cached_tokens": usage.cached_tokens}
    by_tier = getattr(usage, "cached_by_tier", None)
    if by_tier:
        details["cached_tokens_by_tier"] = dict(by_tier)
    return details


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": _prompt_details(usage),
    }


def finish_reason_str(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


# JSON has no -inf: a token the processed logits rule out (a bias of -100, min_tokens, a top
# entry beyond the finite ones) is reported at OpenAI's floor
MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


class Formatter:
    """Builds one request's response objects; subclasses fix the endpoint's shapes."""

    object_full: str
    object_chunk: str

    def __init__(self, request_id: str, model: str, include_usage: bool = False,
                 token_text: Callable[[int], str] | None = None, n: int = 1):
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage   # streaming only: usage null per chunk + final usage chunk
        self.token_text = token_text         # set when the request asked for logprobs
        self.n = n                           # choices per request

    def logprobs(self, index: int, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """The endpoint's ``logprobs`` object for ``lps`` (None when not asked for)."""
        return None

    def _envelope(self, obj: str, choices: list[dict], usage: Any = ...) -> dict[str, Any]:
        out = {"id": self.request_id, "object": obj, "created": self.created,
               "model": self.model, "system_fingerprint": None, "choices": choices}
        if usage is not ...:
            out["usage"] = usage
        return out

    def chunk(self, choice: dict) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [choice], None if self.include_usage else ...)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The final chunk of a stream with include_usage: empty choices, the usage."""
        return self._envelope(self.object_chunk, [], usage_dict(usage))

    def start_chunks(self) -> list[dict[str, Any]]:
        return []

    def text_chunks(self, index: int, text: str, lps: list[TokenLogprob] | None = None
                    ) -> list[dict[str, Any]]:
        raise NotImplementedError

    def finish_chunks(self, index: int, reason: FinishReason | None) -> list[dict[str, Any]]:
        raise NotImplementedError

    def full(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        return self._envelope(self.object_full, [self.full_choice(i, c)
                                                 for i, c in enumerate(choices)],
                              usage_dict(usage))

    def full_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    """``text_completion`` objects of /v1/completions."""

    object_full = object_chunk = "text_completion"

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.offsets = [0] * self.n          # text offset of each choice's next token

    @staticmethod
    def _choice(index: int, text: str, reason: str | None, logprobs: dict | None = None
                ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def logprobs(self, index: int, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (legacy shape)."""
        if self.token_text is None or lps is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(t)
        return {"tokens": tokens,
                # the first echoed prompt token has nothing before it: null, as OpenAI's
                "token_logprobs": [None if lp.logprob is None else _lp(lp.logprob) for lp in lps],
                "top_logprobs": [None if lp.logprob is None else
                                 {self.token_text(t): _lp(v) for t, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def text_chunks(self, index: int, text: str, lps: list[TokenLogprob] | None = None
                    ) -> list[dict[str, Any]]:
        return [self.chunk(self._choice(index, text, None, self.logprobs(index, lps)))]

    def finish_chunks(self, index: int, reason: FinishReason | None) -> list[dict[str, Any]]:
        return [self.chunk(self._choice(index, "", finish_reason_str(reason)))]

    def full_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        return self._choice(index, choice.text, finish_reason_str(choice.reason),
                            self.logprobs(index, choice.logprobs))


class ChatFormatter(Formatter):
    """``chat.completion`` / ``chat.completion.chunk`` objects of /v1/chat/completions.
    With ``tools`` (a parser for the request's tools), calls in the text become
    ``tool_calls`` and the finish reason ``tool_calls``."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolParser | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.tools = tools
        self._streams: dict[int, ToolStream] = {}
        self._pending: dict[int, list[TokenLogprob]] = {}   # logprobs of held-back text

    def _delta(self, index: int, delta: dict, reason: str | None,
               logprobs: dict | None = None) -> dict[str, Any]:
        return self.chunk({"index": index, "delta": delta, "logprobs": logprobs,
                           "finish_reason": reason})

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    def logprobs(self, index: int, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``."""
        if self.token_text is None or lps is None:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                            for lp in lps], "refusal": None}

    def start_chunks(self) -> list[dict[str, Any]]:
        return [self._delta(i, {"role": "assistant", "content": ""}, None) for i in range(self.n)]

    def _events(self, index: int, ev: StreamEvents, lps: list[TokenLogprob] | None
                ) -> list[dict[str, Any]]:
        pending = self._pending.setdefault(index, [])
        pending += lps or []
        out = []
        if ev.content:
            out.append(self._delta(index, {"content": ev.content}, None))
        out += [self._delta(index, {"tool_calls": [d.to_openai()]}, None) for d in ev.deltas]
        if out and pending and self.token_text is not None:
            out[0]["choices"][0]["logprobs"] = self.logprobs(index, pending)
            self._pending[index] = []
        return out

    def text_chunks(self, index: int, text: str, lps: list[TokenLogprob] | None = None
                    ) -> list[dict[str, Any]]:
        if self.tools is None:
            return [self._delta(index, {"content": text}, None, self.logprobs(index, lps))]
        stream = self._streams.setdefault(index, self.tools.stream())
        return self._events(index, stream.feed(text), lps)

    def finish_chunks(self, index: int, reason: FinishReason | None) -> list[dict[str, Any]]:
        out, called = [], False
        if self.tools is not None:
            stream = self._streams.setdefault(index, self.tools.stream())
            out = self._events(index, stream.finish(), None)
            called = stream.called
        return out + [self._delta(index, {}, self._reason(reason, called))]

    @staticmethod
    def _reason(reason: FinishReason | None, called: bool) -> str | None:
        if called and reason is FinishReason.STOP:
            return "tool_calls"
        return finish_reason_str(reason)

    def full_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
        called = False
        if self.tools is not None:
            parsed = self.tools.parse(choice.text)
            if parsed.calls:
                called = True
                message["content"] = parsed.content
                message["tool_calls"] = [c.to_openai() for c in parsed.calls]
        return {"index": index, "message": message,
                "logprobs": self.logprobs(index, choice.logprobs),
                "finish_reason": self._reason(choice.reason, called)}
