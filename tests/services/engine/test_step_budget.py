"""The cost-weighted step budget: chunk costs, the defaults per device, the scheduler's chunks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nibble.services.config import SchedulerConfig
from nibble.services.engine.step_budget import (attention_cost_context, chunk_cost, max_chunk,
                                                resolve_scheduler)

from .test_scheduler import make, run, seq

QWEN3_8B = SimpleNamespace(hidden_size=4096, intermediate_size=12288, num_heads=32,
                           num_kv_heads=8, head_dim=128)


def test_cost_context_of_an_8b_model():
    # 193M multiply-adds per token and layer against 8192 per key, at half the rate.
    assert attention_cost_context(QWEN3_8B) == 11776


@pytest.mark.parametrize("budget,cached,ctx", [(5120, 0, 11776), (5120, 30000, 11776),
                                               (4096, 16384, 2000), (17, 9, 5), (1, 0, 7)])
def test_max_chunk_is_the_largest_that_fits(budget, cached, ctx):
    n = max_chunk(budget, cached, ctx)
    assert n >= 1
    assert n == 1 or chunk_cost(n, cached, ctx) <= budget
    assert chunk_cost(n + 1, cached, ctx) > budget


def test_costs_without_a_context_are_token_counts():
    assert chunk_cost(300, 10_000, 0) == 300 and max_chunk(300, 10_000, 0) == 300
    assert chunk_cost(1, 10_000, 50) == 1.0          # a decode counts one token


def test_off_by_default_and_minus_one_reads_the_model():
    assert SchedulerConfig().chunk_cost_context == 0
    assert resolve_scheduler(SchedulerConfig(), QWEN3_8B).chunk_cost_context == 0
    auto = resolve_scheduler(SchedulerConfig(chunk_cost_context=-1), QWEN3_8B)
    assert auto.chunk_cost_context == 11776
    mine = resolve_scheduler(SchedulerConfig(chunk_cost_context=5000), QWEN3_8B)
    assert mine.chunk_cost_context == 5000


def test_chunks_of_a_long_prompt_shrink_as_its_prefix_grows():
    """With the budget cost-weighted every step costs about the same, so chunks shrink."""
    sch = make(num_pages=64, page_size=4, chunked_prefill_size=64, max_prefill_tokens=16,
               chunk_cost_context=16)
    a = seq("a", 60)
    sch.add(a)
    sizes = []
    while a.num_computed < 60:
        batch = sch.schedule()
        (e,) = batch.seqs
        assert chunk_cost(len(e.token_ids), e.start_pos, 16) <= 16 or len(e.token_ids) == 1
        sizes.append(len(e.token_ids))
        run(batch, [a])
    assert sizes[0] == max_chunk(16, 0, 16) == 11
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0] // 2


def test_a_decode_counts_one_token_beside_a_weighted_chunk():
    sch = make(num_pages=64, chunked_prefill_size=64, max_prefill_tokens=16, chunk_cost_context=8)
    a, b = seq("a", 3), seq("b", 40)
    sch.add(a)
    run(sch.schedule(), [a])                          # a decodes from now on
    sch.add(b)
    batch = sch.schedule()
    assert [(e.request_id, len(e.token_ids)) for e in batch.seqs] == \
        [("a", 1), ("b", max_chunk(15, 0, 8))]


def test_the_budget_leftover_does_not_start_prompts_in_slivers():
    """With costs the leftover of a step is fractional: a second prompt starts only with a
    chunk of at least min_chunk tokens, the first prompt of a step always makes progress."""
    sch = make(num_pages=64, page_size=4, chunked_prefill_size=64, max_prefill_tokens=40,
               chunk_cost_context=32)
    assert sch.min_chunk == 8
    a, b, c = seq("a", 60), seq("b", 60), seq("c", 60)
    for s in (a, b, c):
        sch.add(s)
    batch = sch.schedule()
    first = max_chunk(40, 0, 32)
    assert [(e.request_id, len(e.token_ids)) for e in batch.seqs] == [("a", first)]
    left = 40 - chunk_cost(first, 0, 32)
    assert 0 < left and max_chunk(left, 0, 32) < 8
    run(batch, [a])
    # a's next chunk is dearer (its prefix grew); b starts only if 8+ tokens still fit.
    batch = sch.schedule()
    sizes = {e.request_id: len(e.token_ids) for e in batch.seqs}
    assert sizes["a"] == max_chunk(40, first, 32)
    assert all(n >= 8 for rid, n in sizes.items() if rid != "a")
    assert "c" not in sizes


def test_a_huge_prefix_still_makes_progress():
    sch = make(num_pages=80, page_size=4, chunked_prefill_size=64, max_prefill_tokens=16,
               chunk_cost_context=4)
    a = seq("a", 300)
    sch.add(a)
    while a.num_computed < 300:
        batch = sch.schedule()
        assert batch.seqs, "a step must schedule the only prompt"
        run(batch, [a])
