"""Per-request bookkeeping around ``engine.generate``: metrics, the in-flight registry and
the abort guard, for the HTTP gateway and the gRPC API alike.

``tracked(...)`` wraps the engine's output stream. While the stream runs, its
request id is in the gateway's ``InFlight`` registry with the tenant that owns
it (``/abort_request`` looks ids up there; the drain waits on it). When the
stream ends, however it ends, the request's latencies and token counts go to
the metrics once:

- finished output: its finish reason ("stop", "length", "abort"), or "error"
  when the output carries an error;
- an exception after the first output: "error";
- closed or cancelled early (client gone, aborted before the final output):
  "abort".

A request the engine refuses before any output (queue full, invalid) is not a
served request and is not counted.

Drain cut (frontend/drain.py): ``InFlight.cut()`` marks every request in
flight; their engine requests are then aborted, and the abort output of a
marked request becomes a ``ServerDrainingError`` raised into the stream, so
the client sees an error (SSE error event, 503, gRPC UNAVAILABLE), not a
normal "abort" finish. After a cut, new streams fail with that error at once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from ..engine.client import EngineClient
from ..engine.types import FinishReason, RequestOutput
from ..errors import ServerDrainingError
from ..metrics import RequestTimer

log = logging.getLogger(__name__)

CUT_MESSAGE = ("the server is shutting down and its graceful shutdown timeout has passed; "
               "retry the request")


class InFlight(set):
    """Request ids being served (a set, for membership and size), each with its owner:
    the tenant id of the API key that sent it (None without keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: dict[str, str | None] = {}
        self.marked: set[str] = set()      # cut by the drain: their end is an error
        self.closed = False                # cut happened: new streams fail at once

    def track(self, request_id: str, owner: str | None) -> None:
        if self.closed:
            raise ServerDrainingError(CUT_MESSAGE)
        self.add(request_id)
        self.owners[request_id] = owner

    def untrack(self, request_id: str) -> None:
        self.discard(request_id)
        self.owners.pop(request_id, None)
        self.marked.discard(request_id)

    def owned_by(self, request_id: str, tenant: str | None) -> bool:
        """``request_id`` is in flight and was sent with ``tenant``'s key."""
        return request_id in self and self.owners.get(request_id) == tenant

    def cut(self) -> list[str]:
        """Mark every request in flight (and refuse new ones); returns the marked ids."""
        self.closed = True
        self.marked.update(self)
        return sorted(self)


def _was_cut(out: RequestOutput, request_id: str, inflight: InFlight) -> bool:
    """The final output of a request the drain cut (not one that finished on its own)."""
    return (out.finished and request_id in inflight.marked
            and (bool(out.error) or out.finish_reason is FinishReason.ABORT))


def _finish_reason(last: RequestOutput | None, failed: bool) -> str:
    if last is not None and last.finished:
        if last.error:
            return "error"
        return last.finish_reason.value if last.finish_reason is not None else "stop"
    return "error" if failed else "abort"


async def tracked(gen: AsyncIterator[RequestOutput], request_id: str, timer: RequestTimer,
                  inflight: InFlight, owner: str | None = None
                  ) -> AsyncIterator[RequestOutput]:
    """Yield ``gen``'s outputs unchanged, recording the request as described above."""
    last: RequestOutput | None = None
    failed = rejected = False
    try:
        async with contextlib.aclosing(gen):
            inflight.track(request_id, owner)
            async for out in gen:
                if _was_cut(out, request_id, inflight):
                    raise ServerDrainingError(CUT_MESSAGE)
                if out.new_token_ids:
                    timer.first_token()
                last = out
                yield out
    except Exception:
        rejected, failed = last is None, True
        raise
    finally:
        inflight.untrack(request_id)
        if not rejected:
            u = last.usage if last is not None else None
            timer.finish(_finish_reason(last, failed),
                         u.prompt_tokens if u else 0, u.completion_tokens if u else 0,
                         u.cached_tokens if u else 0)


class AbortGuard:
    """Aborts one request in the engine once, unless it was marked finished first."""

    def __init__(self, engine: EngineClient, request_id: str):
        self.engine, self.request_id, self.done = engine, request_id, False

    def finish(self) -> None:
        self.done = True

    async def __call__(self) -> None:
        if not self.done:
            self.done = True
            log.info("aborting %s: the client went away or its stream ended early",
                     self.request_id)
            await self.engine.abort(self.request_id)
