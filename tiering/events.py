"""KV events: what entered or left each tier, for a cache-aware router to mirror.

Each event is ``(seq, kind, tier, keys)`` where ``kind`` is "stored" or
"removed", ``tier`` is "l1" | "l2" | "l3" and ``keys`` are the pages' content
keys (hex; the namespace is part of every key). L3 evictions are not reported,
so a mirror of L3 is approximate. Events sit in a bounded ring; readers poll with the
last sequence number they saw and learn when they fell behind.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: str                 # "stored" | "removed"
    tier: str                 # "l1" | "l2" | "l3"
    keys: tuple[str, ...]     # content keys (hex) of the pages


class KVEventLog:
    def __init__(self, capacity: int = 10_000):
        self._ring: deque[KVEvent] = deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()

    def emit(self, kind: str, tier: str, keys: list[bytes]) -> None:
        if not keys:
            return
        with self._lock:
            self._seq += 1
            self._ring.append(KVEvent(self._seq, kind, tier, tuple(k.hex() for k in keys)))

    def since(self, seq: int, limit: int = 1000) -> tuple[list[KVEvent], bool]:
        """Events after ``seq`` (oldest first, at most ``limit``) and whether some were lost."""
        with self._lock:
            events = [e for e in self._ring if e.seq > seq][:limit]
            lost = bool(self._ring) and self._ring[0].seq > seq + 1
        return events, lost

    @property
    def last_seq(self) -> int:
        return self._seq
