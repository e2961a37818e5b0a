"""Page allocator: typed page ids, reference counts and an O(1) free list.

The free list is a doubly linked list over page ids (arrays, no Python
objects per page) so that a page can be taken from the head, returned to the
tail, or removed from the middle in O(1). Freed pages go to the tail, so the
head is always the least recently freed page; the prefix cache relies on this
order for LRU eviction.

``allocate_runs`` takes pages as few ascending runs of consecutive ids (a page
transfer moves a run as one copy or descriptor, see ``page_runs``). It only
looks at a window of the least recently freed pages and unlinks its choice
from the middle of the list, so the rest keeps its order and the head stays
the least recently freed page.
"""

from __future__ import annotations

import math
from typing import Iterable, NewType

from nibble.kernels.errors import FatalError

from .errors import CacheIntegrityError
from .page_runs import contiguous_runs

PageId = NewType("PageId", int)
_NIL = -1


class PageAllocError(FatalError):
    """Invalid allocator use (double free, unknown page) or too few free pages."""


class PageAllocator:
    """Allocates page ids ``0 .. num_pages-1``.

    Invariants: a page is either on the free list with refcount 0, or off it
    with refcount >= 1.
    """

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise PageAllocError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._ref = [0] * num_pages
        self._prev = [i - 1 for i in range(num_pages)]
        self._next = [i + 1 for i in range(num_pages)]
        self._next[-1] = _NIL
        self._head, self._tail = 0, num_pages - 1
        self._in_free = [True] * num_pages
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def refcount(self, page: PageId) -> int:
        return self._ref[self._check(page)]

    def _check(self, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise PageAllocError(f"page id {page} out of range [0, {self.num_pages})")
        return page

    def _unlink(self, page: int) -> None:
        p, n = self._prev[page], self._next[page]
        if p == _NIL:
            self._head = n
        else:
            self._next[p] = n
        if n == _NIL:
            self._tail = p
        else:
            self._prev[n] = p
        self._prev[page] = self._next[page] = _NIL
        self._in_free[page] = False
        self._num_free -= 1

    def _append(self, page: int) -> None:
        self._prev[page], self._next[page] = self._tail, _NIL
        if self._tail == _NIL:
            self._head = page
        else:
            self._next[self._tail] = page
        self._tail = page
        self._in_free[page] = True
        self._num_free += 1

    def allocate(self, n: int) -> list[PageId]:
        """Take ``n`` pages from the head of the free list, refcount 1 each.

        Raises PageAllocError (nothing taken) when fewer than ``n`` are free.
        """
        if n > self._num_free:
            raise PageAllocError(f"asked for {n} pages, {self._num_free} free")
        out = []
        for _ in range(n):
            page = self._head
            self._unlink(page)
            self._ref[page] = 1
            out.append(PageId(page))
        return out

    def allocate_runs(self, n: int, slack: float = 1.0) -> list[PageId]:
        """Take ``n`` pages, refcount 1 each, as few runs of consecutive ids as the free
        list allows; returned in ascending order.

        Only the window of the ``max(n, ceil(n * slack))`` least recently freed
        pages is considered; in it, the longest runs are taken first (equal
        lengths: the one holding the older page), the last one cut to fit.
        ``slack`` 1 takes exactly the pages ``allocate(n)`` would (eviction
        order unchanged), only sorted; a larger one lets a page up to that far
        down the LRU order go first, for longer runs. Raises PageAllocError
        (nothing taken) when fewer than ``n`` are free.
        """
        if n > self._num_free:
            raise PageAllocError(f"asked for {n} pages, {self._num_free} free")
        if slack < 1:
            raise PageAllocError(f"slack must be >= 1, got {slack}")
        window, age, page = min(self._num_free, max(n, math.ceil(n * slack))), {}, self._head
        while len(age) < window:
            age[page] = len(age)
            page = self._next[page]
        runs = contiguous_runs(sorted(age))
        runs.sort(key=lambda r: (-r[1], min(age[p] for p in range(r[0], r[0] + r[1]))))
        out, left = [], n
        for start, length in runs:
            if not left:
                break
            take = min(length, left)
            out.extend(range(start, start + take))
            left -= take
        out.sort()
        for page in out:
            self._unlink(page)
            self._ref[page] = 1
        return [PageId(p) for p in out]

    def incref(self, pages: Iterable[PageId]) -> None:
        """Add a reference; a free page is taken off the free list (a cache hit)."""
        for page in pages:
            self._check(page)
            if self._in_free[page]:
                self._unlink(page)
            self._ref[page] += 1

    def free(self, pages: Iterable[PageId]) -> None:
        """Drop one reference each; pages reaching 0 return to the free-list tail.

        Pages are returned in the given order, so freeing a sequence's pages
        tail-first keeps its prefix longest in the cache.
        """
        for page in pages:
            self._check(page)
            if self._ref[page] <= 0:
                raise PageAllocError(f"double free of page {page}")
            self._ref[page] -= 1
            if self._ref[page] == 0:
                self._append(page)

    def check_integrity(self) -> None:
        """Raise CacheIntegrityError unless the free list, the free flags, the free
        count and the refcounts agree: every page is either on the list with
        refcount 0 or off it with refcount >= 1, and the list's links run both
        ways. O(num_pages); for debug mode and tests."""
        problems, seen, prev, page = [], 0, _NIL, self._head
        while page != _NIL and seen <= self.num_pages:
            if self._prev[page] != prev:
                problems.append(f"page {page}: prev link {self._prev[page]} != {prev}")
            if not self._in_free[page] or self._ref[page] != 0:
                problems.append(f"page {page} on the free list with refcount {self._ref[page]}")
            prev, page, seen = page, self._next[page], seen + 1
        if prev != self._tail:
            problems.append(f"free list ends at {prev}, tail is {self._tail}")
        if seen != self._num_free or sum(self._in_free) != self._num_free:
            problems.append(f"free list holds {seen} pages, {sum(self._in_free)} flagged, "
                            f"{self._num_free} counted")
        problems += [f"page {p} is off the free list with refcount {r}"
                     for p, r in enumerate(self._ref) if not self._in_free[p] and r < 1]
        if problems:
            raise CacheIntegrityError("allocator: " + "; ".join(problems[:8]))

    def free_list(self) -> list[PageId]:
        """The free pages from head to tail (for tests and debugging; O(free))."""
        out, page = [], self._head
        while page != _NIL:
            out.append(PageId(page))
            page = self._next[page]
        return out
