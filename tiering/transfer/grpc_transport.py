"""The ``grpc`` KV transport: page bytes streamed in bounded chunks (the fallback without RDMA).

Every attached instance runs a ``KVTransfer`` server (``proto/nibble/v1/
kv_transfer.proto``) in its own process, on a thread pool, bound to
``address`` (default ``127.0.0.1:0``, a free port). A sender calls the
client-streaming ``WritePages``: the signed ticket first, then the ticket's
pages in order as one logical byte stream cut into chunks of at most
``chunk_bytes`` (default 4 MiB, capped by the receiver's ``max_chunk_bytes``; a
chunk may span pages). The server checks the ticket before any byte lands
(PERMISSION_DENIED for a bad signature or an unknown/reused ticket,
DEADLINE_EXCEEDED once the deadline has passed) and writes each chunk
straight into the reserved pages of the attached pool.

Copies: data messages are encoded and read by ``grpc_wire`` (standard
protobuf bytes, no protobuf objects): a chunk is joined from views of the
sender's pool, one contiguous range per run of consecutive source pages
(``page_runs``), into the message bytes, and the receiver writes the payload
from the received bytes into each run of consecutive destination pages, one
copy per run segment. Device pools go through a ring of pinned staging buffers
on both sides (``staging.PinnedRing``): the sender copies chunk k+1 off the device while
chunk k is sent, the receiver's device copies run while it reads the next chunk.
Flow control is gRPC's (HTTP/2 windows; the request iterator is pulled only as
fast as the channel drains), with the chunk size bounding memory per stream.
Message size limits are set explicitly on both sides.

The first message also carries the page-set checksum and its tag (an HMAC
binding it to the ticket, ``signing.checksum_tag``): a tag that does not verify
is refused (PERMISSION_DENIED) before any byte lands, and the checksum is
checked once every byte has.

Network exposure: the server binds exactly ``address``. With
``loopback_only`` (a single-node deployment) any other interface is refused.
With ``ssl_certfile``/``ssl_keyfile``/``ssl_ca_certs`` the channel is mutual
TLS: the server asks every sender for a certificate signed by the CA, and a
sender accepts only a receiver whose certificate the CA signed for the name
``ssl_target_name`` (default ``nibble-kv-transfer``, a SAN every worker's
certificate must carry, since workers are dialled by IP address); a TLS
transport neither serves nor dials plaintext.

Options: ``secret``, ``grace_s``, ``require_checksum`` (see KVTransport),
``address``, ``advertise`` (the address peers dial, default the bound one),
``advertise_host`` (advertise this host with the bound port, for a wildcard
bind), ``loopback_only``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_ca_certs``,
``ssl_target_name``, ``chunk_bytes`` (what this sender sends),
``max_chunk_bytes`` (the largest chunk this receiver accepts, default 16 MiB),
``server_threads`` (concurrent incoming streams, default 4).
"""

from __future__ import annotations

import bisect
import ipaddress
import time
from concurrent import futures
from typing import Iterator, Sequence

import grpc
import numpy as np
import torch

from nibble.proto.nibble.v1 import kv_transfer_pb2 as pb
from nibble.proto.nibble.v1 import kv_transfer_pb2_grpc as pb_grpc

from ..page_runs import contiguous_runs
from . import grpc_wire
from .base import KVTransport, TransferHandle, TransferState, TransferStatus, register_transport
from .checksum import page_set_checksum
from .endpoint import Endpoint
from .errors import TicketError, TransferArgumentError, TransportUnavailableError
from .staging import PinnedRing
from .tickets import RejectReason, TransferTicket

DEFAULT_CHUNK_BYTES = grpc_wire.DEFAULT_CHUNK_BYTES
TLS_TARGET_NAME = "nibble-kv-transfer"
DEFAULT_MAX_CHUNK_BYTES = 16 << 20
_HEADER_ROOM = 1 << 20  # the first message's ticket: 4-5 bytes per page id

