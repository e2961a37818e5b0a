"""Request preparation (chat template, tokenization) off the asyncio event loop.

Tokenizing a multi-megabyte prompt takes seconds; done in the async handler it
froze ``/health`` and every open stream for as long. ``Preparer.run`` hands the
whole ``prepare_*`` call (validation, template, tokenization, context check) to
a small bounded thread pool, so the loop keeps serving while it runs. It helps
because the tokenizer releases the GIL for long texts (services/models/tokenizer.py
encodes them through ``encode_batch``, which runs in Rust without the GIL).

One Preparer serves the HTTP gateway and the gRPC API alike (``app.state.preparer``,
handed to ``GrpcServer``), so the pool bounds preparation work across both.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Preparation is CPU-bound: more threads than cores only adds contention.
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))


class Preparer:
    """Runs synchronous preparation functions on ``workers`` threads (at most that many
    at once; further calls wait in the pool's queue without holding the event loop)."""

    def __init__(self, workers: int = DEFAULT_WORKERS):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        # Created on first use: an app built in a test and never called starts no thread.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="nibble-prepare")
        return self._pool

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a pool thread; its exception, if any, is raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor(), functools.partial(fn, *args))

    def close(self) -> None:
        """Stop the threads; queued calls are cancelled, running ones finish on their own."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
