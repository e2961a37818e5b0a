"""Local tensor-parallel ranks share the machine's cores instead of each taking all of them."""

from __future__ import annotations

from nibble.services.parallel.launch import threads_per_rank


def test_ranks_split_the_cores():
    assert threads_per_rank(2, 16, {}) == 8
    assert threads_per_rank(4, 16, {}) == 4
    assert threads_per_rank(4, 2, {}) == 1          # never zero
    assert threads_per_rank(1, 16, {}) == 16


def test_an_explicit_thread_count_wins():
    assert threads_per_rank(2, 16, {"OMP_NUM_THREADS": "3"}) is None
    assert threads_per_rank(2, 16, {"OMP_NUM_THREADS": ""}) == 8
