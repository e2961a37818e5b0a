"""Scheduler: chunking, budgets, admission and preemption with exact page ids."""

from nibble.kernels import PageLayout
from nibble.services.config import SchedulerConfig
from nibble.services.engine.scheduler import Scheduler
from nibble.services.engine.sequence import Sequence, SeqStatus
from nibble.services.engine.types import GenerateRequest, SamplingParams
from nibble.tiering import KVPool
from nibble.tiering.kv_cache_manager import KVCacheManager


def make(num_pages=8, page_size=4, **kw):
    layout = PageLayout("bf16", num_layers=1, num_kv_heads=1, head_dim=16, page_size=page_size)
    cfg = SchedulerConfig(**{"max_running_requests": 4, "chunked_prefill_size": 8,
                             "max_prefill_tokens": 16, **kw})
    return Scheduler(cfg, KVCacheManager(KVPool(layout, num_pages)))


def seq(rid, n, max_tokens=4):
    req = GenerateRequest(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))
    return Sequence(req, list(req.prompt_token_ids), n)


def run(batch, seqs, sampled=7):
    """Apply a step as the engine would: advance and append a token when sampled."""
    by_id = {s.request_id: s for s in seqs}
    for e in batch.seqs:
        s = by_id[e.request_id]
        s.num_computed += len(e.token_ids)
        if e.sample:
            s.token_ids.append(sampled)


def test_chunked_prefill_then_decode_with_exact_pages():
    sch = make()
    a = seq("a", 10)
    sch.add(a)
    b1 = sch.schedule()
    (e,) = b1.seqs
    assert (e.token_ids, e.start_pos, e.block_table, e.sample) == (list(range(1, 9)), 0, [0, 1], False)
    run(b1, [a])
    (e,) = sch.schedule().seqs
    assert (e.token_ids, e.start_pos, e.num_cached, e.block_table, e.sample) == ([9, 10], 8, 8, [0, 1, 2], True)
    a.num_computed += 2
    a.token_ids.append(7)
    (e,) = sch.schedule().seqs                       # decode of the sampled token
    assert (e.token_ids, e.start_pos, e.block_table, e.sample) == ([7], 10, [0, 1, 2], True)


def test_budget_and_decode_first():
    sch = make(max_prefill_tokens=10)
    a, b = seq("a", 3), seq("b", 12)
    sch.add(a)
    run(sch.schedule(), [a])                          # a prefilled, now decoding
    sch.add(b)
    batch = sch.schedule()
    assert [(e.request_id, len(e.token_ids)) for e in batch.seqs] == [("a", 1), ("b", 8)]
    assert batch.seqs[1].block_table == [1, 2]


def test_admission_waits_for_pages_and_max_running():
    sch = make(num_pages=3, max_running_requests=1)
    a, b = seq("a", 8), seq("b", 4)
    sch.add(a)
    sch.add(b)
    batch = sch.schedule()
    assert [e.request_id for e in batch.seqs] == ["a"]   # max_running_requests=1
    assert b.status is SeqStatus.WAITING and list(sch.waiting) == [b]


def test_preemption_frees_newest_and_recomputes():
    sch = make(num_pages=4, page_size=4, schedule_conservativeness=0.0)
    a, b = seq("a", 8), seq("b", 8)
    sch.add(a)
    sch.add(b)
    batch = sch.schedule()                            # a: pages 0,1; b: pages 2,3
    assert [e.block_table for e in batch.seqs] == [[0, 1], [2, 3]]
    run(batch, [a, b])
    batch = sch.schedule()                            # a needs page 4 -> b preempted
    assert [e.request_id for e in batch.seqs] == ["a"]
    assert batch.seqs[0].block_table == [0, 1, 3]     # b's pages freed tail-first: 3, 2
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and b.pages == []
    assert b.num_preemptions == 1 and sch.kv.num_free == 1
    sch.remove(a)
    assert sch.kv.num_free == 4
    batch = sch.schedule()                            # b recomputed: prompt + its sampled token
    assert batch.seqs[0].token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
