"""PageAllocator: exact page ids through allocate, free, incref."""

import pytest

from nibble.tiering import PageAllocator, PageAllocError


def test_allocates_lowest_ids_first():
    a = PageAllocator(6)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(3) == [2, 3, 4]
    assert a.num_free == 1 and a.num_used == 5
    assert a.free_list() == [5]


def test_freed_pages_go_to_tail_in_given_order():
    a = PageAllocator(5)
    first = a.allocate(3)            # [0, 1, 2]; free list [3, 4]
    a.free(list(reversed(first)))    # tail-first, as sequences free
    assert a.free_list() == [3, 4, 2, 1, 0]
    assert a.allocate(4) == [3, 4, 2, 1]


def test_refcounts_keep_shared_pages():
    a = PageAllocator(4)
    p = a.allocate(2)
    a.incref([p[0]])
    assert a.refcount(p[0]) == 2
    a.free(p)
    assert a.refcount(p[0]) == 1 and a.refcount(p[1]) == 0
    assert a.free_list() == [2, 3, 1]
    a.free([p[0]])
    assert a.free_list() == [2, 3, 1, 0]


def test_incref_takes_a_free_page_from_the_middle():
    a = PageAllocator(5)
    a.free(a.allocate(5))            # free list [0..4]
    a.incref([2])
    assert a.free_list() == [0, 1, 3, 4]
    assert a.refcount(2) == 1
    assert a.allocate(4) == [0, 1, 3, 4]
    with pytest.raises(PageAllocError):
        a.allocate(1)


def test_errors_leave_state_unchanged():
    a = PageAllocator(3)
    a.allocate(2)
    with pytest.raises(PageAllocError):
        a.allocate(2)
    assert a.num_free == 1 and a.free_list() == [2]
    with pytest.raises(PageAllocError):
        a.free([2])                  # never allocated
    with pytest.raises(PageAllocError):
        a.free([7])
    with pytest.raises(PageAllocError):
        PageAllocator(0)


def test_large_pool_is_constant_time_per_op():
    a = PageAllocator(200_000)
    pages = a.allocate(100_000)
    a.free(pages[::-1])
    a.incref([150_000, 3])           # middle removals
    assert a.num_free == 199_998


def _churned(n: int = 12) -> PageAllocator:
    """Free list [8, 9, 10, 11, 7, 6, 5, 4, 3, 2, 1, 0]: a sequence freed tail-first."""
    a = PageAllocator(n)
    a.free(list(reversed(a.allocate(n - 4))))
    return a


def test_allocate_runs_with_slack_1_takes_the_same_pages_sorted():
    a, b = _churned(), _churned()
    assert b.allocate(6) == [8, 9, 10, 11, 7, 6]
    assert a.allocate_runs(6) == [6, 7, 8, 9, 10, 11]
    assert a.free_list() == b.free_list() == [5, 4, 3, 2, 1, 0]
    a.check_integrity()


def test_allocate_runs_prefers_long_runs_in_the_lru_window():
    a = PageAllocator(12)
    held = a.allocate(12)
    a.free([held[i] for i in (0, 2, 4, 6, 8, 9, 10, 11, 3, 5)])   # holes at 1 and 7
    # Window of 8 (slack 2): [0, 2, 4, 6, 8, 9, 10, 11] -> run 8..11 first, then the oldest.
    assert a.allocate_runs(4, slack=2.0) == [8, 9, 10, 11]
    assert a.free_list() == [0, 2, 4, 6, 3, 5]                  # the rest keeps its order
    assert a.allocate_runs(3, slack=2.0) == [2, 3, 4]            # 2..6 has 5 free: cut to 3
    assert a.free_list() == [0, 6, 5]
    a.check_integrity()


def test_allocate_runs_on_a_fresh_list_is_one_run_and_errors_take_nothing():
    a = PageAllocator(8)
    assert a.allocate_runs(5, slack=4.0) == [0, 1, 2, 3, 4]
    with pytest.raises(PageAllocError):
        a.allocate_runs(4)
    with pytest.raises(PageAllocError):
        a.allocate_runs(1, slack=0.5)
    assert a.free_list() == [5, 6, 7]
    a.check_integrity()
