"""From a validated API request (OpenAI body) to the engine's ``GenerateRequest``.

``prepare_*``: check the model name and unsupported options, bound the
prompt's length in characters (``check_prompt_chars``), tokenize (chat template
for chat), check the context budget, map to SamplingParams. This is the one
place requests are validated; the engine below only asserts. The functions are
synchronous and slow for big prompts: callers run them on the Preparer's
threads (preparer.py), never on the event loop. The HTTP gateway and the gRPC
API (which converts its messages to the same request models) both use them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..engine.client import EngineClient
from ..engine.grammar import backend_for
from ..engine.grammar_spec import GrammarSpec
from ..engine.types import GenerateRequest, SamplingParams
from ..errors import ContextLengthExceededError, InvalidRequestError, ModelNotFoundError
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, new_request_id
from .responses import ChatFormatter, CompletionFormatter, Formatter
from .tool_prompt import TOOL_PARSER_AUTO, ToolPlan, plan_tools, template_messages

# No token of any tokenizer we load spans more characters than this on average over a
# prompt; a longer text cannot fit the context, so it is refused before tokenizing it.
MAX_CHARS_PER_TOKEN = 32


@dataclass
class Prepared:
    """A request ready for the engine, plus how to shape its response."""

    gen_req: GenerateRequest
    stream: bool
    fmt: Formatter              # its ``n``: the choices (n engine requests, one prefill)
    echo: str = ""              # completions with echo: the prompt's text, before the output


def check_model(engine: EngineClient, requested: str | None) -> None:
    """A missing model field means the served one; any other name is a 404."""
    if requested is not None and requested != engine.model_name:
        raise ModelNotFoundError(f"The model '{requested}' does not exist; "
                                 f"this server serves '{engine.model_name}'.")


def _check_common(body: SamplingFields) -> None:
    if body.top_k is not None and body.top_k < -1:
        raise InvalidRequestError("top_k must be -1, 0 (off) or >= 1", param="top_k")


TOKEN_ID_OUT_OF_RANGE = "token_id_out_of_range"   # depends on the model's vocabulary


def check_token_ids(tokenizer: Any, ids: list[int], param: str) -> None:
    vocab = getattr(tokenizer, "vocab_size", None)
    if isinstance(vocab, int) and ids and max(ids) >= vocab:
        raise InvalidRequestError(f"token id {max(ids)} is out of range (vocab size {vocab})",
                                  param=param, code=TOKEN_ID_OUT_OF_RANGE)


def resolve_max_tokens(requested: int | None, prompt_len: int, context_length: int,
                       param: str) -> int:
    """OpenAI's context check: prompt + completion must fit; absent max_tokens fills it."""
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty", param=param)
    if requested is None:
        requested = context_length - prompt_len
        if requested < 1:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {context_length} tokens. However, your "
                f"prompt is {prompt_len} tokens, which leaves no room for completion tokens. "
                "Please reduce the length of the prompt.", param=param,
                code="context_length_exceeded")
    elif prompt_len + requested > context_length:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
            f"for the completion (max_tokens)). Please reduce the length of the prompt or "
            "max_tokens.", param=param, code="context_length_exceeded")
    return requested


def check_prompt_chars(n_chars: int, context_length: int, param: str) -> None:
    """Refuse a prompt of ``n_chars`` characters that cannot fit ``context_length`` tokens,
    without spending the time to tokenize it (the exact check follows tokenization)."""
    limit = context_length * MAX_CHARS_PER_TOKEN
    if n_chars > limit:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {context_length} tokens. However, your "
            f"prompt is {n_chars} characters long, more than any prompt that fits ({limit} "
            "characters at most). Please reduce the length of the prompt.", param=param,
            code="context_length_exceeded")