_CODES = {
    RejectReason.SIGNATURE: grpc.StatusCode.PERMISSION_DENIED,
    RejectReason.UNKNOWN: grpc.StatusCode.PERMISSION_DENIED,
    RejectReason.REUSED: grpc.StatusCode.PERMISSION_DENIED,
    RejectReason.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    RejectReason.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    RejectReason.CHECKSUM: grpc.StatusCode.DATA_LOSS,
    RejectReason.ABORTED: grpc.StatusCode.ABORTED,
}


def ticket_to_proto(t: TransferTicket) -> pb.TransferTicket:
    return pb.TransferTicket(request_id=t.request_id, ticket_id=t.ticket_id,
                             dst_pages=list(t.dst_pages), page_nbytes=t.page_nbytes,
                             deadline=t.deadline, signature=t.signature)


def ticket_from_proto(m: pb.TransferTicket) -> TransferTicket:
    return TransferTicket(m.request_id, m.ticket_id, tuple(m.dst_pages), m.page_nbytes,
                          m.deadline, bytes(m.signature))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 maybe in brackets) is a loopback one."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_tls(certfile: str | None, keyfile: str | None, ca_certs: str | None
             ) -> tuple[bytes, bytes, bytes] | None:
    """``(key, cert chain, CA)`` PEM bytes for mutual TLS, or None when no file is given.

    Raises TransferArgumentError when only some are given or one is unreadable.
    """
    given = (certfile, keyfile, ca_certs)
    if not any(given):
        return None
    if not all(given):
        raise TransferArgumentError("TLS on the transfer channel needs a certificate, its key "
                                    "and the CA that signs every worker's certificate")
    out = []
    for path in (keyfile, certfile, ca_certs):
        try:
            with open(path, "rb") as f:
                out.append(f.read())
        except OSError as e:
            raise TransferArgumentError(f"cannot read {path}: {e.strerror or e}") from None
    return out[0], out[1], out[2]


