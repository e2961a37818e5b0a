"""A receiving peer in a child process, driven over a pipe: transport tests and benchmarks.

``LoopbackPeer({"nvfp4": PoolSpec("grpc", layout, 64)}, secret)`` spawns a
process (the ``spawn`` start method: no inherited NIXL/UCX or gRPC state)
that builds one zeroed ``KVPool`` and one attached transport per key, then
answers ``call(command, key, *args)``:

* ``issue(request_id, dst_pages, ttl_s)`` -> TransferTicket
* ``wait(ticket_id, timeout_s)`` -> the CompletedTransfer or RejectedTransfer
  of that ticket, or None (events are kept until ``zero``)
* ``events()`` -> (received, rejected) so far
* ``checksum(pages)`` -> page_set_checksum of the peer's pages
* ``nonzero_pages()`` -> ids of pages holding any non-zero byte
* ``zero()`` -> zero the pool and forget past events

Errors inside the child come back as TransferError (TransportUnavailableError
when the transport cannot start there). Loopback only: nothing leaves the host.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any

from nibble.kernels import PageLayout

from .errors import TransferError, TransportUnavailableError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSpec:
    transport: str
    layout: PageLayout
    num_pages: int
    opts: dict = field(default_factory=dict)
    device: str = "cpu"             # where the peer's pool lives ("cuda:1": VRAM on GPU 1)


class _Worker:
    def __init__(self, spec: PoolSpec, secret: bytes):
        from nibble.tiering import KVPool

        from .base import create_transport
        self.pool = KVPool(spec.layout, spec.num_pages, spec.device)
        self.transport = create_transport(spec.transport, secret=secret, **spec.opts)
        self.transport.attach(self.pool.pages)
        self.events: list[Any] = []

    def _collect(self) -> None:
        self.events += self.transport.received()
        self.events += self.transport.rejected()

    def issue(self, request_id: str, dst_pages: list[int], ttl_s: float):
        return self.transport.issue_ticket(request_id, dst_pages, ttl_s)

    def wait(self, ticket_id: str, timeout_s: float):
        end = time.monotonic() + timeout_s
        while True:
            self._collect()
            hit = next((e for e in self.events if e.ticket_id == ticket_id), None)
            if hit is not None or time.monotonic() > end:
                return hit
            time.sleep(0.001)

    def events_(self):
        self._collect()
        return ([e for e in self.events if not hasattr(e, "reason")],
                [e for e in self.events if hasattr(e, "reason")])

    def checksum(self, pages: list[int]) -> str:
        from .checksum import page_set_checksum
        return page_set_checksum(self.pool.pages, pages)

    def nonzero_pages(self) -> list[int]:
        return self.pool.pages.flatten(1).any(dim=1).nonzero().flatten().tolist()

    def zero(self) -> None:
        self._collect()
        self.pool.pages.zero_()
        self.events.clear()


def _serve(conn, secret: bytes, specs: dict[str, PoolSpec]) -> None:
    """Child process main loop."""
    workers: dict[str, _Worker] = {}
    try:
        for key, spec in specs.items():
            workers[key] = _Worker(spec, secret)
        conn.send(("ok", {k: w.transport.endpoint() for k, w in workers.items()}))
    except Exception as e:  # reported to the parent, which raises it
        conn.send(("unavailable" if isinstance(e, TransportUnavailableError) else "err",
                   f"{type(e).__name__}: {e}"))
        return
    try:
        while True:
            cmd, key, args = conn.recv()
            if cmd == "exit":
                break
            try:
                w = workers[key]
                fn = w.events_ if cmd == "events" else getattr(w, cmd)
                conn.send(("ok", fn(*args)))
            except Exception as e:  # reported to the parent, which raises it
                conn.send(("err", f"{type(e).__name__}: {e}"))
    finally:
        for w in workers.values():
            w.transport.close()


class LoopbackPeer:
    """The parent's side of a spawned receiving peer (see the module docstring)."""

    def __init__(self, specs: dict[str, PoolSpec], secret: bytes, start_timeout_s: float = 60):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, secret, specs), daemon=True,
                                name="nibble-kv-peer")
        self.proc.start()
        child.close()
        self.endpoints: dict[str, bytes] = self._answer(start_timeout_s)

    def _answer(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            self.kill()
            raise TransferError(f"loopback peer did not answer within {timeout_s} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise TransferError(f"loopback peer exited ({self.proc.exitcode})") from None
        if kind == "unavailable":
            raise TransportUnavailableError(value)
        if kind == "err":
            raise TransferError(f"loopback peer: {value}")
        return value

    def call(self, cmd: str, key: str, *args, timeout_s: float = 30) -> Any:
        self._conn.send((cmd, key, args))
        return self._answer(timeout_s)

    def kill(self) -> None:
        """SIGKILL the peer (a worker dying without cleanup)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("exit", "", ()))
                self.proc.join(5)
            except (BrokenPipeError, OSError) as e:
                log.debug("loopback peer already gone: %s", e)
        self.kill()
        self._conn.close()

    def __enter__(self) -> "LoopbackPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
