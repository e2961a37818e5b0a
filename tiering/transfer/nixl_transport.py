"""The ``nixl`` KV transport: one-sided RDMA WRITEs of whole pages (UCX backend).

``attach`` registers the pool tensor with NIXL once (DRAM on CPU, VRAM on
GPU) and prepares a local descriptor list of one descriptor per page (one
page = ``page_nbytes`` contiguous bytes). ``endpoint()`` carries the agent
metadata and the pool's base address; a sender loads it once per peer
(``add_remote_agent``) and prepares the peer's per-page descriptor list. A
transfer merges its (source, destination) pairing into runs adjacent on both
sides (``page_runs.merge_runs``; one page holds all its layers, so a run is
one contiguous byte range on each side) and posts one descriptor per run
(``initialize_xfer`` with run descriptors), plus ``transfer``; with
``coalesce`` off it passes one prepped descriptor per page to
``make_prepped_xfer`` (the path before runs; NIXL itself then merges
neighbours adjacent on both sides). The transfer's notification message carries the signed
ticket, the page-set checksum and the checksum tag that binds it to the ticket
(``signing.checksum_tag``); NIXL delivers it after the data.

Security, and why it differs from gRPC: an RDMA WRITE cannot be refused
mid-flight, and a peer that holds this worker's endpoint can write anywhere in
the registered pool. The HMAC therefore guards *installation*: the receiver
only accepts notifications for tickets it issued itself, signed for its
endpoint id with the shared secret, before their deadline, with a checksum
signed for that ticket (required unless ``require_checksum`` is off) that
matches the pages. Anything else is reported by ``rejected()``, and if
it names a ticket this receiver issued, that ticket is closed and its reserved
pages are zeroed (the data is discarded, never installed). Endpoints are
signed too, and must travel only between Nibble workers. A write still in
flight when its ticket expires can land after the pages were zeroed, so a
worker should keep the pages of an expired NIXL ticket out of use until the
sender's poll has failed or ``grace_s`` more has passed.

Options: ``secret``, ``grace_s`` (see KVTransport), ``backends`` (default
``["UCX"]``; only UCX and POSIX start without a GPU), ``num_threads``,
``progress_delay`` (NIXL's ``pthrDelay``, default 100), ``coalesce`` (one
descriptor per run, default True). NIXL's Python wrapper
hard-codes 0, which makes the UCX progress thread busy-spin a whole core per
agent even when idle; a positive value lets it wait for events instead. On a
2-core loopback test 64 MiB WRITEs were as fast or faster with 100 (15-21 ms
against 16-23 ms) and an idle agent's CPU fell from a full core to ~1%.
0 restores NIXL's default.
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..page_runs import merge_runs
from .base import KVTransport, TransferHandle, TransferState, TransferStatus, register_transport
from .checksum import page_set_checksum
from .endpoint import Endpoint
from .errors import TicketError, TransferArgumentError, TransportUnavailableError
from .tickets import RejectReason, TransferTicket

log = logging.getLogger(__name__)
_NOTIF_MAGIC = b"NBKV1"
NIXL_MODULES = ("nixl", "nixl_cu13._api", "nixl_cu12._api")


def load_nixl() -> Any:
    """NIXL's Python API: the ``nixl`` meta package, else a CUDA-variant wheel's ``_api``."""
    errors = []
    for name in NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if hasattr(mod, "nixl_agent"):
            if logging.getLogger("nixl").level == logging.INFO:
                logging.getLogger("nixl").setLevel(logging.WARNING)  # one INFO line per agent
            return mod
        errors.append(f"{name}: no nixl_agent")
    raise TransportUnavailableError("NIXL is not importable (" + "; ".join(errors) + ")")


_AGENT_LOCK = threading.Lock()


def _make_agent(mod: Any, name: str, conf: Any, progress_delay: int) -> Any:
    """``mod.nixl_agent(name, conf)`` with the progress thread's ``pthrDelay`` set.

    The wrapper builds its ``nixlAgentConfig`` internally and pins ``pthrDelay``
    to 0, so the binding's agent constructor is wrapped for the duration of
    this call (serialized by a lock) to set it.
    """
    binds = getattr(mod, "nixlBind", None)
    real = getattr(binds, "nixlAgent", None)
    if not progress_delay or real is None:
        return mod.nixl_agent(name, conf)

    def with_delay(agent_name, agent_config):
        agent_config.pthrDelay = int(progress_delay)
        return real(agent_name, agent_config)
    with _AGENT_LOCK:
        binds.nixlAgent = with_delay
        try:
            return mod.nixl_agent(name, conf)
        finally:
            binds.nixlAgent = real


def _nixl_errors(mod: Any) -> tuple[type[BaseException], ...]:
    binds = getattr(mod, "nixlBind", None) or importlib.import_module(
        mod.nixl_agent.__module__.rsplit(".", 1)[0] + "._bindings")
    found = [v for v in vars(binds).values() if isinstance(v, type) and issubclass(v, Exception)]
    return tuple(found) + (RuntimeError,)


def encode_notif(ticket: TransferTicket, checksum: str | None, tag: bytes = b"") -> bytes:
    return _NOTIF_MAGIC + json.dumps({
        "request_id": ticket.request_id, "ticket_id": ticket.ticket_id,
        "dst_pages": list(ticket.dst_pages), "page_nbytes": ticket.page_nbytes,
        "deadline": ticket.deadline, "signature": ticket.signature.hex(),
        "checksum": checksum, "checksum_tag": tag.hex()}, separators=(",", ":")).encode()


def decode_notif(msg: bytes) -> tuple[TransferTicket, str | None, bytes]:
    """The ticket, checksum and checksum tag of a completion notification; raises
    TicketError(INVALID)."""
    if not msg.startswith(_NOTIF_MAGIC):
        raise TicketError(RejectReason.INVALID, "not a Nibble completion notification")
    try:
        d = json.loads(msg[len(_NOTIF_MAGIC):])
        ticket = TransferTicket(str(d["request_id"]), str(d["ticket_id"]),
                                tuple(int(p) for p in d["dst_pages"]), int(d["page_nbytes"]),
                                float(d["deadline"]), bytes.fromhex(d["signature"]))
        return (ticket, (str(d["checksum"]) if d.get("checksum") else None),
                bytes.fromhex(str(d.get("checksum_tag") or "")))
    except (ValueError, KeyError, TypeError) as e:
        raise TicketError(RejectReason.INVALID, f"unreadable notification: {e}") from None


@dataclass
class _Peer:
    agent_name: str
    dlist: Any  # prepped per-page descriptor list of the peer's pool
    addr: int = 0
    dev: int = 0
    mem: str = "DRAM"


def run_descs(runs: np.ndarray, base: int, page_nbytes: int, dev: int) -> np.ndarray:
    """``[num_runs, 3]`` uint64 rows ``(address, bytes, device)`` for ``runs``: int64
    ``[num_runs, 2]`` of ``(first page, num_pages)`` in a pool at ``base``."""
    descs = np.empty((len(runs), 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base) + runs[:, 0].astype(np.uint64) * np.uint64(page_nbytes)
    descs[:, 1] = runs[:, 1].astype(np.uint64) * np.uint64(page_nbytes)
    descs[:, 2] = dev
    return descs


@register_transport("nixl")
class NixlTransport(KVTransport):
    """KV pages by NIXL WRITE (see the module docstring for options and the security model)."""

    def __init__(self, *, secret: bytes | str | None = None, grace_s: float = 2.0,
                 require_checksum: bool = True, backends: Sequence[str] = ("UCX",),
                 num_threads: int = 0, progress_delay: int = 100, coalesce: bool = True):
        super().__init__(secret=secret, grace_s=grace_s, require_checksum=require_checksum)
        self.coalesce = bool(coalesce)
        self._nixl = load_nixl()
        self._errors = _nixl_errors(self._nixl)
        self._lock = threading.RLock()  # agent calls are not thread safe in NIXL's default mode
        self._peers: dict[str, _Peer] = {}
        self._reg = self._local = None
        try:
            conf = self._nixl.nixl_agent_config(backends=list(backends), num_threads=num_threads)
            self._agent = _make_agent(self._nixl, self._endpoint_id, conf, progress_delay)
        except self._errors as e:
            raise TransportUnavailableError(f"NIXL agent failed to start: {e}") from None
        if not self._agent.backends:
            raise TransportUnavailableError(f"no NIXL backend of {list(backends)} started here")

    def _page_descs(self, base: int, dev: int, num_pages: int) -> np.ndarray:
        """``[num_pages, 3]`` uint64 rows ``(address, page_nbytes, device)``, one per page."""
        descs = np.empty((num_pages, 3), dtype=np.uint64)
        descs[:, 0] = base + np.arange(num_pages, dtype=np.uint64) * np.uint64(self.page_nbytes)
        descs[:, 1], descs[:, 2] = self.page_nbytes, dev
        return descs

    def _attach(self, pool_pages: torch.Tensor) -> None:
        self._mem = "VRAM" if pool_pages.is_cuda else "DRAM"
        self._dev = pool_pages.get_device() if pool_pages.is_cuda else 0
        try:
            with self._lock:
                self._reg = self._agent.register_memory(pool_pages)
                self._local = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", self._page_descs(pool_pages.data_ptr(), self._dev,
                                                        self.num_pages), self._mem)
        except self._errors as e:
            raise TransportUnavailableError(f"NIXL could not register the pool: {e}") from None

    def endpoint(self) -> bytes:
        if self._reg is None:
            raise TransferArgumentError("attach(pool) first")
        with self._lock:
            meta = self._agent.get_agent_metadata()
        return Endpoint(self.name, self._endpoint_id, self.num_pages, self.page_nbytes,
                        {"addr": self.pool.data_ptr(), "mem": self._mem, "dev": self._dev},
                        meta).encode(self.secret)

    def _remote(self, peer: Endpoint) -> _Peer:
        """Load a peer's metadata and prepare its page descriptors once (lock held)."""
        if peer.endpoint_id not in self._peers:
            name = self._agent.add_remote_agent(peer.blob)
            name = name.decode() if isinstance(name, bytes) else name
            descs = self._page_descs(int(peer.fields["addr"]), int(peer.fields["dev"]),
                                     peer.num_pages)
            try:
                dlist = self._agent.prep_xfer_dlist(name, descs, str(peer.fields["mem"]))
            except self._errors:
                self._agent.remove_remote_agent(name)
                raise
            self._peers[peer.endpoint_id] = _Peer(name, dlist, int(peer.fields["addr"]),
                                                  int(peer.fields["dev"]),
                                                  str(peer.fields["mem"]))
        return self._peers[peer.endpoint_id]

    def write_pages(self, peer_endpoint: bytes, ticket: TransferTicket, src_pages: Sequence[int],
                    checksum: str | None = None) -> TransferHandle:
        peer, src, handle = self._start(peer_endpoint, ticket, src_pages)
        checksum, tag = self._seal(ticket, src, checksum)
        notif = encode_notif(ticket, checksum, tag)
        try:
            with self._lock:
                remote = self._remote(peer)
                handle.impl, handle.descriptors = self._make_xfer(remote, src, ticket, notif)
                state = self._agent.transfer(handle.impl)
        except self._errors as e:
            state = f"{type(e).__name__}: {e}"
        return self._settle(handle, state)

    def _make_xfer(self, remote: _Peer, src: list[int], ticket: TransferTicket, notif: bytes
                   ) -> tuple[Any, int]:
        """The WRITE request and its descriptor count: one per run (``coalesce``), else one
        prepped descriptor per page (lock held)."""
        if not self.coalesce:
            return self._agent.make_prepped_xfer(
                "WRITE", self._local, np.asarray(src, dtype=np.int32), remote.dlist,
                np.asarray(ticket.dst_pages, dtype=np.int32), notif_msg=notif), len(src)
        runs = np.asarray(merge_runs(src, ticket.dst_pages), dtype=np.int64).reshape(-1, 3)
        pn = self.page_nbytes
        local = self._agent.get_xfer_descs(
            run_descs(runs[:, [0, 2]], self.pool.data_ptr(), pn, self._dev), self._mem)
        far = self._agent.get_xfer_descs(
            run_descs(runs[:, [1, 2]], remote.addr, pn, remote.dev), remote.mem)
        return self._agent.initialize_xfer("WRITE", local, far, remote.agent_name,
                                           notif_msg=notif), len(runs)

    def _settle(self, handle: TransferHandle, state: str) -> TransferHandle:
        """Finish ``handle`` on DONE/ERR (releasing NIXL's request); PROC leaves it running."""
        if state == "PROC":
            return handle
        if state == "DONE":
            handle.finish(TransferState.SUCCESS)
        else:
            handle.finish(TransferState.FAILED, "NIXL transfer failed" if state == "ERR" else state)
        self._release(handle)
        return handle

    def _release(self, handle: TransferHandle) -> None:
        if handle.impl is None:
            return
        try:
            with self._lock:
                handle.impl.release()
        except self._errors as e:  # an active request NIXL could not cancel; it frees it later
            log.warning("could not release NIXL transfer %s: %s", handle.ticket.ticket_id, e)
        handle.impl = None

    def poll(self, handle: TransferHandle) -> TransferStatus:
        if handle.final is not None:
            return handle.final
        try:
            with self._lock:
                state = self._agent.check_xfer_state(handle.impl)
        except self._errors as e:
            state = f"{type(e).__name__}: {e}"
        if state == "PROC" and time.monotonic() > handle.give_up_at:
            state = "no completion before the ticket deadline"
        return self._settle(handle, state).status()

    def cancel(self, handle: TransferHandle) -> TransferStatus:
        status = super().cancel(handle)
        self._release(handle)
        return status

    # -- receiving -------------------------------------------------------------------------
    def _pump(self) -> None:
        if self._reg is not None:
            with self._lock:
                notifs = self._agent.get_new_notifs()
            for msgs in notifs.values():
                for msg in msgs:
                    self._on_notif(bytes(msg))
        super()._pump()

    def _on_notif(self, msg: bytes) -> None:
        book = self.book
        try:
            ticket, checksum, tag = decode_notif(msg)
        except TicketError as e:
            book.refuse("", "", RejectReason.INVALID, e.detail)
            return
        try:
            book.admit(ticket, close_on_refusal=True)  # data may have landed: discard it
        except TicketError:
            return  # recorded by the book
        refusal = self._check_seal(ticket, checksum, tag)
        if refusal is not None:
            book.close(ticket.ticket_id, RejectReason(refusal.reason), refusal.detail)
            return
        if checksum and page_set_checksum(self.pool, ticket.dst_pages) != checksum:
            book.close(ticket.ticket_id, RejectReason.CHECKSUM, "page-set checksum mismatch")
            return
        book.complete(ticket.ticket_id, ticket.nbytes, checksum)

    def close(self) -> None:
        agent = getattr(self, "_agent", None)
        if agent is None:
            return
        with self._lock:
            for peer in self._peers.values():
                self._quietly(peer.dlist.release)
                self._quietly(agent.remove_remote_agent, peer.agent_name)
            self._peers.clear()
            if self._local is not None:
                self._quietly(self._local.release)
            if self._reg is not None:
                self._quietly(agent.deregister_memory, self._reg)
            self._local = self._reg = self._agent = None

    def _quietly(self, fn, *args) -> None:
        try:
            fn(*args)
        except self._errors as e:
            log.warning("NIXL cleanup step %s failed: %s", getattr(fn, "__name__", fn), e)
