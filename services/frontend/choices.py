"""``n`` choices of one request: n engine requests, the prompt computed once.

Choice 0 starts alone; the others start when its first output arrives, that is
when its prompt's pages are in the prefix cache (the engine offers them as the
prompt completes), so each of them computes only the prompt's last partial
page. Choice ``i`` samples with ``seed + i`` when the request has a seed, so a
seeded request stays reproducible and its choices differ. The engine streams
are merged into ``(index, output)`` pairs; closing the merged stream closes
every engine stream. Shared by the HTTP gateway and the gRPC API.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from ..engine.client import EngineClient
from ..engine.types import GenerateRequest, RequestOutput, Usage
from .errors import EngineOutputError
from .tracking import AbortGuard

Track = Callable[[AsyncIterator[RequestOutput]], AsyncIterator[RequestOutput]]


def choice_requests(req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """``req`` for choice 0, and copies for choices 1..n-1 (ids ``<id>-<i>``)."""
    out = [req]
    for i in range(1, n):
        sp = req.sampling
        seed = None if sp.seed is None else sp.seed + i
        out.append(dataclasses.replace(req, request_id=f"{req.request_id}-{i}",
                                       sampling=dataclasses.replace(sp, seed=seed)))
    return out


def total_usage(usages: list[Usage]) -> Usage:
    """One response's usage: the prompt counted once (as OpenAI bills it), completion
    tokens summed over the choices, cached tokens summed too (so with n choices sharing one
    prefill, cached_tokens shows the n-1 prompts read from the cache)."""
    tiers: dict[str, int] = {}
    for u in usages:
        for tier, count in (u.cached_by_tier or {}).items():
            tiers[tier] = tiers.get(tier, 0) + count
    return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                 sum(u.cached_tokens for u in usages), tiers or None)


class ChoiceStreams:
    """The engine streams of one request's choices; ``guards[i]`` aborts choice ``i``."""

    def __init__(self, engine: EngineClient, reqs: list[GenerateRequest],
                 track: Track | None = None):
        self.engine, self.reqs, self.track = engine, reqs, track
        self.guards = [AbortGuard(engine, r.request_id) for r in reqs]
        self._gens: list[AsyncIterator[RequestOutput]] = []

    def _start(self, i: int) -> AsyncIterator[RequestOutput]:
        gen = self.engine.generate(self.reqs[i])
        if self.track is not None and i == 0:      # metrics and in-flight: once per request
            gen = self.track(gen)
        self._gens.append(gen)
        return gen

    async def first(self) -> RequestOutput:
        """Choice 0's first output (errors the engine raises before it propagate)."""
        try:
            return await self._start(0).__anext__()
        except StopAsyncIteration:
            raise EngineOutputError("the engine ended the request without any output") from None

    async def rest(self, first: RequestOutput) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Everything after ``first``: the other choices start now."""
        if len(self.reqs) == 1:            # one choice: no tasks between engine and client
            out = first
            while not out.finished:
                try:
                    out = await self._gens[0].__anext__()
                except StopAsyncIteration:
                    raise EngineOutputError("the engine ended the request without "
                                            "finishing it") from None
                yield 0, out
            return
        pending: dict[asyncio.Future, int] = {}
        try:
            if not first.finished:
                pending[asyncio.ensure_future(self._gens[0].__anext__())] = 0
            for i in range(1, len(self.reqs)):
                pending[asyncio.ensure_future(self._start(i).__anext__())] = i
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.__getitem__):
                    i = pending.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        raise EngineOutputError("the engine ended a choice without "
                                                "finishing it") from None
                    yield i, out
                    if not out.finished:
                        pending[asyncio.ensure_future(self._gens[i].__anext__())] = i
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def finish(self, index: int) -> None:
        self.guards[index].finish()

    async def close(self) -> None:
        """Abort the unfinished choices and close every engine stream."""
        for guard in self.guards[:len(self._gens)]:     # choices never started hold nothing
            await guard()
        for gen in self._gens:
            await gen.aclose()
