"""page_runs: contiguous runs of page ids and the (src, dst) run merge, against a per-page
expansion (hypothesis)."""

import pytest
from hypothesis import given, strategies as st

from nibble.tiering.page_runs import contiguous_runs, merge_runs


def test_examples():
    assert contiguous_runs([4, 5, 6, 2, 9, 10]) == [(4, 3), (2, 1), (9, 2)]
    assert contiguous_runs([]) == []
    assert merge_runs([3, 4, 5, 9], [7, 8, 1, 2]) == [(3, 7, 2), (5, 1, 1), (9, 2, 1)]
    assert merge_runs(range(100), range(50, 150)) == [(0, 50, 100)]
    assert merge_runs([5, 4, 3], [1, 2, 3]) == [(5, 1, 1), (4, 2, 1), (3, 3, 1)]  # descending


def test_length_mismatch_is_refused():
    with pytest.raises(ValueError):
        merge_runs([1, 2], [3])


pairings = st.integers(0, 40).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 30), min_size=n, max_size=n),
    st.lists(st.integers(0, 30), min_size=n, max_size=n)))


@given(pairings)
def test_merge_expands_back_to_the_pairing_and_is_maximal(pair):
    src, dst = pair
    runs = merge_runs(src, dst)
    assert [(s + i, d + i) for s, d, n in runs for i in range(n)] == list(zip(src, dst))
    assert all(n >= 1 for _, _, n in runs)
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:]):
        assert not (s0 + n0 == s1 and d0 + n0 == d1)       # adjacent runs would have merged
    assert len(runs) >= max(len(contiguous_runs(src)), len(contiguous_runs(dst)))


@given(st.lists(st.integers(0, 30), max_size=40))
def test_contiguous_runs_expand_back(pages):
    runs = contiguous_runs(pages)
    assert [s + i for s, n in runs for i in range(n)] == pages
    assert all(s0 + n0 != s1 for (s0, n0), (s1, _) in zip(runs, runs[1:]))
