"""The gRPC receiver's checks on malformed streams (in process, raw stub)."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from nibble.proto.nibble.v1 import kv_transfer_pb2 as pb
from nibble.proto.nibble.v1 import kv_transfer_pb2_grpc as pb_grpc
from nibble.tiering.transfer import (RejectReason, TicketError, TransferTicket, create_transport,
                                     make_ticket, sign_ticket)
from nibble.tiering.transfer.endpoint import decode_endpoint
from nibble.tiering.transfer.grpc_transport import ticket_to_proto

SECRET = b"k" * 32
PN = 256  # page bytes


@pytest.fixture
def rx():
    # These raw streams test chunk handling and send no checksum; test_transfer_security.py
    # covers the signed checksum a receiver requires by default.
    tr = create_transport("grpc", secret=SECRET, max_chunk_bytes=300, require_checksum=False)
    tr.attach(torch.zeros(6, 2, PN // 2, dtype=torch.uint8))
    address = decode_endpoint(tr.endpoint(), SECRET, "grpc").fields["address"]
    channel = grpc.insecure_channel(address)
    yield tr, pb_grpc.KVTransferStub(channel)
    channel.close()
    tr.close()


def _call(stub, msgs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        stub.WritePages(iter(msgs), timeout=5)
    return e.value.code()


def _head(ticket):
    return pb.PageChunk(ticket=ticket_to_proto(ticket))


def _data(page_index, offset, n):
    return pb.PageChunk(page_index=page_index, offset=offset, data=b"\x07" * n)


def test_a_valid_stream_spanning_pages_is_acked(rx):
    tr, stub = rx
    t = tr.issue_ticket("r", [4, 0], 5.0)
    ack = stub.WritePages(iter([_head(t), _data(0, 0, 300), _data(1, 44, 212)]), timeout=5)
    assert ack.nbytes == 2 * PN and tr.received()[0].ticket_id == t.ticket_id
    assert int(tr.pool[4].sum()) == int(tr.pool[0].sum()) == 7 * PN
    assert int(tr.pool.sum()) == 7 * 2 * PN


def test_the_first_message_must_carry_the_ticket(rx):
    tr, stub = rx
    assert _call(stub, [_data(0, 0, 10)]) == grpc.StatusCode.INVALID_ARGUMENT
    assert tr.rejected()[0].reason == RejectReason.INVALID


@pytest.mark.parametrize("chunks, code, reason", [
    ([_data(0, 0, 100), _data(0, 150, 10)], "INVALID_ARGUMENT", RejectReason.INVALID),
    ([_data(0, 0, 100), _data(0, 0, 100)], "INVALID_ARGUMENT", RejectReason.INVALID),
    ([_data(0, 0, 301)], "INVALID_ARGUMENT", RejectReason.INVALID),        # over max_chunk
    ([_data(0, 0, 256), _data(1, 0, 257)], "INVALID_ARGUMENT", RejectReason.INVALID),  # past end
    ([_data(0, 0, 256), _data(1, 0, 100)], "ABORTED", RejectReason.ABORTED),  # truncated
])
def test_bad_chunks_close_the_ticket_and_zero_its_pages(rx, chunks, code, reason):
    tr, stub = rx
    t = tr.issue_ticket("r", [2, 3], 5.0)
    assert _call(stub, [_head(t), *chunks]) == getattr(grpc.StatusCode, code)
    [rej] = tr.rejected()
    assert (rej.reason, rej.ticket_closed, rej.dst_pages) == (reason, True, (2, 3))
    assert int(tr.pool.sum()) == 0 and tr.received() == []


def test_a_validly_signed_ticket_this_receiver_never_issued_is_refused(rx):
    tr, stub = rx
    t = make_ticket(SECRET, tr.endpoint_id(), "r", [1], PN, 2e9)
    assert _call(stub, [_head(t), _data(0, 0, PN)]) == grpc.StatusCode.PERMISSION_DENIED
    assert tr.rejected()[0].reason == RejectReason.UNKNOWN and int(tr.pool.sum()) == 0


def test_a_ticket_signed_elsewhere_is_accepted_once_expected(rx):
    tr, stub = rx
    t = sign_ticket(TransferTicket("r", "made-by-the-worker", [5], PN, time.time() + 5), SECRET,
                    tr.endpoint_id())
    with pytest.raises(TicketError):  # signed for another receiver
        tr.expect_ticket(sign_ticket(t, SECRET, "nibble-grpc-other"))
    tr.expect_ticket(t)
    with pytest.raises(TicketError):  # once only
        tr.expect_ticket(t)
    assert stub.WritePages(iter([_head(t), _data(0, 0, PN)]), timeout=5).nbytes == PN
    assert tr.received()[0].ticket_id == "made-by-the-worker"
