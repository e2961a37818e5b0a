"""Graceful drain: what the server does between SIGTERM and its exit.

1. ``Drain.begin()``: new requests are refused. HTTP ``/v1/*`` answers 503
   with an OpenAI error body and ``Retry-After`` (``DrainMiddleware``);
   ``/health`` answers 503 ``{"status": "draining"}`` so load balancers stop
   routing here; gRPC ``Generate`` answers UNAVAILABLE and its health service
   NOT_SERVING (grpc_api). Admin routes and ``/metrics`` keep working.
   (The HTTP side is gateway/drain.py's ``DrainMiddleware``.)
2. Running requests get up to ``--graceful-shutdown-timeout`` seconds to finish.
3. Then the rest are cut (tracking.InFlight.cut): each is aborted in the
   engine and its stream ends with an error (SSE error event then
   ``data: [DONE]``; a non-streaming request gets a 503; gRPC UNAVAILABLE).
4. The caller (gateway/lifecycle.py) then stops the HTTP and gRPC servers.

Time comes from an injectable ``Clock`` (``now()``, ``sleep()``), so tests
drive the timeout without waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from .tracking import InFlight

log = logging.getLogger(__name__)

POLL_S = 0.05           # how often the drain looks at what is still running
CUT_GRACE_S = 5.0       # after the cut: how long aborted streams get to send their error
REFUSED_MESSAGE = ("The server is shutting down and admits no new requests; retry the "
                   "request (another replica can serve it).")


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(frozen=True)
class DrainReport:
    running_at_start: int       # requests in flight when the drain began
    cut: int                    # still running at the timeout: ended with an error
    left: int                   # still in flight after the cut grace (their servers stop them)
    seconds: float              # how long the drain took


class Drain:
    """Drain state shared by the HTTP app, the gRPC server and the serve lifecycle.

    Args:
        inflight: the gateway's in-flight registry (HTTP and gRPC requests).
        clock: time source (default: the monotonic clock).
    """

    def __init__(self, inflight: InFlight, clock: Clock | None = None,
                 poll_s: float = POLL_S, cut_grace_s: float = CUT_GRACE_S):
        self.inflight = inflight
        self.clock = clock or MonotonicClock()
        self.poll_s, self.cut_grace_s = poll_s, cut_grace_s
        self.draining = False
        self.active_http = 0        # /v1 requests inside the app (counted by DrainMiddleware)
        self._forced = False

    def begin(self) -> None:
        """Stop admitting requests (idempotent)."""
        if not self.draining:
            self.draining = True
            log.info("draining: refusing new requests; %d running", len(self.inflight))

    def force(self) -> None:
        """Cut what runs now instead of waiting for the timeout (a second signal)."""
        self._forced = True

    def busy(self) -> bool:
        return self.active_http > 0 or bool(self.inflight)

    async def _wait_idle(self, deadline: float, stop_on_force: bool) -> None:
        while self.busy() and self.clock.now() < deadline:
            if stop_on_force and self._forced:
                return
            await self.clock.sleep(self.poll_s)

    async def run(self, timeout: float, abort: Callable[[str], Awaitable[None]]
                  ) -> DrainReport:
        """Refuse new requests, wait up to ``timeout`` s for running ones, then cut the rest
        (``await abort(request_id)`` aborts each in the engine: ``EngineClient.abort``) and
        wait up to ``cut_grace_s`` for their streams to end."""
        self.begin()
        start = self.clock.now()
        running = len(self.inflight)
        await self._wait_idle(start + timeout, stop_on_force=True)
        cut = self.inflight.cut()
        for rid in cut:
            try:
                await abort(rid)
            except Exception:  # noqa: BLE001 - one failed abort must not stop the drain
                log.exception("drain: aborting %s failed", rid)
        if cut:
            log.warning("drain: graceful shutdown timeout (%.1fs) passed; ending %d running "
                        "request(s) with an error", timeout, len(cut))
            await self._wait_idle(self.clock.now() + self.cut_grace_s, stop_on_force=False)
        report = DrainReport(running, len(cut), len(self.inflight), self.clock.now() - start)
        log.info("drain done in %.1fs: %d running at start, %d cut, %d left",
                 report.seconds, report.running_at_start, report.cut, report.left)
        return report
