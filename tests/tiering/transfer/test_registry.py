"""Transport registry, ticket book and checksum helper (in process)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from nibble.tiering.transfer import (KVTransport, RejectReason, TicketBook, TicketError,
                                     TransferArgumentError, create_transport, page_set_checksum,
                                     register_transport, transport_names)
from nibble.tiering.transfer.grpc_transport import GrpcTransport

SECRET = b"k" * 32


def test_nixl_and_grpc_are_registered_by_name():
    assert {"nixl", "grpc"} <= set(transport_names())
    tr = create_transport("grpc", secret=SECRET)
    assert isinstance(tr, GrpcTransport) and tr.name == "grpc"
    with pytest.raises(TransferArgumentError, match="known: .*grpc.*nixl"):
        create_transport("carrier-pigeon", secret=SECRET)


def test_registering_a_transport(monkeypatch):
    from nibble.tiering.transfer import base

    # a registry of this test's own: the test transport must not leak into later tests
    # (the CLI offers every registered transport as a --kv-transport choice)
    monkeypatch.setattr(base._TRANSPORTS, "_classes", dict(base._TRANSPORTS._classes))

    @register_transport("test-null")
    class Null(KVTransport):
        def _attach(self, pool_pages): ...
        def endpoint(self): return b""
        def close(self): ...
        def write_pages(self, peer_endpoint, ticket, src_pages, checksum=None): ...
        def poll(self, handle): ...

    assert "test-null" in transport_names()
    tr = create_transport("test-null", secret=SECRET)
    assert tr.name == "test-null" and tr.endpoint_id().startswith("nibble-test-null-")
    with pytest.raises(TransferArgumentError, match="already"):
        register_transport("grpc")(Null)
    with pytest.raises(TransferArgumentError, match="not a KVTransport"):
        register_transport("test-bad")(object)


def test_attach_checks_the_pool():
    tr = create_transport("grpc", secret=SECRET)
    with pytest.raises(TransferArgumentError):
        tr.attach(torch.zeros(4, 16, dtype=torch.float32))
    with pytest.raises(TransferArgumentError):
        tr.attach(torch.zeros(4, 16, 2, dtype=torch.uint8).transpose(1, 2))
    with pytest.raises(TransferArgumentError, match="attach"):
        tr.issue_ticket("r", [0], 1.0)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_ticket_book_lifecycle():
    clock, closed = FakeClock(), []
    book = TicketBook(SECRET, "me", num_pages=8, page_nbytes=64, grace_s=1.0, clock=clock,
                      on_close=closed.append)
    with pytest.raises(TransferArgumentError):
        book.issue("r", [1, 1], 5)
    with pytest.raises(TransferArgumentError):
        book.issue("r", [8], 5)
    a, b = book.issue("ra", [1, 2], 5), book.issue("rb", [3], 5)
    book.admit(a)
    with pytest.raises(TicketError) as e:
        book.admit(a)  # one stream per ticket
    assert e.value.reason == RejectReason.REUSED
    book.complete(a.ticket_id, a.nbytes, None)
    with pytest.raises(TicketError) as e:
        book.admit(a)
    assert e.value.reason == RejectReason.REUSED
    assert [r.ticket_id for r in book.take_received()] == [a.ticket_id]
    clock.now += 5.5  # past b's deadline, within grace: not swept yet
    assert book.sweep() == [] and book.is_open(b.ticket_id)
    clock.now += 1.0
    [late] = book.sweep()
    assert (late.ticket_id, late.reason, late.ticket_closed) == (b.ticket_id, "deadline", True)
    assert closed == [(3,)]  # its pages handed back for zeroing
    with pytest.raises(TicketError) as e:
        book.admit(b)
    assert e.value.reason == RejectReason.DEADLINE
    reasons = [(r.reason, r.ticket_closed) for r in book.take_rejected()]
    assert reasons == [(RejectReason.REUSED, False)] * 2 + [
        (RejectReason.DEADLINE, True), (RejectReason.DEADLINE, False)]  # closed once


def test_page_set_checksum_is_sha256_of_chunk_sums_in_order():
    """Independent reference: per page, chunks of CHUNK bytes, sum of byte * multiplier."""
    from nibble.tiering.transfer import checksum as cs

    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (5, 3, cs.CHUNK // 2 + 40), dtype=torch.uint8, generator=g)
    mults = [int(m) for m in cs._mults(torch.device("cpu"))]

    def ref_sums(page):
        data = pool[page].reshape(-1).tolist()
        return [sum(b * m for b, m in zip(data[i:i + cs.CHUNK], mults))
                for i in range(0, len(data), cs.CHUNK)]

    want = hashlib.sha256(b"".join(v.to_bytes(8, "little", signed=True)
                                   for p in (3, 1) for v in ref_sums(p))).hexdigest()
    assert page_set_checksum(pool, [3, 1]) == want
    assert page_set_checksum(pool, [1, 3]) != want
    flipped = pool.clone()
    flipped[3, 2, 7] ^= 1                      # one bit anywhere changes the checksum
    assert page_set_checksum(flipped, [3, 1]) != want
    assert page_set_checksum(pool, []) == hashlib.sha256().hexdigest()


@pytest.mark.parametrize("blocked, exc", [
    ("grpc", "ImportError"),                                     # no grpcio at all
    ("nibble.proto.nibble.v1.kv_transfer_pb2_grpc", "RuntimeError"),   # grpcio too old for
])                                                               # the generated code's check
def test_without_grpcio_the_grpc_transport_is_unavailable_and_nixl_loads(blocked, exc):
    """A trimmed install (the lent GPU image has grpcio 1.84, older than the generated code
    needs) still imports the transfer package; asking for grpc then says why it cannot
    start."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == BLOCKED or name.startswith(BLOCKED + "."):
                    raise EXC("grpcio cannot load in this test")
        sys.meta_path.insert(0, Block())
        from nibble.tiering.transfer import (TransportUnavailableError, create_transport,
                                             transport_names)
        assert {"grpc", "nixl"} <= set(transport_names()), transport_names()
        try:
            create_transport("grpc", secret=b"k" * 32)
        except TransportUnavailableError as e:
            assert "grpcio" in str(e), e
            print("UNAVAILABLE")
        import nibble.bench.transfer_runs  # the NIXL bench imports without grpcio
        print("BENCH OK")
    """)
    code = f"BLOCKED, EXC = {blocked!r}, {exc}\n" + code
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["UNAVAILABLE", "BENCH OK"]
