"""Host-side pauses inside engine steps: Python's garbage collector and the device allocator.

A step that takes 80 ms longer than its shape explains was either waiting on the collector
(a full collection walks every tracked object) or on the CUDA caching allocator (a new
segment is a ``cudaMalloc``; near the memory limit the allocator frees its cache and
retries). :class:`PauseMeter` counts both between two :meth:`PauseMeter.take` calls, so the
step trace (``--step-trace-file``) can put them beside each step's interval.

:func:`freeze_startup_objects` moves what the server built at start (model, tokenizer,
registries) out of the collector's reach, as vLLM and SGLang do after start-up: full
collections then walk only what requests create. :func:`thaw_startup_objects` gives them
back at shutdown.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable

log = logging.getLogger(__name__)

AllocStats = Callable[[], dict]


def cuda_alloc_stats(device) -> AllocStats | None:
    """``device``'s caching-allocator counters as a callable, or None off CUDA."""
    import torch

    if getattr(device, "type", str(device)).split(":")[0] != "cuda" \
            or not torch.cuda.is_available():
        return None
    return lambda: torch.cuda.memory_stats(device)


class PauseMeter:
    """GC pauses (``gc.callbacks``) and allocator segment/retry counts since the last take.

    ``clock``: seconds, monotonic (injected by tests). ``alloc_stats``: returns the
    allocator's cumulative counters (``torch.cuda.memory_stats`` keys
    ``num_device_alloc`` and ``num_alloc_retries``), or None for no device allocator.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 alloc_stats: AllocStats | None = None):
        self.clock = clock
        self.alloc_stats = alloc_stats
        self._gc_start: float | None = None
        self._gc_s = 0.0
        self._gc_runs = 0
        self._gc_full = 0
        self._alloc = self._alloc_counts()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = self.clock()
            return
        if self._gc_start is None:      # attached while a collection ran
            return
        self._gc_s += self.clock() - self._gc_start
        self._gc_start = None
        self._gc_runs += 1
        self._gc_full += int(info.get("generation") == 2)

    def _alloc_counts(self) -> tuple[int, int]:
        if self.alloc_stats is None:
            return 0, 0
        s = self.alloc_stats()
        return int(s.get("num_device_alloc", 0)), int(s.get("num_alloc_retries", 0))

    def take(self) -> dict[str, float | int]:
        """Since the previous take: ``gc_ms``, ``gc_runs``, ``gc_full`` (generation-2
        collections), ``device_mallocs`` (new allocator segments) and ``alloc_retries``."""
        mallocs, retries = self._alloc_counts()
        out = {"gc_ms": round(self._gc_s * 1e3, 3), "gc_runs": self._gc_runs,
               "gc_full": self._gc_full, "device_mallocs": mallocs - self._alloc[0],
               "alloc_retries": retries - self._alloc[1]}
        self._alloc = (mallocs, retries)
        self._gc_s, self._gc_runs, self._gc_full = 0.0, 0, 0
        return out

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def freeze_startup_objects() -> int:
    """Collect once, then move every surviving object to the permanent generation; returns
    how many objects were frozen."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("garbage collector: %d start-up objects frozen", n)
    return n


def thaw_startup_objects() -> None:
    """Give the frozen objects back to the collector (at shutdown, after the engine stopped).

    The interpreter's finalization never frees the permanent generation, so objects of C
    extensions frozen there outlive it, and nanobind (Triton's bindings) prints a page of
    "leaked instance" warnings on every exit of the server."""
    gc.unfreeze()
