"""A scripted stand-in for AsyncEngine: an ``EngineClient``, no model.

Tokenizer: one token per character (id = code point). The engine replies with
``reply`` one character per output, stops at max_tokens (finish "length") or
at the reply's end ("stop"), and records every request and abort so tests can
assert on them. Control methods (stats, flush_cache, abort_all) follow
AsyncEngine's contract; ``active`` holds the ids of requests being generated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from nibble.services.engine.client import EngineStats
from nibble.services.engine.types import FinishReason, GenerateRequest, RequestOutput, Usage
from nibble.services.errors import InvalidRequestError

CHAT_ROLES = {"system", "user", "assistant", "tool"}


class FakeTokenizer:
    eos_token_ids = (0,)
    bos_token_id = 1
    vocab_size = 0x110000

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        for m in messages:
            if m["role"] not in CHAT_ROLES or not isinstance(m["content"], str):
                raise InvalidRequestError(f"bad message {m!r}", param="messages")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """Scripted engine. Knobs:

    reply          text produced, one character per RequestOutput
    delay          seconds before each output (lets a client disconnect mid-request)
    hang_after     number of outputs after which it waits until aborted
    cached_tokens  reported as Usage.cached_tokens
    raise_before   exception raised before the first output (admission failure)
    raise_after    (n, exc): raise exc after n outputs (engine fault mid-stream)
    error_after    (n, msg): after n outputs, a finished output with error=msg
    stats_extra    merged into stats() (e.g. to fake preemptions or a failing key)
    """

    def __init__(self, reply: str = "Hello, world!", *, model_name: str = "fake-model",
                 context_length: int = 64, delay: float = 0.0, hang_after: int | None = None,
                 cached_tokens: int = 0, raise_before: BaseException | None = None,
                 raise_after: tuple[int, BaseException] | None = None,
                 error_after: tuple[int, str] | None = None):
        self.model_name = model_name
        self.context_length = context_length
        self.tokenizer = FakeTokenizer()
        self.reply, self.delay, self.hang_after = reply, delay, hang_after
        self.cached_tokens = cached_tokens
        self.raise_before, self.raise_after, self.error_after = raise_before, raise_after, error_after
        self.healthy = True
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.active: set[str] = set()
        self.hanging: set[str] = set()        # requests waiting in hang_after until aborted
        self.flushes = 0
        self.stats_extra: dict = {}
        self.shut_down = False
        self.dead_reason: str | None = None

    def _out(self, req: GenerateRequest, ids: list[int], n_done: int, reason: FinishReason | None,
             error: str | None = None) -> RequestOutput:
        usage = Usage(len(req.prompt_token_ids), n_done, self.cached_tokens)
        return RequestOutput(req.request_id, ids, self.tokenizer.decode(ids),
                             reason is not None, reason, usage, error)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(req)
        if self.raise_before is not None:
            raise self.raise_before
        self.active.add(req.request_id)
        try:
            async with contextlib.aclosing(self._outputs(req)) as outs:
                async for out in outs:
                    yield out
        finally:
            self.active.discard(req.request_id)

    async def _outputs(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        reply = self.tokenizer.encode(self.reply)
        ids = reply[: req.sampling.max_tokens]
        final = FinishReason.LENGTH if len(reply) > len(ids) else FinishReason.STOP
        for i, tok in enumerate(ids):
            if self.raise_after and i == self.raise_after[0]:
                raise self.raise_after[1]
            if self.error_after and i == self.error_after[0]:
                yield self._out(req, [], i, FinishReason.ABORT, self.error_after[1])
                return
            if self.hang_after is not None and i == self.hang_after:
                self.hanging.add(req.request_id)
                while req.request_id not in self.aborted:
                    await asyncio.sleep(0.005)
                self.hanging.discard(req.request_id)
            await asyncio.sleep(self.delay)
            if req.request_id in self.aborted:
                yield self._out(req, [], i, FinishReason.ABORT)
                return
            last = i == len(ids) - 1
            yield self._out(req, [tok], i + 1, final if last else None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def abort_all(self) -> int:
        ids = sorted(self.active)
        self.aborted.extend(ids)
        return len(ids)

    async def flush_cache(self) -> bool:
        if self.active:
            return False
        self.flushes += 1
        return True

    async def stats(self) -> EngineStats:
        return EngineStats(**{"num_running": len(self.active), "num_queued": 0, "token_usage": 0.25,
                "max_total_tokens": 4096, "kv_bytes_per_token": 1234.5,
                "kv_cache_dtype": "nvfp4", "cache_hit_rate": 0.5, "num_preemptions": 2,
                "num_cached_pages": 3, **self.stats_extra})

    async def server_info(self) -> dict:
        return {"model": self.model_name, "context_length": self.context_length,
                "config": {"server": {"port": 1, "api_keys": ["sk-user"],
                                      "admin_api_keys": ["sk-admin"]}},
                "kv_pool": {"free_pages": 10, "total_pages": 10}}

    async def kv_events(self, since: int = 0, limit: int = 1000) -> dict:
        return {"events": [], "last_seq": 0, "lost": False}

    def is_healthy(self) -> bool:
        return self.healthy

    async def shutdown(self) -> None:
        self.shut_down = True
