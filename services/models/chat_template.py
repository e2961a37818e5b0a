"""Rendering HF-style Jinja chat templates in a sandbox.

The environment mirrors what checkpoint templates expect from transformers:
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that keeps non-ASCII text, and the globals
``raise_exception`` and ``strftime_now``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidRequestError


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# Errors a template can raise while rendering request data (e.g. ``'a' + None``).
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class ChatTemplate:
    """A compiled chat template; ``render`` raises ``InvalidRequestError`` on any template fault."""

    def __init__(self, source: str | None, special: dict[str, str | None]):
        self.source = source
        self._special = {k: (v or "") for k, v in special.items()}
        self._compiled: jinja2.Template | None = None

    def _template(self) -> jinja2.Template:
        if self.source is None:
            raise InvalidRequestError("this model has no chat template; use the completions API",
                                      code="no_chat_template")
        if self._compiled is None:
            try:
                self._compiled = _make_env().from_string(self.source)
            except jinja2.TemplateSyntaxError as e:
                raise InvalidRequestError(f"chat template does not compile: {e}",
                                          code="chat_template_error") from e
        return self._compiled

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """Render ``messages`` (OpenAI-style dicts) to the prompt string; ``tools`` (function
        tools as transformers passes them) only reach templates that ask for them."""
        template = self._template()
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of objects", param="messages")
        try:
            extra = {} if tools is None else {"tools": tools}
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **extra, **self._special)
        except _RENDER_ERRORS as e:
            raise InvalidRequestError(f"chat template error: {e}", param="messages",
                                      code="chat_template_error") from e


def pick_template(value: Any) -> str | None:
    """A ``tokenizer_config.json`` ``chat_template`` value -> the default template source.

    The value is a string, or a list of ``{"name", "template"}`` entries of which
    ``"default"`` is used.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {e.get("name"): e.get("template") for e in value if isinstance(e, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None
