"""Finding 5 of issue 14: the transfer channel's exposure and integrity (gRPC, in process).

* The server binds exactly the address it is given; ``loopback_only`` refuses
  anything else.
* The page-set checksum is signed for the ticket (the checksum tag): a stream
  whose checksum and pages were swapped together, a (checksum, tag) replayed
  from another transfer, a missing tag or a missing checksum are refused before
  any byte lands. The old receiver trusted any in-band checksum.
* Mutual TLS: a transfer between two workers with certificates of one CA
  works; a plaintext peer, a peer without a client certificate and a peer of
  another CA are refused.
"""

from __future__ import annotations

import socket

import grpc
import pytest
import torch

from nibble.proto.nibble.v1 import kv_transfer_pb2 as pb
from nibble.proto.nibble.v1 import kv_transfer_pb2_grpc as pb_grpc
from nibble.tiering.transfer import (RejectReason, TransferArgumentError, TransferState,
                                     checksum_tag, create_transport, page_set_checksum)
from nibble.tiering.transfer.endpoint import decode_endpoint
from nibble.tiering.transfer.grpc_transport import TLS_TARGET_NAME, ticket_to_proto

from .tls_certs import make_ca, make_cert

SECRET = b"k" * 32
PN = 256  # page bytes


def _pool(fill: int = 0) -> torch.Tensor:
    return torch.full((6, 2, PN // 2), fill, dtype=torch.uint8)


def _address(tr) -> str:
    return decode_endpoint(tr.endpoint(), SECRET, "grpc").fields["address"]


@pytest.fixture
def rx():
    tr = create_transport("grpc", secret=SECRET)
    tr.attach(_pool())
    channel = grpc.insecure_channel(_address(tr))
    yield tr, pb_grpc.KVTransferStub(channel)
    channel.close()
    tr.close()


# ---- binding ---------------------------------------------------------------------------

def _connects(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def test_the_server_binds_exactly_the_given_address():
    tr = create_transport("grpc", secret=SECRET, address="127.0.0.2:0", loopback_only=True)
    tr.attach(_pool())
    try:
        host, port = _address(tr).rsplit(":", 1)
        assert host == "127.0.0.2"
        assert _connects("127.0.0.2", int(port)) and not _connects("127.0.0.1", int(port))
    finally:
        tr.close()


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", "10.0.0.5:0", "example.org:0"])
def test_a_loopback_only_transport_refuses_other_interfaces(address):
    with pytest.raises(TransferArgumentError, match="loopback"):
        create_transport("grpc", secret=SECRET, address=address, loopback_only=True)


# ---- the signed checksum ---------------------------------------------------------------

def _stream(ticket, data: bytes, checksum: str | None, tag: bytes | None):
    head = pb.PageChunk(ticket=ticket_to_proto(ticket), checksum=checksum or "",
                        checksum_tag=tag or b"")
    return iter([head, pb.PageChunk(page_index=0, offset=0, data=data)])


def _refused(stub, msgs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        stub.WritePages(msgs, timeout=5)
    return e.value.code()


def _sum_of(data: bytes, n_pages: int) -> str:
    return page_set_checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8)
                             .reshape(n_pages, -1), range(n_pages))


def test_pages_and_checksum_swapped_together_are_refused(rx):
    tr, stub = rx
    t = tr.issue_ticket("r", [2], 5.0)
    forged = b"\x66" * PN                            # the attacker's pages, its own checksum
    code = _refused(stub, _stream(t, forged, _sum_of(forged, 1),
                                  checksum_tag(b"not-the-key-" * 3, t, _sum_of(forged, 1))))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    [rej] = tr.rejected()
    assert rej.reason == RejectReason.SIGNATURE and not rej.ticket_closed
    assert int(tr.pool.sum()) == 0 and tr.received() == []
    # The real transfer still goes through on the same ticket.
    real = b"\x07" * PN
    ack = stub.WritePages(_stream(t, real, _sum_of(real, 1),
                                  checksum_tag(SECRET, t, _sum_of(real, 1))), timeout=5)
    assert ack.nbytes == PN and tr.received()[0].checksum == _sum_of(real, 1)


def test_a_checksum_and_tag_replayed_from_another_transfer_are_refused(rx):
    tr, stub = rx
    data = b"\x07" * PN
    first, second = tr.issue_ticket("a", [1], 5.0), tr.issue_ticket("b", [4], 5.0)
    good = _sum_of(data, 1)
    tag = checksum_tag(SECRET, first, good)
    assert stub.WritePages(_stream(first, data, good, tag), timeout=5).nbytes == PN
    assert _refused(stub, _stream(second, data, good, tag)) == grpc.StatusCode.PERMISSION_DENIED
    assert _refused(stub, _stream(first, data, good, tag)) == grpc.StatusCode.PERMISSION_DENIED
    rejected = tr.rejected()
    assert [r.reason for r in rejected] == [RejectReason.SIGNATURE, RejectReason.REUSED]
    assert int(tr.pool[4].sum()) == 0


@pytest.mark.parametrize("checksum, tag, code", [
    ("sum", None, grpc.StatusCode.PERMISSION_DENIED),      # a checksum without its tag
    (None, None, grpc.StatusCode.INVALID_ARGUMENT),         # no checksum at all
])
def test_an_unsigned_or_missing_checksum_is_refused(rx, checksum, tag, code):
    tr, stub = rx
    t = tr.issue_ticket("r", [3], 5.0)
    assert _refused(stub, _stream(t, b"\x07" * PN, checksum, tag)) == code
    assert int(tr.pool.sum()) == 0 and tr.received() == []


def test_the_sender_signs_what_it_sends():
    rx_tr, tx_tr = create_transport("grpc", secret=SECRET), create_transport("grpc", secret=SECRET)
    src = _pool(9)
    rx_tr.attach(_pool())
    tx_tr.attach(src)
    try:
        t = rx_tr.issue_ticket("r", [0, 5], 5.0)
        st = tx_tr.wait(tx_tr.write_pages(rx_tr.endpoint(), t, [1, 2]))
        assert st.state == TransferState.SUCCESS, st.error
        [done] = rx_tr.received()
        assert done.checksum == page_set_checksum(src, [1, 2])
    finally:
        rx_tr.close()
        tx_tr.close()


# ---- mutual TLS ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two workers' certificates of one CA, and one of another CA (PEM files)."""
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca("nibble test CA"), make_ca("someone else's CA")
    files = {"ca": ca.write(d / "ca.pem"), "other_ca": other_ca.write(d / "other-ca.pem")}
    for name, issuer in (("a", ca), ("b", ca), ("rogue", other_ca)):
        cert = make_cert(issuer, [TLS_TARGET_NAME])
        files[name] = cert.write(d / f"{name}.pem", d / f"{name}.key")
    return files


def _tls(pki, name: str, ca: str = "ca", **kw):
    cert, key = pki[name]
    tr = create_transport("grpc", secret=SECRET, ssl_certfile=str(cert), ssl_keyfile=str(key),
                          ssl_ca_certs=str(pki[ca]), grace_s=0.2, **kw)
    return tr


def test_a_tls_transfer_between_workers_of_one_ca(pki):
    rx_tr, tx_tr = _tls(pki, "a"), _tls(pki, "b")
    src = _pool(3)
    rx_tr.attach(_pool())
    tx_tr.attach(src)
    try:
        t = rx_tr.issue_ticket("r", [4], 5.0)
        st = tx_tr.wait(tx_tr.write_pages(rx_tr.endpoint(), t, [2]))
        assert st.state == TransferState.SUCCESS, st.error
        assert torch.equal(rx_tr.pool[4], src[2]) and len(rx_tr.received()) == 1
    finally:
        rx_tr.close()
        tx_tr.close()


def test_a_tls_receiver_refuses_plaintext_and_certificateless_peers(pki):
    rx_tr = _tls(pki, "a")
    rx_tr.attach(_pool())
    t = rx_tr.issue_ticket("r", [1], 5.0)
    data = b"\x07" * PN
    msgs = lambda: _stream(t, data, _sum_of(data, 1), checksum_tag(SECRET, t, _sum_of(data, 1)))
    creds = {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials(
            root_certificates=open(pki["ca"], "rb").read()),
    }
    try:
        for what, cred in creds.items():
            opts = [("grpc.ssl_target_name_override", TLS_TARGET_NAME)]
            ch = (grpc.insecure_channel(_address(rx_tr)) if cred is None
                  else grpc.secure_channel(_address(rx_tr), cred, options=opts))
            with ch:
                assert _refused(pb_grpc.KVTransferStub(ch), msgs()) == \
                    grpc.StatusCode.UNAVAILABLE, what
        assert int(rx_tr.pool.sum()) == 0 and rx_tr.received() == []
        plain = create_transport("grpc", secret=SECRET)      # a worker configured without TLS
        plain.attach(_pool(1))
        with pytest.raises(TransferArgumentError, match="TLS"):
            plain.write_pages(rx_tr.endpoint(), t, [0])
        plain.close()
    finally:
        rx_tr.close()


def test_a_peer_of_another_ca_is_refused_both_ways(pki):
    rx_tr, rogue = _tls(pki, "a"), _tls(pki, "rogue", ca="other_ca")
    rogue_pool = _pool(5)
    rogue_pool[2] = 0                  # the page a good worker will be asked to fill
    rx_tr.attach(_pool())
    rogue.attach(rogue_pool)
    try:
        t = rx_tr.issue_ticket("r", [1], 1.0)
        st = rogue.wait(rogue.write_pages(rx_tr.endpoint(), t, [0]))
        assert st.state == TransferState.FAILED and "UNAVAILABLE" in st.error
        assert int(rx_tr.pool.sum()) == 0 and rx_tr.received() == []
        # A worker of our CA does not send to a receiver whose certificate it cannot verify.
        good = _tls(pki, "b")
        good.attach(_pool(5))
        t2 = rogue.issue_ticket("r2", [2], 1.0)
        st = good.wait(good.write_pages(rogue.endpoint(), t2, [0]))
        assert st.state == TransferState.FAILED and int(rogue.pool[2].sum()) == 0
        good.close()
    finally:
        rx_tr.close()
        rogue.close()
