"""L2: a host-memory page pool indexed by content key, LRU-evicted, thread-safe.

Slots have the same byte layout as L1 pages (``[num_layers, layer_nbytes]``
uint8), so moving a page between L1 and L2 is one copy. Pinned memory is used
when the device pool is on CUDA so that copies can overlap compute.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from nibble.kernels import PageLayout

from .errors import CacheArgumentError

# Called with (key, slot) just before an LRU slot is reused; may read the slot.
EvictHook = Callable[[bytes, int], None]


class HostPool:
    """``num_pages`` host slots; ``key -> slot`` with LRU order and pin counts."""

    def __init__(self, layout: PageLayout, num_pages: int, pin_memory: bool = False):
        if num_pages <= 0:
            raise CacheArgumentError(f"host pool needs > 0 pages, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.data = layout.allocate(num_pages, "cpu", pin_memory=pin_memory)
        self._lru: OrderedDict[bytes, int] = OrderedDict()   # key -> slot, oldest first
        self._free = list(range(num_pages - 1, -1, -1))
        self._pins: dict[bytes, int] = {}
        self._pending: set[bytes] = set()                    # reserved, bytes not yet written
        self.lock = threading.RLock()
        self.on_evict: EvictHook | None = None
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        """True when ``key``'s bytes are complete in L2."""
        with self.lock:
            return key in self._lru and key not in self._pending

    def __len__(self) -> int:
        with self.lock:
            return len(self._lru)

    def keys(self) -> list[bytes]:
        """Keys whose bytes are complete, oldest first."""
        with self.lock:
            return [k for k in self._lru if k not in self._pending]

    def slot(self, key: bytes, touch: bool = True) -> int | None:
        with self.lock:
            s = None if key in self._pending else self._lru.get(key)
            if s is not None and touch:
                self._lru.move_to_end(key)
            return s

    def pin(self, keys: list[bytes]) -> None:
        """Protect keys from eviction while a load reads them."""
        with self.lock:
            for k in keys:
                self._pins[k] = self._pins.get(k, 0) + 1

    def unpin(self, keys: list[bytes]) -> None:
        with self.lock:
            for k in keys:
                n = self._pins.get(k, 0) - 1
                if n > 0:
                    self._pins[k] = n
                else:
                    self._pins.pop(k, None)

    def reserve(self, key: bytes) -> int | None:
        """A slot to write ``key`` into (free, or the LRU unpinned one), marked pending until
        :meth:`commit`; None if ``key`` is already present or pending, or every slot is pinned."""
        with self.lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return None
            if self._free:
                s = self._free.pop()
            else:
                victim = next((k for k in self._lru
                               if k not in self._pins and k not in self._pending), None)
                if victim is None:
                    return None
                s = self._lru[victim]
                if self.on_evict is not None:
                    self.on_evict(victim, s)
                del self._lru[victim]
                self.evictions += 1
            self._lru[key] = s
            self._pending.add(key)
            return s

    def commit(self, key: bytes) -> None:
        """The bytes of a reserved key are complete; readers may use it."""
        with self.lock:
            self._pending.discard(key)

    def drop(self, key: bytes) -> None:
        """Forget ``key`` (e.g. its bytes failed to arrive)."""
        with self.lock:
            s = self._lru.pop(key, None)
            self._pending.discard(key)
            if s is not None:
                self._free.append(s)

    def clear(self) -> None:
        with self.lock:
            self._lru.clear()
            self._pins.clear()
            self._pending.clear()
            self._free = list(range(self.num_pages - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.layout.page_nbytes
