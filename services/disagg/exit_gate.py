"""When a worker actor whose engine died may exit: only after every call in flight answered.

A worker whose engine died of a device fault (a broken GPU context, a tensor-parallel rank
gone) exits with a non-zero code so Ray restarts it. The router's poll (``stats``) notices
first, often while the call that hit the fault is still turning its error into a reply:
exiting then loses that reply, and the client sees "actor unavailable" instead of the
cause ("tensor-parallel group lost a rank during ..."). The gate counts the serving calls
in flight; an exit asked for while any runs waits for the last to finish, then for
``flush_s`` more, so Ray's reply leaves the process first (the reply is sent after the
coroutine returns, by Ray's own threads; there is no hook for "sent"). A call that never
ends (a stream nobody reads) cannot hold the process: it exits ``max_wait_s`` after the
request regardless.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import threading
from typing import Callable

log = logging.getLogger(__name__)
FLUSH_S = 1.0             # from the last reply to the exit: loopback Ray replies take ~ms
MAX_WAIT_S = 30.0         # from the exit request to the exit, however many calls still run


class ExitGate:
    """Counts serving calls; ``request_exit`` exits once none is in flight.

    ``exit_fn(code)`` ends the process (``os._exit``); ``call_later(delay, fn, *args)``
    schedules it (the running loop's); both are injectable for tests.
    """

    def __init__(self, code: int, exit_fn: Callable[[int], object] = os._exit,
                 call_later: Callable | None = None, flush_s: float = FLUSH_S,
                 max_wait_s: float = MAX_WAIT_S) -> None:
        self.code, self.flush_s, self.max_wait_s = code, flush_s, max_wait_s
        self._exit_fn, self._call_later = exit_fn, call_later
        self.in_flight = 0              # serving calls that have not returned
        self.reason: str | None = None  # set once an exit was asked for
        self._scheduled = False

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.reason is not None and self.in_flight == 0:
            self._schedule()

    def request_exit(self, reason: str) -> None:
        """Exit (``code``) once no call is in flight, ``flush_s`` after the last one."""
        if self.reason is None:
            self.reason = reason
            log.critical("%s; exiting once %d call(s) in flight have answered", reason,
                         self.in_flight)
            self._later()(self.max_wait_s, self._exit_fn, self.code)
        if self.in_flight == 0:
            self._schedule()

    def _later(self) -> Callable:
        if self._call_later is not None:
            return self._call_later
        try:
            return asyncio.get_running_loop().call_later
        except RuntimeError:         # a generator finalized off the loop: a timer thread
            return _thread_later

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._later()(self.flush_s, self._exit_fn, self.code)


def _thread_later(delay: float, fn: Callable, *args) -> None:
    timer = threading.Timer(delay, fn, args)
    timer.daemon = True
    timer.start()


def serving(method):
    """Count an ``EngineWorker`` method (coroutine or async generator) in ``self.gate``."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def gen(self, *args, **kwargs):
            self.gate.enter()
            try:
                async for out in method(self, *args, **kwargs):
                    yield out
            finally:
                self.gate.leave()
        return gen

    @functools.wraps(method)
    async def call(self, *args, **kwargs):
        self.gate.enter()
        try:
            return await method(self, *args, **kwargs)
        finally:
            self.gate.leave()
    return call
