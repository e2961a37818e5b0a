"""Per-request bookkeeping around ``engine.generate``: metrics and the in-flight set.

``tracked(...)`` wraps the engine's output stream. While the stream runs, its
request id is in the gateway's in-flight set (``/abort_request`` looks ids up
there). When the stream ends, however it ends, the request's latencies and
token counts go to the metrics once:

- finished output: its finish reason ("stop", "length", "abort"), or "error"
  when the output carries an error;
- an exception after the first output: "error";
- closed or cancelled early (client gone, aborted before the final output):
  "abort".

A request the engine refuses before any output (queue full, invalid) is not a
served request and is not counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from ..engine.types import RequestOutput
from ..metrics import RequestTimer


def _finish_reason(last: RequestOutput | None, failed: bool) -> str:
    if last is not None and last.finished:
        if last.error:
            return "error"
        return last.finish_reason.value if last.finish_reason is not None else "stop"
    return "error" if failed else "abort"


async def tracked(gen: AsyncIterator[RequestOutput], request_id: str, timer: RequestTimer,
                  inflight: set[str]) -> AsyncIterator[RequestOutput]:
    """Yield ``gen``'s outputs unchanged, recording the request as described above."""
    inflight.add(request_id)
    last: RequestOutput | None = None
    failed = rejected = False
    try:
        async with contextlib.aclosing(gen):
            async for out in gen:
                if out.new_token_ids:
                    timer.first_token()
                last = out
                yield out
    except Exception:
        rejected, failed = last is None, True
        raise
    finally:
        inflight.discard(request_id)
        if not rejected:
            u = last.usage if last is not None else None
            timer.finish(_finish_reason(last, failed),
                         u.prompt_tokens if u else 0, u.completion_tokens if u else 0,
                         u.cached_tokens if u else 0)
