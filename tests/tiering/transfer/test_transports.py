"""The same two-process tests against every transport (sender here, receiver spawned).

The receiver reserves pages and issues a signed ticket; the sender writes its
pages of real quantized KV into them. Checked: bit-identical arrival, no
other page touched, byte counts per format, and refusals (forged signature,
expired deadline, wrong checksum, dead receiver) that install nothing.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from nibble.tiering.transfer import (CompletedTransfer, RejectedTransfer, RejectReason,
                                     TransferState, create_transport, page_set_checksum, signing)
from nibble.tiering.page_runs import contiguous_runs, merge_runs
from nibble.tiering.transfer.grpc_wire import plan_chunks
from nibble.tiering.transfer.loopback import LoopbackPeer, PoolSpec

from .conftest import LAYOUTS, NUM_PAGES, SECRET, SENDER_OPTS

SRC, DST = [5, 2, 7], [9, 1, 4]  # non-contiguous, reordered


def _send(peer, senders, fmt, ticket, src=SRC, checksum=None):
    pool, tr = senders[fmt]
    return tr.wait(tr.write_pages(peer.endpoints[fmt], ticket, src, checksum=checksum))


@pytest.mark.parametrize("fmt", list(LAYOUTS))
def test_pages_arrive_bit_identical_into_the_reserved_pages(peer, senders, fmt):
    peer.call("zero", fmt)
    pool, _ = senders[fmt]
    want = page_set_checksum(pool.pages, SRC)
    ticket = peer.call("issue", fmt, "req-a", DST, 10.0)
    status = _send(peer, senders, fmt, ticket, checksum=want)
    assert status.state == TransferState.SUCCESS, status.error
    done = peer.call("wait", fmt, ticket.ticket_id, 10.0)
    assert isinstance(done, CompletedTransfer), done
    assert (done.dst_pages, done.request_id, done.checksum) == (tuple(DST), "req-a", want)
    assert peer.call("checksum", fmt, DST) == want
    assert peer.call("nonzero_pages", fmt) == sorted(DST)  # nothing else touched
    # Without a checksum in the message the pages still land intact.
    ticket = peer.call("issue", fmt, "req-b", [0, 11], 10.0)
    assert _send(peer, senders, fmt, ticket, src=[11, 0]).state == TransferState.SUCCESS
    assert isinstance(peer.call("wait", fmt, ticket.ticket_id, 10.0), CompletedTransfer)
    assert peer.call("checksum", fmt, [0, 11]) == page_set_checksum(pool.pages, [11, 0])


def _expected_descriptors(transport_name, src, dst, page_nbytes):
    """One per run on both sides (NIXL); one per (chunk, source run) segment (gRPC)."""
    if transport_name == "nixl":
        return len(merge_runs(src, dst))
    chunk = SENDER_OPTS["grpc"]["chunk_bytes"]
    return len([s for _, segs in plan_chunks(contiguous_runs(src), page_nbytes, chunk)
                for s in segs])


@pytest.mark.parametrize("src, dst, runs", [
    (list(range(6)), list(range(6, 12)), 1),             # fresh pools: one run
    ([2, 3, 4, 8, 9], [0, 1, 2, 6, 7], 2),                # two runs on both sides
    ([5, 2, 7], [9, 1, 4], 3),                           # fragmented: one per page
    ([3, 2, 1, 0], [4, 5, 6, 7], 4),                     # descending source: no merge
])
def test_runs_move_bit_identically_in_few_descriptors(peer, senders, transport_name, src, dst,
                                                      runs):
    fmt = "nvfp4"
    peer.call("zero", fmt)
    pool, tr = senders[fmt]
    assert len(merge_runs(src, dst)) == runs
    ticket = peer.call("issue", fmt, "req-runs", dst, 10.0)
    handle = tr.write_pages(peer.endpoints[fmt], ticket, src)
    assert tr.wait(handle).state == TransferState.SUCCESS
    assert isinstance(peer.call("wait", fmt, ticket.ticket_id, 10.0), CompletedTransfer)
    assert peer.call("checksum", fmt, dst) == page_set_checksum(pool.pages, src)
    assert peer.call("nonzero_pages", fmt) == sorted(dst)
    pn = pool.layout.page_nbytes
    assert handle.descriptors == _expected_descriptors(transport_name, src, dst, pn)
    if transport_name == "nixl":
        assert handle.descriptors == runs
    else:   # a chunk never holds more segments than source runs it touches
        chunk = SENDER_OPTS["grpc"]["chunk_bytes"]
        assert handle.descriptors <= -(-len(src) * pn // chunk) + len(contiguous_runs(src)) - 1


def test_nvfp4_moves_0_5625x_the_bytes_of_fp8_for_the_same_tokens(peer, senders):
    moved = {}
    for fmt, lay in LAYOUTS.items():
        peer.call("zero", fmt)
        pages = list(range(4))  # 4 pages = 64 tokens in both formats
        ticket = peer.call("issue", fmt, "req-ratio", pages, 10.0)
        status = _send(peer, senders, fmt, ticket, src=pages)
        done = peer.call("wait", fmt, ticket.ticket_id, 10.0)
        assert status.state == TransferState.SUCCESS and isinstance(done, CompletedTransfer)
        assert status.nbytes == done.nbytes == 4 * lay.page_nbytes
        moved[fmt] = done.nbytes
    assert moved["nvfp4"] / moved["fp8_e4m3"] == 0.5625


def test_forged_signature_is_rejected_and_nothing_installed(peer, senders, transport_name):
    fmt = "nvfp4"
    peer.call("zero", fmt)
    ticket = peer.call("issue", fmt, "req-forged", DST, 10.0)
    bad_key = b"not-the-shared-secret-at-all-000"
    forged = dataclasses.replace(ticket, signature=signing.sign(bad_key, ticket, "whoever"))
    status = _send(peer, senders, fmt, forged)
    event = peer.call("wait", fmt, ticket.ticket_id, 10.0)
    assert isinstance(event, RejectedTransfer) and event.reason == RejectReason.SIGNATURE
    assert peer.call("nonzero_pages", fmt) == []
    assert peer.call("events", fmt)[0] == []  # nothing received
    if transport_name == "grpc":
        # Refused before a byte landed: the sender sees it, the real ticket stays usable.
        assert status.state == TransferState.FAILED and "PERMISSION_DENIED" in status.error
        assert not event.ticket_closed
        assert _send(peer, senders, fmt, ticket).state == TransferState.SUCCESS
    else:
        # RDMA cannot be refused mid-flight: the receiver closes the ticket and zeroes its pages.
        assert event.ticket_closed and event.dst_pages == tuple(DST)


def test_expired_deadline_is_rejected_and_nothing_installed(peer, senders, transport_name):
    fmt = "fp8_e4m3"
    peer.call("zero", fmt)
    ticket = peer.call("issue", fmt, "req-late", DST, 0.2)
    time.sleep(max(0.0, ticket.deadline - time.time()) + 0.05)
    status = _send(peer, senders, fmt, ticket)
    event = peer.call("wait", fmt, ticket.ticket_id, 10.0)
    assert isinstance(event, RejectedTransfer), event
    assert event.reason == RejectReason.DEADLINE and event.ticket_closed
    assert peer.call("nonzero_pages", fmt) == []
    if transport_name == "grpc":
        assert status.state == TransferState.FAILED and "DEADLINE_EXCEEDED" in status.error


def test_wrong_checksum_is_rejected_and_the_pages_are_discarded(peer, senders, transport_name):
    fmt = "nvfp4"
    peer.call("zero", fmt)
    ticket = peer.call("issue", fmt, "req-sum", DST, 10.0)
    status = _send(peer, senders, fmt, ticket, checksum="0" * 64)
    event = peer.call("wait", fmt, ticket.ticket_id, 10.0)
    assert isinstance(event, RejectedTransfer) and event.reason == RejectReason.CHECKSUM
    assert event.ticket_closed and peer.call("nonzero_pages", fmt) == []
    if transport_name == "grpc":
        assert status.state == TransferState.FAILED and "DATA_LOSS" in status.error
    # The ticket is single use: a second write is refused.
    peer.call("zero", fmt)  # forget past events
    _send(peer, senders, fmt, ticket)
    again = peer.call("wait", fmt, ticket.ticket_id, 10.0)
    assert again.reason == RejectReason.REUSED and not again.ticket_closed


def test_a_frozen_or_dead_receiver_fails_the_transfer_in_bounded_time(senders, transport_name):
    fmt, lay = "nvfp4", LAYOUTS["nvfp4"]
    pool, tr = senders[fmt]
    quick = create_transport(transport_name, secret=SECRET, grace_s=0.3)
    quick.attach(pool.pages)
    fresh = None
    try:
        with LoopbackPeer({fmt: PoolSpec(transport_name, lay, NUM_PAGES)}, SECRET) as peer:
            ep = peer.endpoints[fmt]
            first, second = (peer.call("issue", fmt, f"req-{i}", DST, 30.0) for i in range(2))
            assert tr.wait(tr.write_pages(ep, first, SRC)).state == TransferState.SUCCESS
            # Frozen (alive but never answering): the sender gives up at deadline + grace_s.
            frozen = peer.call("issue", fmt, "req-frozen", [0], 0.5)
            os.kill(peer.proc.pid, signal.SIGSTOP)
            status = quick.wait(quick.write_pages(ep, frozen, [3]))
            assert status.state == TransferState.FAILED and "deadline" in status.error
            assert time.time() < frozen.deadline + 0.3 + 1.0
            # Dead: a sender already connected to it and one that never was both fail fast.
            peer.kill()
            fresh = create_transport(transport_name, secret=SECRET)
            fresh.attach(pool.pages)
            for sender in (tr, fresh):
                t0 = time.monotonic()
                status = sender.wait(sender.write_pages(ep, second, SRC))
                assert status.state == TransferState.FAILED and status.error
                assert time.monotonic() - t0 < 5.0  # well before the ticket's 30 s deadline
    finally:
        quick.close()
        if fresh is not None:
            fresh.close()
