"""grpc_wire: data messages byte-identical to protobuf's encoding, read back in place, and
the chunk plan over source runs (hypothesis)."""

import pytest
import torch
from hypothesis import given, strategies as st

from nibble.proto.nibble.v1 import kv_transfer_pb2 as pb
from nibble.tiering.transfer import grpc_wire
from nibble.tiering.transfer.grpc_wire import BadChunk, RawChunk, plan_chunks


@pytest.mark.parametrize("page_index, offset, n", [(0, 0, 1), (3, 0, 300), (0, 77, 5),
                                                   (70000, 1 << 33, 200)])
def test_a_raw_chunk_encodes_as_protobuf_does_and_reads_back(page_index, offset, n):
    data = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)
    raw = grpc_wire.serialize(RawChunk(page_index, offset, [data[:n // 2], data[n // 2:]]))
    assert raw == pb.PageChunk(page_index=page_index, offset=offset,
                               data=bytes(data.numpy())).SerializeToString()
    back = grpc_wire.deserialize(raw)
    assert isinstance(back, RawChunk)
    assert (back.page_index, back.offset, bytes(back.data)) == (page_index, offset,
                                                                bytes(data.numpy()))


def test_the_ticket_message_goes_through_protobuf_and_garbage_is_a_bad_chunk():
    first = pb.PageChunk(checksum="ab", checksum_tag=b"t", ticket=pb.TransferTicket(
        request_id="r", dst_pages=[1, 2]))
    back = grpc_wire.deserialize(first.SerializeToString())
    assert isinstance(back, pb.PageChunk) and back == first
    assert isinstance(grpc_wire.deserialize(b"\x2a\x05ab"), BadChunk)        # data past the end
    assert isinstance(grpc_wire.deserialize(b"\x18\xff"), BadChunk)          # truncated varint
    assert isinstance(grpc_wire.deserialize(b"\x1a\x01x"), BadChunk)         # page_index as bytes
    assert isinstance(grpc_wire.deserialize(b"\x0a\x02\xff\xff"), BadChunk)  # bad ticket


runs_st = st.lists(st.tuples(st.integers(0, 50), st.integers(1, 6)), min_size=1, max_size=8)


@given(runs_st, st.integers(1, 9), st.integers(1, 40))
def test_the_plan_covers_the_runs_in_order_within_the_chunk_size(runs, pn, chunk):
    plan = plan_chunks(runs, pn, chunk)
    want = [b for first, n in runs for b in range(first * pn, (first + n) * pn)]
    got = [b for _, segs in plan for at, n in segs for b in range(at, at + n)]
    assert got == want
    stream = 0
    for start, segs in plan:
        size = sum(n for _, n in segs)
        assert start == stream and 0 < size <= chunk and all(n > 0 for _, n in segs)
        stream += size
    assert all(size == chunk for size in [sum(n for _, n in s) for _, s in plan[:-1]])
    # one segment per run a chunk touches: at most chunks + runs - 1 in all
    assert sum(len(s) for _, s in plan) <= len(plan) + len(runs) - 1
