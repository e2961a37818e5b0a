"""The admission gate of ``--max-queued-requests``: how many requests really wait.

A request is *pending* from its submission (event-loop thread) until the
scheduler first gives it a running slot (engine thread), then *running* until
its final output. Both sets live under one lock, so a request moves from one to
the other atomically and no reader sees it twice or not at all.

A pending request only *queues* if no running slot is free for it: with
``max_running_requests`` slots, ``queued = max(0, pending - free_slots)``,
where ``free_slots = max_running - running``. So an idle server admits a burst
of ``max_running + max_queued`` requests whichever thread runs first, and
``--max-queued-requests 0`` still admits up to ``max_running`` requests.
(A pending request whose slot is free but whose pages are not yet available
is not counted: the gate bounds how many requests the server holds,
``max_running + max_queued``, which is what it is for.)
"""

from __future__ import annotations

import threading

from ..errors import InvalidRequestError, QueueFullError


class AdmissionGate:
    """Pending and running request ids (thread safe).

    Args:
        max_running: running slots (``--max-running-requests``).
        max_queued: requests allowed to wait beyond them (``--max-queued-requests``);
            None = unbounded.
    """

    def __init__(self, max_running: int, max_queued: int | None):
        self.max_running, self.max_queued = max_running, max_queued
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._running: set[str] = set()

    def _queued(self, extra: int = 0) -> int:
        """Pending requests (plus ``extra`` new ones) that find no free running slot."""
        free = max(0, self.max_running - len(self._running))
        return max(0, len(self._pending) + extra - free)

    def admit(self, request_id: str) -> None:
        """Count ``request_id`` as pending, or raise QueueFullError when it would have to
        wait and ``max_queued`` requests already do (InvalidRequestError when that id is
        already in flight)."""
        with self._lock:
            if request_id in self._pending or request_id in self._running:
                raise InvalidRequestError(f"duplicate request id {request_id}")
            queued = self._queued()
            if self.max_queued is not None and self._queued(extra=1) > self.max_queued:
                raise QueueFullError(f"the request queue is full ({queued} waiting, "
                                     f"--max-queued-requests {self.max_queued}); retry later")
            self._pending.add(request_id)

    def started(self, request_id: str) -> None:
        """The scheduler gave ``request_id`` a running slot (no-op for ids not admitted here)."""
        with self._lock:
            if request_id in self._pending:
                self._pending.discard(request_id)
                self._running.add(request_id)

    def finished(self, request_id: str) -> None:
        """``request_id`` produced its final output (or never reached the engine)."""
        with self._lock:
            self._pending.discard(request_id)
            self._running.discard(request_id)

    def counts(self) -> tuple[int, int, int]:
        """``(pending, running, queued)`` as one consistent snapshot."""
        with self._lock:
            return len(self._pending), len(self._running), self._queued()
