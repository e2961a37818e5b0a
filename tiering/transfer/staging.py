"""Pinned host buffers reused in turn, so device <-> host copies of a page stream overlap
the rest of the transfer (the gRPC transport's staging for device pools).

A sender copies chunk ``k + 1`` off the device while chunk ``k`` is serialized and sent;
a receiver starts the device copy of chunk ``k`` and goes on reading chunk ``k + 1``.
Each slot remembers the CUDA event recorded after the copy that used it last, and is
handed out again only once that copy is done, so a buffer is never overwritten while the
device still reads it (or read before the device has written it).
"""

from __future__ import annotations

import torch


class PinnedRing:
    """``slots`` pinned uint8 buffers of at least ``nbytes`` for copies with ``device``."""

    def __init__(self, device: torch.device, nbytes: int, slots: int = 3):
        if slots < 2:
            raise ValueError("a ring needs at least two slots to overlap anything")
        self.device = device
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                     for _ in range(slots)]
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next slot (its index and its first ``nbytes`` bytes), once the last copy
        that used it has finished."""
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()
            self.events[i] = None
        if self.bufs[i].numel() < nbytes:
            self.bufs[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return i, self.bufs[i][:nbytes]

    def copied(self, i: int) -> torch.cuda.Event:
        """Record that the copies just issued on ``device``'s current stream use slot ``i``."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.events[i] = ev
        return ev

    def drain(self) -> None:
        """Wait for every copy still using a slot."""
        for i, ev in enumerate(self.events):
            if ev is not None:
                ev.synchronize()
                self.events[i] = None
