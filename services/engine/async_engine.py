"""Asyncio front of the engine: the step loop runs on its own thread.

Requests and aborts reach the loop through a thread-safe inbox; outputs go back
to each request's asyncio queue with ``call_soon_threadsafe``.

Faults: a step that fails for some requests fails only those (``EngineCore``
isolates them). A device fault (``DeviceFaultError``) ends the engine: every
request gets the error, ``is_healthy()`` turns False with ``dead_reason``, and
the thread then answers every later submission with that error until shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import asdict
from typing import AsyncIterator

from ..config import NibbleConfig
from ..credentials import redact_urls
from ..errors import EngineDeadError, NibbleError
from .admission import AdmissionGate
from .builder import EngineParts, build_parts
from .client import EngineStats
from .engine import EngineCore
from .faults import describe, is_device_fault
from .pauses import freeze_startup_objects
from ..parallel.follower import stop_followers
from .types import FinishReason, GenerateRequest, RequestOutput, TokenLogprob, Usage

log = logging.getLogger(__name__)


class AsyncEngine:
    """Thread-backed async wrapper around :class:`EngineCore`; an ``EngineClient``
    (services/engine/client.py)."""

    def __init__(self, parts: EngineParts, cfg: NibbleConfig):
        self.cfg = cfg
        self.parts = parts
        self.core: EngineCore = parts.core
        self.tokenizer = parts.tokenizer
        self.model_name = parts.model_name
        self.context_length = self.core.max_request_tokens
        self._inbox: queue.Queue = queue.Queue()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._dead: str | None = None
        sch = cfg.scheduler
        self.gate = AdmissionGate(sch.max_running_requests, sch.max_queued_requests)
        self.core.scheduler.on_start = self.gate.started
        self._thread = threading.Thread(target=self._loop, name="nibble-engine", daemon=True)
        self._thread.start()

    # ---- client side (event loop thread) ----
    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submit ``req`` and yield its updates until it finishes.

        Raises InvalidRequestError before yielding if the request can never run,
        QueueFullError when --max-queued-requests is reached.
        Closing the generator early (client gone) aborts the request.
        """
        if self._dead:
            raise EngineDeadError(self._dead)
        self.core.validate(req)
        self.gate.admit(req.request_id)      # counted until its final output is delivered
        async for out in self._stream(req.request_id, ("add", req)):
            yield out

    async def generate_prefilled(self, req: GenerateRequest, first_token: int,
                                 first_logprob: TokenLogprob | None = None
                                 ) -> AsyncIterator[RequestOutput]:
        """Continue a request whose prompt pages a prefill worker wrote into our reservation."""
        action = ("install", (req, first_token, first_logprob))
        async for out in self._stream(req.request_id, action):
            yield out

    async def _stream(self, request_id: str, action: tuple) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._queues[request_id] = (loop, q)
        self._inbox.put(action)
        finished = False
        try:
            while True:
                out: RequestOutput = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._post_abort(request_id)
            with self._lock:
                self._queues.pop(request_id, None)

    async def call(self, fn, *args):
        """Run ``fn(*args)`` on the engine thread (engine state is single-threaded)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (lambda: fn(*args), done)))
        return await asyncio.wrap_future(done)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason ABORT."""
        self._post_abort(request_id)

    def _post_abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def abort_all(self) -> int:
        """Abort every request; returns how many were known at the call."""
        with self._lock:
            n = len(self._queues)
        self._inbox.put(("abort_all", None))
        return n

    async def flush_cache(self) -> bool:
        """Clear the prefix cache on the engine thread; False while requests run or wait."""
        if self.core.has_unfinished() or not self._inbox.empty():
            return False
        return bool(await self.call(self.core.flush_cache))

    async def stats(self) -> EngineStats:
        """Gauges of the engine (read without locking; values may be one step old)."""
        return EngineStats.from_dict(self.core.stats())

    async def kv_events(self, since: int = 0, limit: int = 1000) -> dict:
        """KV events after ``since`` (see ``nibble.tiering.events``)."""
        event_log = self.core.kv.events
        if event_log is None:
            return {"events": [], "last_seq": 0, "lost": False}
        events, lost = event_log.since(since, limit)
        return {"events": [e.__dict__ for e in events], "last_seq": event_log.last_seq,
                "lost": lost}

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (a device fault), or None while it is healthy."""
        return self._dead

    async def server_info(self) -> dict:
        pool = self.core.pool
        capacity = pool.capacity().as_dict()
        tp = getattr(self.core, "tp_info", None)
        if tp is not None:        # the group's bytes, not rank 0's share
            capacity.update(bytes_per_token=tp["group_bytes_per_token"],
                            pool_bytes=tp["group_pool_bytes"])
        return {
            "model": self.model_name,
            "config": redacted_config(self.cfg),
            "context_length": self.context_length,
            "capacity": capacity,
            "tensor_parallel": tp or {"size": 1},
            "kv_bytes_per_token": self.parts.bytes_per_token_by_format,
            "kv_pool": {"total_pages": pool.num_pages, "free_pages": pool.allocator.num_free,
                        "page_size": pool.layout.page_size},
            "running_requests": self.core.num_running(),
            "queued_requests": self.core.num_waiting(),
            "stats": self.core.stats(),
            "device": str(pool.device),
            "attention_backend": self.parts.backend_name,
        }

    async def shutdown(self) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)

    # ---- engine thread ----
    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            self.gate.finished(out.request_id)
        with self._lock:
            target = self._queues.get(out.request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            try:
                self.core.add_validated(payload)     # validated in generate(), on the loop
            except NibbleError as e:
                self._deliver(RequestOutput(payload.request_id, [], "", True, FinishReason.ABORT,
                                            self._zero_usage(payload), error=str(e)))
        elif kind == "install":
            req, first, logprob = payload
            try:
                self._deliver(self.core.add_prefilled(req, first, logprob))
            except NibbleError as e:
                self._deliver(RequestOutput(req.request_id, [], "", True, FinishReason.ABORT,
                                            self._zero_usage(req), error=str(e)))
        elif kind == "abort":
            out = self.core.abort(payload)
            if out is not None:
                self._deliver(out)
        elif kind == "abort_all":
            for out in self.core.abort_all():
                self._deliver(out)
        elif kind == "call":
            fn, future = payload
            try:
                future.set_result(fn())
            except Exception as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)
                if is_device_fault(e):      # e.g. a tensor-parallel rank gone mid-transfer
                    self._die(e)

    @staticmethod
    def _zero_usage(req: GenerateRequest) -> Usage:
        return Usage(len(req.prompt_token_ids), 0, 0)

    def _drain(self, block: bool) -> None:
        """Handle the inbox: everything queued, or (``block``: the engine is idle) the first
        item within 0.5 s, so the idle engine's background poll runs between items."""
        try:
            kind, payload = self._inbox.get(timeout=0.5 if block else None) if block \
                else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._handle(kind, payload)
        while not block and self._dead is None:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(kind, payload)

    def _loop(self) -> None:
        while not self._stopping.is_set() and self._dead is None:
            self._drain(block=not self.core.has_unfinished())
            if not self.core.has_unfinished():
                self.core.poll_background()
                continue
            try:
                outs = self.core.step()
            except Exception as e:  # noqa: BLE001 - classified: device fault, or a bug
                if is_device_fault(e):
                    self._die(e)
                    break
                # A bug outside the model step (scheduler, tiers): its state is unknown.
                log.exception("engine step failed; failing the running requests")
                outs = self.core.fail_all(f"internal engine error: {describe(e)}")
            for out in outs:
                self._deliver(out)
        while self._dead is not None and not self._stopping.is_set():
            self._refuse_next()
        for out in self.core.fail_all("server shutting down"):
            self._deliver(out)
        self.core.kv.close()
        self.core.step_timer.close()
        if self._dead is None:
            stop_followers(self.core.runner.tp)     # tensor parallel: the other ranks end

    def _die(self, exc: BaseException) -> None:
        """A device fault: fail every request and stop serving (engine thread)."""
        self._dead = f"engine stopped after a device fault: {describe(exc)}"
        log.critical("%s; failing every request", self._dead, exc_info=exc)
        for out in self.core.fail_all(self._dead, type(exc).__name__):
            self._deliver(out)

    def _refuse_next(self) -> None:
        """Dead engine: answer the next inbox item with the fault instead of running it."""
        try:
            kind, payload = self._inbox.get(timeout=0.5)
        except queue.Empty:
            return
        if kind in ("add", "install"):
            req = payload if kind == "add" else payload[0]
            self._deliver(RequestOutput(req.request_id, [], "", True, FinishReason.ABORT,
                                        self._zero_usage(req), error=self._dead,
                                        error_type=EngineDeadError.__name__))
        elif kind == "call":
            payload[1].set_exception(EngineDeadError(self._dead))


def redacted_config(cfg: NibbleConfig) -> dict:
    """The config as a dict with secrets (API keys) replaced by their count, and the
    credentials of every URL in it (a Redis password) by ``<redacted>``."""
    out = asdict(cfg)
    for field in ("api_keys", "admin_api_keys"):
        if field in out["server"]:
            out["server"][field] = f"<{len(out['server'][field])} configured>"
    return redact_urls(out)


def build_engine(cfg: NibbleConfig) -> AsyncEngine:
    """Load the model, size the KV pool, log capacity and start the engine thread.

    What start-up built is frozen out of the garbage collector's walks first
    (:func:`~.pauses.freeze_startup_objects`): a full collection inside a step then walks
    only what the requests created."""
    parts = build_parts(cfg)
    freeze_startup_objects()
    return AsyncEngine(parts, cfg)
