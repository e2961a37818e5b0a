"""Tensor-parallel disaggregation, the per-rank transfer path (services/disagg/rank_transfer.py).

A prefill group and a decode group of two ranks each, with real gRPC transports on
loopback: rank r's pool holds its own KV heads (rank 0 one head, rank 1 two: pages of
different sizes, as SmolLM2's 3 KV heads over 2 ranks), page ids are shared by the ranks
of a group. The followers are driven through ``InlineGroup``, which hands rank 0's
broadcasts straight to the follower's ``FollowerTransfers`` (what ``follower.follow`` does
over gloo), so the whole protocol runs in one process.
"""

from __future__ import annotations

import pytest
import torch

from nibble.services.disagg.rank_transfer import (FollowerTransfers, RankTransfers,
                                                  group_checksum)
from nibble.services.disagg.transfer_state import TransferError
from nibble.services.parallel.group import TPGroup
from nibble.tiering.transfer import checksum_tag, create_transport, page_set_checksum

KEY = b"k" * 32
PAGES, LAYERS = 12, 3
ROW_BYTES = (96, 192)            # bytes per layer of a page: rank 0 one KV head, rank 1 two


class InlineGroup(TPGroup):
    """Rank 0 of two; rank 1 is ``follower``, answering in the same thread."""

    size = 2

    def __init__(self, follower: FollowerTransfers):
        self.follower, self._msg = follower, None

    def broadcast_object(self, obj=None):
        self._msg = obj
        return obj

    def gather_object(self, obj=None):
        assert self._msg[0] == "kv"
        return [obj, self.follower.handle(*self._msg[1:])]


def _transport(pool: torch.Tensor):
    t = create_transport("grpc", secret=KEY, address="127.0.0.1:0", loopback_only=True)
    t.attach(pool)
    return t


@pytest.fixture
def groups():
    gen = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 256, (PAGES, LAYERS, b), dtype=torch.uint8, generator=gen)
           for b in ROW_BYTES]
    dst = [torch.zeros(PAGES, LAYERS, b, dtype=torch.uint8) for b in ROW_BYTES]
    ts = [_transport(p) for p in (*src, *dst)]
    prefill = RankTransfers(InlineGroup(FollowerTransfers(ts[1], 1)), src[0])
    decode = RankTransfers(InlineGroup(FollowerTransfers(ts[3], 1)), dst[0])
    yield src, dst, ts, prefill, decode
    for t in ts:
        t.close()


def _transfer(ts, prefill, decode, src_pages, dst_pages):
    """The worker's flow: decode rank 0's ticket and the followers', every rank pair's
    write, the group checksum signed for rank 0's ticket. Returns (ticket, checksum)."""
    ticket = ts[2].issue_ticket("req", dst_pages, 30.0)
    peers = decode.expect("req", dst_pages, 30.0)
    mine = page_set_checksum(ts[0].pool, src_pages)
    st = ts[0].wait(ts[0].write_pages(ts[2].endpoint(), ticket, src_pages, checksum=mine))
    assert st.state == "success", st.error
    theirs = prefill.send("req", peers, src_pages)
    return ticket, peers, group_checksum([mine, *theirs])


def test_every_rank_gets_its_own_pages_bit_identical(groups):
    src, dst, ts, prefill, decode = groups
    src_pages, dst_pages = [7, 2, 9], [0, 5, 11]
    ticket, peers, checksum = _transfer(ts, prefill, decode, src_pages, dst_pages)
    for r in range(2):                               # each rank's bytes, to the same rank
        assert torch.equal(dst[r][dst_pages], src[r][src_pages])
        untouched = [p for p in range(PAGES) if p not in dst_pages]
        assert not dst[r][untouched].any()
    # the bytes moved are each rank's pages: rank 1's are twice rank 0's here
    assert ticket.nbytes == 3 * LAYERS * ROW_BYTES[0]
    assert [t.nbytes for t, _ in peers] == [3 * LAYERS * ROW_BYTES[1]]
    assert decode.checksum("req", dst_pages) == checksum
    assert checksum != page_set_checksum(src[0], src_pages)     # covers more than rank 0
    assert checksum_tag(KEY, ticket, checksum)
    decode.close("req", consumed=True)
    assert not ts[3].book.is_open(peers[0][0].ticket_id)


def test_a_follower_page_that_differs_fails_the_group_checksum(groups):
    src, dst, ts, prefill, decode = groups
    _, _, checksum = _transfer(ts, prefill, decode, [1, 2], [3, 4])
    dst[1][4, 2, 17] ^= 1                            # one bit on decode rank 1 only
    assert decode.checksum("req", [3, 4]) != checksum


def test_a_follower_that_cannot_write_fails_the_transfer_by_rank(groups):
    src, dst, ts, prefill, decode = groups
    rank0_ticket = ts[2].issue_ticket("req", [0, 1], 30.0)
    # rank 0's ticket and endpoint handed to rank 1: page sizes differ, the write is refused
    with pytest.raises(TransferError, match="rank 1: .*page sizes differ"):
        prefill.send("req", [(rank0_ticket, ts[2].endpoint())], [0, 1])
    with pytest.raises(TransferError, match="1 followers"):
        prefill.send("req", [], [0, 1])


def test_a_revoked_follower_ticket_refuses_late_writes(groups):
    src, dst, ts, prefill, decode = groups
    peers = decode.expect("req", [0, 1], 30.0)
    decode.close("req", consumed=False)              # the reservation was released
    with pytest.raises(TransferError, match="rank 1: .*transfer failed"):
        prefill.send("req", peers, [2, 3])
    assert not dst[1].any()


def test_one_rank_keeps_its_own_checksum():
    assert group_checksum(["ab"]) == "ab"
    assert group_checksum(["ab", "cd"]) != group_checksum(["cd", "ab"])


class ScriptedGroup(TPGroup):
    """A follower's view: rank 0's broadcasts come from ``script``; gathers are recorded."""

    rank, size = 1, 2

    def __init__(self, script):
        self.script, self.sent = list(script), []

    def broadcast_object(self, obj=None):
        return self.script.pop(0)

    def gather_object(self, obj=None):
        self.sent.append(obj)


def test_the_follower_loop_answers_every_kv_op_even_without_a_transport():
    from nibble.services.parallel.follower import follow
    g = ScriptedGroup([("kv", "checksum", "req", [0]), ("stop",)])
    follow(runner=None, tp=g, mirror=None, kv=None)
    assert g.sent == [("err", "rank 1 has no KV transport")]     # rank 0 is never left waiting
    pool = torch.arange(2 * 8, dtype=torch.int64).to(torch.uint8).reshape(2, 1, 8)
    t = _transport(pool)
    try:
        g = ScriptedGroup([("kv", "checksum", "req", [1]), ("kv", "nope"), ("stop",)])
        follow(runner=None, tp=g, mirror=None, kv=FollowerTransfers(t, 1))
    finally:
        t.close()
    assert g.sent[0] == ("ok", page_set_checksum(pool, [1]))
    assert g.sent[1][0] == "err"