def grammar_spec(engine: EngineClient, body: SamplingFields,
                 tools: GrammarSpec | None = None) -> GrammarSpec | None:
    """The request's structured-output constraint, compiled here (off the engine thread,
    cached by spec): ``response_format`` json_object / json_schema, ``regex`` / ``ebnf``, or
    ``tools`` (the grammar of a forced tool call). A 400 when several are given, when it
    does not compile, or when grammars are off."""
    rf = body.response_format
    given = [("tool_choice", tools)] if tools is not None else []
    schema = rf.json_schema.schema_ if rf is not None and rf.json_schema is not None else None
    if rf is not None and (rf.type == "json_object" or (rf.type == "json_schema"
                                                        and schema is None)):
        # OpenAI's json_schema.schema is optional: without one, any JSON object
        given.append(("response_format", GrammarSpec("json_object")))
    elif rf is not None and rf.type == "json_schema":
        given.append(("response_format", GrammarSpec(
            # the schema's own key order: xgrammar emits properties in that order
            "json_schema", json.dumps(rf.json_schema.schema_),
            bool(rf.json_schema.strict))))
    for name in ("regex", "ebnf"):
        if getattr(body, name) is not None:
            given.append((name, GrammarSpec(name, getattr(body, name))))
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(f"give one of {', '.join(n for n, _ in given)}, not several",
                                  param=given[1][0])
    param, spec = given[0]
    backend = backend_for(engine.tokenizer)
    if backend is None:
        raise InvalidRequestError(f"{param}: structured outputs are off on this server "
                                  "(--grammar-backend none)", param=param)
    backend.compile(spec)
    return spec


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None = None,
                    grammar: GrammarSpec | None = None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k in (None, 0) else body.top_k,
        seed=body.seed,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        min_p=body.min_p or 0.0,
        min_tokens=min(body.min_tokens or 0, max_tokens),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=logit_bias(body.logit_bias),
        logprobs=logprobs,
        grammar=grammar,
    )


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` -> ``((id, bias), ...)``; a key that is no token id
    is a 400 (the vocabulary bound is checked with the prompt's ids)."""
    out = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or len(key) > 9:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                      param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def _finish_prepare(engine: EngineClient, body: SamplingFields, ids: list[int], max_tokens: int | None,
                    param: str, prefix: str, fmt_cls: type[Formatter],
                    logprobs: int | None = None, tools: ToolPlan | None = None) -> Prepared:
    max_tokens = resolve_max_tokens(max_tokens, len(ids), engine.context_length, param)
    rid = new_request_id(prefix)
    stream = bool(body.stream)
    include_usage = stream and bool(body.stream_options and body.stream_options.include_usage)
    grammar = grammar_spec(engine, body, tools.grammar if tools is not None else None)
    sampling = sampling_params(body, max_tokens, logprobs, grammar)
    check_token_ids(engine.tokenizer, [t for t, _ in sampling.logit_bias], "logit_bias")
    gen_req = GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                              cache_salt=body.cache_salt)
    n = body.n or 1
    kw = {"tools": tools.parser} if tools is not None else {}
    fmt = fmt_cls(rid, engine.model_name, include_usage,
                  token_text(engine.tokenizer) if logprobs is not None else None, n, **kw)
    return Prepared(gen_req, stream, fmt)


def token_text(tokenizer: Any):
    """``id -> str``: one token's text as logprobs report it (its own decode)."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return text


def completion_prompt_ids(tokenizer: Any, prompt: str | list, context_length: int) -> list[int]:
    """``str | list[int] | [str] | [list[int]]`` -> token ids (batches of >1 are rejected)."""
    if isinstance(prompt, list):
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidRequestError("only one prompt per request is supported",
                                          param="prompt")
            prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), context_length, "prompt")
        # Raw text: the tokenizer adds BOS if its config says so (as vLLM does).
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    ids = list(prompt)
    check_token_ids(tokenizer, ids, "prompt")
    return ids


def prepare_completion(engine: EngineClient, body: CompletionRequest) -> Prepared:
    check_model(engine, body.model)
    _check_common(body)
    if body.best_of not in (None, 1):
        raise InvalidRequestError("best_of must be 1", param="best_of")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    ids = completion_prompt_ids(engine.tokenizer, body.prompt, engine.context_length)
    p = _finish_prepare(engine, body, ids, body.max_tokens, "prompt", "cmpl",
                        CompletionFormatter, body.logprobs)
    if body.echo:
        p.echo = engine.tokenizer.decode(ids, skip_special_tokens=False)
        if body.logprobs is not None:       # score the prompt too (it is computed in full)
            sp = dataclasses.replace(p.gen_req.sampling, prompt_logprobs=body.logprobs)
            p.gen_req = dataclasses.replace(p.gen_req, sampling=sp)
    return p


def prepare_chat(engine: EngineClient, body: ChatCompletionRequest,
                 tool_parser: str = TOOL_PARSER_AUTO) -> Prepared:
    """``tool_parser``: the server's --tool-call-parser (tool_prompt.py)."""
    check_model(engine, body.model)
    _check_common(body)
    template = getattr(getattr(engine.tokenizer, "chat_template", None), "source", None)
    tools = plan_tools(body, tool_parser, template)
    messages = template_messages(body, tools)
    check_prompt_chars(sum(len(m["content"]) for m in messages), engine.context_length,
                       "messages")
    extra = {"tools": tools.template_tools} if tools.template_tools else {}
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    ids = list(engine.tokenizer.encode(text, add_special_tokens=False))
    max_tokens = body.max_completion_tokens or body.max_tokens
    return _finish_prepare(engine, body, ids, max_tokens, "messages", "chatcmpl", ChatFormatter,
                           # top_logprobs takes effect with logprobs: true only
                           (body.top_logprobs or 0) if body.logprobs else None, tools)