class _PageWriter:
    """Writes one admitted stream, in order, into the ticket's pages of the pool: each chunk
    as one copy per run of consecutive destination pages it touches (``copies`` counts)."""

    def __init__(self, transport: "GrpcTransport", entry, max_chunk: int):
        self.book, self.entry, self.max_chunk = transport.book, entry, max_chunk
        self.pn = transport.page_nbytes
        self.flat = transport.pool.view(-1)
        self.np = self.flat.numpy() if self.flat.device.type == "cpu" else None
        self.cursor, self.total, self.copies = 0, entry.ticket.nbytes, 0
        self.runs = contiguous_runs(entry.ticket.dst_pages)     # (first page, pages)
        self.run_at = [0]                                       # stream byte of each run
        for _, n in self.runs:
            self.run_at.append(self.run_at[-1] + n * self.pn)
        self._staging: PinnedRing | None = None

    def write(self, msg: grpc_wire.Chunk) -> None:
        if isinstance(msg, grpc_wire.BadChunk):
            raise TicketError(RejectReason.INVALID, msg.detail)
        data = msg.data if isinstance(msg, grpc_wire.RawChunk) else memoryview(msg.data)
        n, pos = len(data), msg.page_index * self.pn + msg.offset
        if msg.offset >= self.pn or pos != self.cursor:
            raise TicketError(RejectReason.INVALID, f"chunk at page {msg.page_index} offset "
                              f"{msg.offset} is out of order (expected byte {self.cursor})")
        if not 0 < n <= self.max_chunk or pos + n > self.total:
            raise TicketError(RejectReason.INVALID, f"chunk of {n} bytes at byte {pos} exceeds "
                              f"the chunk limit {self.max_chunk} or the ticket's {self.total}")
        src = np.frombuffer(data, dtype=np.uint8)
        slot = None
        if self.np is None:
            slot, src = self._stage(src)
        with self.entry.lock:
            if not self.book.is_live(self.entry):
                raise TicketError(RejectReason.DEADLINE, "the ticket deadline passed mid-stream")
            done, r = 0, bisect.bisect_right(self.run_at, pos) - 1
            while done < n:
                at = pos + done - self.run_at[r]
                take = min(self.run_at[r + 1] - self.run_at[r] - at, n - done)
                dst = self.runs[r][0] * self.pn + at
                if self.np is not None:
                    self.np[dst:dst + take] = src[done:done + take]
                else:
                    self.flat[dst:dst + take].copy_(src[done:done + take], non_blocking=True)
                done, r, self.copies = done + take, r + 1, self.copies + 1
            if slot is not None:
                self._staging.copied(slot)
        self.cursor += n

    def _stage(self, src: np.ndarray) -> tuple[int, torch.Tensor]:
        """The payload in a pinned slot (``staging.PinnedRing``), for copies into a device
        pool that run while the next chunk is read."""
        if self._staging is None:
            self._staging = PinnedRing(self.flat.device, max(len(src), self.max_chunk))
        slot, host = self._staging.take(len(src))
        host.numpy()[:] = src
        return slot, host

    def drain(self) -> None:
        """Wait for the device copies still in flight (before the checksum, and before a
        refused ticket's pages can go back to the pool)."""
        if self._staging is not None:
            self._staging.drain()

    def finish(self) -> None:
        self.drain()
        if self.cursor != self.total:
            raise TicketError(RejectReason.ABORTED,
                              f"stream ended after {self.cursor} of {self.total} bytes")


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, transport: "GrpcTransport"):
        self.tr = transport

    def WritePages(self, request_iterator, context):  # noqa: N802 (generated name)
        tr = self.tr
        try:
            first = next(request_iterator, None)
        except grpc.RpcError:  # the sender cancelled before its first message
            context.abort(grpc.StatusCode.CANCELLED, "the sender cancelled the stream")
        if not isinstance(first, pb.PageChunk) or not first.HasField("ticket"):
            tr.book.refuse("", "", RejectReason.INVALID, "the first message carries no ticket")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be the ticket")
        ticket = ticket_from_proto(first.ticket)
        refusal = tr._check_seal(ticket, first.checksum, first.checksum_tag)
        if refusal is not None:        # before any byte lands: the real ticket stays valid
            reason = RejectReason(refusal.reason)
            tr.book.refuse(ticket.ticket_id, ticket.request_id, reason, refusal.detail)
            context.abort(_CODES[reason], str(refusal))
        try:
            entry = tr.book.admit(ticket)
        except TicketError as e:
            context.abort(_CODES[RejectReason(e.reason)], str(e))
        failure = self._receive(entry, first.checksum, request_iterator)
        if failure is not None:
            tr.book.close(ticket.ticket_id, RejectReason(failure.reason), failure.detail)
            context.abort(_CODES[RejectReason(failure.reason)], str(failure))
        if tr.book.complete(ticket.ticket_id, ticket.nbytes, first.checksum or None) is None:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the ticket expired meanwhile")
        return pb.WriteAck(ticket_id=ticket.ticket_id, nbytes=ticket.nbytes,
                           checksum=first.checksum)

    def _receive(self, entry, checksum: str, chunks) -> TicketError | None:
        """Write every chunk; the refusal to report, or None when all bytes landed intact."""
        writer = _PageWriter(self.tr, entry, self.tr.max_chunk_bytes)
        try:
            for msg in chunks:
                writer.write(msg)
            writer.finish()
        except TicketError as e:
            return e
        except grpc.RpcError:  # the sender cancelled or went away mid-stream
            return TicketError(RejectReason.ABORTED, "the sender cancelled the stream")
        finally:
            writer.drain()
        if checksum and page_set_checksum(self.tr.pool, entry.ticket.dst_pages) != checksum:
            return TicketError(RejectReason.CHECKSUM, "page-set checksum mismatch")
        return None


