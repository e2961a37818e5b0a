"""The one interface the frontends (HTTP gateway, gRPC API) use to talk to an engine.

``EngineClient`` is implemented by the colocated ``AsyncEngine`` (engine thread in
this process) and the disaggregated ``DisaggEngine`` (Ray actors), and by the
tests' fakes. Every control method is a coroutine, so a caller never has to
guess whether one may block; ``generate`` is an async generator. The only
synchronous calls are ``is_healthy`` and ``dead_reason``, which read a flag.

``EngineStats`` is what ``stats()`` returns: the gauges and totals behind
``/metrics`` (services/metrics.py). A field an engine does not report is None,
and its metric is left out.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .types import GenerateRequest, RequestOutput


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of an engine's gauges (None: not reported by this engine)."""

    num_running: int | None = None              # requests prefilling or decoding
    num_queued: int | None = None               # requests waiting for admission
    token_usage: float | None = None            # share of KV pool pages in use, 0..1
    max_total_tokens: int | None = None         # KV pool capacity in tokens
    kv_bytes_per_token: float | None = None     # KV bytes per token, all layers
    kv_cache_dtype: str | None = None           # the pool's KV format name ("nvfp4", ...)
    cache_hit_rate: float | None = None         # cached prompt tokens / prompt tokens admitted
    num_preemptions: int | None = None          # total: requests preempted for lack of pages
    num_request_faults: int | None = None       # total: requests failed alone by their own fault
    num_fault_recomputes: int | None = None     # total: requests recomputed without suspect pages
    prompt_tokens_computed: int | None = None   # total: prompt tokens run through the model
    num_cached_pages: int | None = None         # KV pages held by the prefix cache
    tiers: dict[str, Any] | None = None         # TierManager.stats() (L2/L3 counters), if any
    transfers: dict[str, Any] | None = None     # disaggregation: KV transfer counters
    step_intervals: dict[str, Any] | None = None  # StepTimer.snapshot(): step interval histograms

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineStats":
        """From a stats dict (``EngineCore.stats()``, the router's); other keys are dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@runtime_checkable
class EngineClient(Protocol):
    """What a frontend may ask of an engine (see the module doc)."""

    model_name: str         # the served model's name (the ``model`` field of requests)
    context_length: int     # prompt + completion tokens one request may hold
    tokenizer: Any          # encode / decode / apply_chat_template / vocab_size

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield ``req``'s outputs until one is finished. ``req`` was validated by the
        frontend (frontend/prepare.py). Raises QueueFullError or EngineDeadError before
        the first output; closing the iterator early aborts the request."""
        ...

    async def abort(self, request_id: str) -> None:
        """End a request; its stream's last output has finish_reason ABORT."""
        ...

    async def abort_all(self) -> int:
        """Abort every request; returns how many there were."""
        ...

    async def flush_cache(self) -> bool:
        """Clear the prefix cache; False (nothing changed) while requests run or wait."""
        ...

    async def server_info(self) -> dict[str, Any]:
        """Config (keys redacted by the caller), capacity and state, for /get_server_info."""
        ...

    async def stats(self) -> EngineStats:
        ...

    async def kv_events(self, since: int = 0, limit: int = 1000) -> dict[str, Any]:
        """KV cache events after ``since`` (nibble.tiering.events)."""
        ...

    def is_healthy(self) -> bool:
        ...

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving, or None."""
        ...

    async def shutdown(self) -> None:
        ...


ASYNC_METHODS = ("abort", "abort_all", "flush_cache", "server_info", "stats", "kv_events",
                 "shutdown")


def protocol_violations(engine: object) -> list[str]:
    """What keeps ``engine`` (an instance or a class) from being an ``EngineClient``
    beyond the attribute names ``isinstance`` checks: the kind of each method."""
    bad = []
    for name in ASYNC_METHODS:
        if not inspect.iscoroutinefunction(getattr(engine, name, None)):
            bad.append(f"{name} is not a coroutine function")
    if not inspect.isasyncgenfunction(getattr(engine, "generate", None)):
        bad.append("generate is not an async generator function")
    if inspect.iscoroutinefunction(getattr(engine, "is_healthy", None)):
        bad.append("is_healthy must be synchronous")
    return bad