@register_transport("grpc")
class GrpcTransport(KVTransport):
    """KV pages over a gRPC client stream (see the module docstring for options)."""

    def __init__(self, *, secret: bytes | str | None = None, grace_s: float = 2.0,
                 require_checksum: bool = True, address: str = "127.0.0.1:0",
                 advertise: str | None = None, advertise_host: str | None = None,
                 loopback_only: bool = False, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None, ssl_ca_certs: str | None = None,
                 ssl_target_name: str = TLS_TARGET_NAME,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, server_threads: int = 4):
        super().__init__(secret=secret, grace_s=grace_s, require_checksum=require_checksum)
        if chunk_bytes <= 0 or max_chunk_bytes <= 0:
            raise TransferArgumentError("chunk sizes must be positive")
        if loopback_only and not is_loopback(address.rsplit(":", 1)[0]):
            raise TransferArgumentError(
                f"refusing to bind the KV-transfer server to {address}: this is a single-node "
                f"deployment, whose transfer ports stay on loopback")
        self.tls = load_tls(ssl_certfile, ssl_keyfile, ssl_ca_certs)
        self.ssl_target_name = ssl_target_name
        self.address, self.advertise, self.advertise_host = address, advertise, advertise_host
        self.chunk_bytes, self.max_chunk_bytes = int(chunk_bytes), int(max_chunk_bytes)
        self.server_threads = int(server_threads)
        self._server: grpc.Server | None = None
        self._channels: dict[str, tuple[grpc.Channel, grpc.StreamUnaryMultiCallable]] = {}

    def _attach(self, pool_pages: torch.Tensor) -> None:
        server = grpc.server(
            futures.ThreadPoolExecutor(self.server_threads, thread_name_prefix="nibble-kv-grpc"),
            options=[("grpc.max_receive_message_length", self.max_chunk_bytes + _HEADER_ROOM),
                     ("grpc.max_send_message_length", 64 << 10)])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "nibble.v1.KVTransfer", {"WritePages": grpc.stream_unary_rpc_method_handler(
                _Servicer(self).WritePages, request_deserializer=grpc_wire.deserialize,
                response_serializer=pb.WriteAck.SerializeToString)})])
        try:
            if self.tls is None:
                port = server.add_insecure_port(self.address)
            else:
                key, cert, ca = self.tls
                port = server.add_secure_port(self.address, grpc.ssl_server_credentials(
                    [(key, cert)], root_certificates=ca, require_client_auth=True))
        except RuntimeError as e:
            raise TransportUnavailableError(f"cannot bind {self.address}: {e}") from None
        if not port:
            raise TransportUnavailableError(f"cannot bind {self.address}")
        server.start()
        self._server = server
        host = self.advertise_host or self.address.rsplit(":", 1)[0]
        host = "127.0.0.1" if host in ("", "0.0.0.0", "[::]") else host
        self.advertise = self.advertise or f"{host}:{port}"

    def endpoint(self) -> bytes:
        if self._server is None:
            raise TransferArgumentError("attach(pool) first")
        return Endpoint(self.name, self._endpoint_id, self.num_pages, self.page_nbytes,
                        {"address": self.advertise, "max_chunk": self.max_chunk_bytes,
                         "tls": self.tls is not None}).encode(self.secret)

    def _stub(self, address: str):
        """The ``WritePages`` call of a channel to ``address`` (data messages by ``grpc_wire``)."""
        if address not in self._channels:
            limit = self.chunk_bytes + _HEADER_ROOM
            opts = [("grpc.max_send_message_length", limit),
                    ("grpc.max_receive_message_length", 64 << 10)]
            if self.tls is None:
                ch = grpc.insecure_channel(address, options=opts)
            else:
                key, cert, ca = self.tls
                creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                                     certificate_chain=cert)
                ch = grpc.secure_channel(address, creds, options=opts + [
                    ("grpc.ssl_target_name_override", self.ssl_target_name)])
            call = ch.stream_unary("/nibble.v1.KVTransfer/WritePages",
                                   request_serializer=grpc_wire.serialize,
                                   response_deserializer=pb.WriteAck.FromString)
            self._channels[address] = (ch, call)
        return self._channels[address][1]

    def write_pages(self, peer_endpoint: bytes, ticket: TransferTicket, src_pages: Sequence[int],
                    checksum: str | None = None) -> TransferHandle:
        peer, src, handle = self._start(peer_endpoint, ticket, src_pages)
        if bool(peer.fields.get("tls")) != (self.tls is not None):
            raise TransferArgumentError(
                f"the peer {'requires' if peer.fields.get('tls') else 'does not speak'} TLS on "
                f"the transfer channel and this worker is configured "
                f"{'with' if self.tls else 'without'} it")
        chunk = min(self.chunk_bytes, int(peer.fields["max_chunk"]))
        call = self._stub(str(peer.fields["address"]))
        timeout = max(0.001, handle.give_up_at - time.monotonic())
        checksum, tag = self._seal(ticket, src, checksum)
        plan = grpc_wire.plan_chunks(contiguous_runs(src), self.page_nbytes, chunk)
        handle.descriptors = sum(len(segments) for _, segments in plan)
        handle.impl = call.future(self._chunks(ticket, plan, checksum, tag), timeout=timeout)
        return handle

    def _chunks(self, ticket: TransferTicket, plan, checksum: str, tag: bytes
                ) -> Iterator[grpc_wire.Chunk]:
        """The ticket with the signed checksum, then the planned chunks of the source pages
        (``grpc_wire.plan_chunks``): views of a host pool, or one pinned copy per chunk of a
        device pool."""
        yield pb.PageChunk(ticket=ticket_to_proto(ticket), checksum=checksum, checksum_tag=tag)
        pn, flat = self.page_nbytes, self.pool.view(-1)
        if flat.device.type == "cpu":
            for stream, segments in plan:
                yield grpc_wire.RawChunk(stream // pn, stream % pn,
                                         [flat[at:at + n] for at, n in segments])
            return
        # Device pool: chunk k+1 is copied into pinned memory while chunk k is sent. A slot
        # comes round again only after its message was serialized (the iterator is pulled
        # once the previous message is handed to gRPC) and its copy event has fired.
        ring = PinnedRing(flat.device, max((sum(n for _, n in seg) for _, seg in plan),
                                           default=1))
        ahead = None
        for k in range(len(plan) + 1):
            issued = self._copy_off(ring, flat, plan[k]) if k < len(plan) else None
            if ahead is not None:
                stream, stage, event = ahead
                event.synchronize()
                yield grpc_wire.RawChunk(stream // pn, stream % pn, [stage])
            ahead = issued

    @staticmethod
    def _copy_off(ring: PinnedRing, flat: torch.Tensor, planned):
        """Start the device-to-host copies of one planned chunk into a ring slot:
        ``(stream byte, pinned bytes, event)``."""
        stream, segments = planned
        slot, stage = ring.take(sum(n for _, n in segments))
        at = 0
        for pool_at, n in segments:
            stage[at:at + n].copy_(flat[pool_at:pool_at + n], non_blocking=True)
            at += n
        return stream, stage, ring.copied(slot)

    def poll(self, handle: TransferHandle) -> TransferStatus:
        if handle.final is not None:
            return handle.final
        fut = handle.impl
        if not fut.done():
            if time.monotonic() <= handle.give_up_at:
                return handle.status()
            fut.cancel()
            return handle.finish(TransferState.FAILED, "no answer before the ticket deadline")
        if fut.cancelled():
            return handle.finish(TransferState.FAILED, "cancelled")
        err = fut.exception()
        if err is not None:
            code = err.code().name if hasattr(err, "code") else type(err).__name__
            detail = err.details() if hasattr(err, "details") else str(err)
            return handle.finish(TransferState.FAILED, f"{code}: {detail}")
        ack = fut.result()
        if ack.nbytes != handle.nbytes:
            return handle.finish(TransferState.FAILED,
                                 f"receiver acknowledged {ack.nbytes} of {handle.nbytes} bytes")
        return handle.finish(TransferState.SUCCESS)

    def cancel(self, handle: TransferHandle) -> TransferStatus:
        if handle.impl is not None:
            handle.impl.cancel()
        return super().cancel(handle)

    def close(self) -> None:
        for ch, _ in self._channels.values():
            ch.close()
        self._channels.clear()
        if self._server is not None:
            self._server.stop(grace=0.2).wait(2)
            self._server = None
