"""A Nibble engine inside a Ray actor: one class, two roles (prefill, decode).

The actor owns an ``AsyncEngine`` (engine thread + KV pool) and a KV transport
attached to that pool. Decode role: ``reserve`` pages under a lease, ``decode``
(verify the received pages, install, stream tokens), ``generate`` (plain
colocated generation: skipped prefill or recompute). Prefill role: ``prefill``
(compute the prompt, write its pages into the decode worker's reservation,
return the first token, the page-set checksum and the checksum tag that binds
it to the ticket).

Tensor parallel (``--tp-size N``): the actor is rank 0 of its worker's group, in bundle 0 of
the worker's STRICT_PACK placement group; it starts ranks 1.. as Ray actors in bundles 1..
(``services/parallel/ray_group.py`` says why) and owns them, so they die with it; a follower
that dies breaks the group, so the actor exits and Ray restarts the whole group. Without a
placement group (``placement=None``) the followers are local processes (``launch.py``). Each
rank's pages go to the same rank of the decode group (``rank_transfer.py``).

The transfer key is derived from the deployment's KV secret, which every
worker loads from ``--kv-secret-file`` (on a local cluster the gateway writes a
private file for it) or ``$NIBBLE_KV_SECRET``; it never travels in a Ray
runtime environment, whose contents land in Ray's logs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from typing import Callable

from nibble.tiering.transfer import (TransferTicket, checksum_tag, create_transport,
                                     page_set_checksum, verify_checksum_tag)
from nibble.tiering.transfer.grpc_transport import is_loopback

from ..config import DisaggConfig, NibbleConfig
from ..credentials import load_kv_secret
from ..engine.async_engine import AsyncEngine
from ..engine.builder import build_parts
from ..engine.kv_connector import KVConnector
from ..engine.types import GenerateRequest, RequestOutput, TokenLogprob
from ..errors import ConfigError, EngineDeadError
from .exit_gate import ExitGate, serving
from .rank_transfer import RankTransfers, group_checksum
from .transfer_state import TransferError

log = logging.getLogger(__name__)
_WILDCARDS = ("0.0.0.0", "::", "[::]", "")
DEVICE_FAULT_EXIT_CODE = 70        # EX_SOFTWARE: the engine is unusable, restart the process


def _ray_node_ip() -> str:
    import ray
    return ray.util.get_node_ip_address()


def transport_options(d: DisaggConfig, transfer_key: bytes,
                      node_ip: Callable[[], str] = _ray_node_ip) -> dict:
    """The worker's KV-transport options: the transfer key, and for gRPC where to listen.

    gRPC binds ``--kv-transfer-host`` if given, else loopback on a local
    cluster (no ``--ray-address``: every worker is on this host) and this
    node's Ray address on a joined one. A local cluster refuses any other
    interface. ``--kv-transfer-ssl-*`` turn on mutual TLS (all three needed).
    Raises ConfigError for a combination that cannot work.
    """
    opts: dict = {"secret": transfer_key}
    tls = (d.kv_transfer_ssl_certfile, d.kv_transfer_ssl_keyfile, d.kv_transfer_ssl_ca_certs)
    if d.kv_transport != "grpc":
        if any(tls):
            raise ConfigError(f"--kv-transfer-ssl-* secure the grpc transport; the "
                              f"{d.kv_transport} transport (RDMA) has no TLS")
        if d.kv_transfer_host:
            log.warning("--kv-transfer-host applies to the grpc transport; %s picks its own "
                        "interfaces", d.kv_transport)
        return opts
    local = d.ray_address is None
    host = d.kv_transfer_host or ("127.0.0.1" if local else node_ip())
    if local and not is_loopback(host):
        raise ConfigError(f"--kv-transfer-host {host}: without --ray-address every worker runs "
                          f"on this host and the transfer ports stay on loopback")
    opts["address"] = f"[{host}]:0" if ":" in host.strip("[]") else f"{host}:0"
    opts["loopback_only"] = local
    if host in _WILDCARDS:
        opts["advertise_host"] = node_ip()
    if any(tls):
        if not all(tls):
            raise ConfigError("TLS on the KV-transfer channel is mutual: give "
                              "--kv-transfer-ssl-certfile, --kv-transfer-ssl-keyfile and "
                              "--kv-transfer-ssl-ca-certs together")
        opts.update(ssl_certfile=tls[0], ssl_keyfile=tls[1], ssl_ca_certs=tls[2])
    return opts


def worker_transfer_key(cfg: NibbleConfig) -> bytes:
    """The transfer key from the deployment secret this worker can read; ConfigError if none."""
    secret = load_kv_secret(cfg.cache.kv_secret_file)
    if secret is None:
        raise ConfigError("no KV secret reached this worker: give --kv-secret-file with a path "
                          "readable on every node, or set $NIBBLE_KV_SECRET in every node's "
                          "environment")
    return secret.derive("transfer")


def check_transfer(key: bytes, ticket: TransferTicket, checksum: str, tag: bytes,
                   received: str) -> None:
    """Decode side: ``checksum`` is signed for ``ticket`` and equals the ``received`` pages'.

    Raises TransferError (retryable by recompute) otherwise.
    """
    if not verify_checksum_tag(key, ticket, checksum, tag):
        raise TransferError(f"{ticket.request_id}: the page-set checksum is not signed for "
                            f"ticket {ticket.ticket_id}")
    if received != checksum:
        raise TransferError(f"{ticket.request_id}: page checksum mismatch after transfer")


class EngineWorker:
    """Plain class; ``make_worker_class`` wraps it with ``ray.remote``."""

    def __init__(self, cfg: NibbleConfig, role: str, worker_id: str,
                 placement: tuple | None = None):
        """``placement``: (placement group, CPUs, GPUs per rank) of a tensor-parallel worker
        whose followers run as Ray actors in that group's bundles 1.. (ray_group.py); None:
        TP=1, or followers as local processes (launch.py)."""
        logging.basicConfig(level=cfg.server.log_level.upper())
        self.cfg, self.role, self.worker_id = cfg, role, worker_id
        self.transfer_key = worker_transfer_key(cfg)
        start = None
        if placement is not None and cfg.device.tp_size > 1:
            from ..parallel.ray_group import start_ray_group
            start = functools.partial(start_ray_group, pg=placement[0], num_cpus=placement[1],
                                      num_gpus=placement[2])
        parts = build_parts(cfg, start)
        self.follower_pids = list(parts.follower_pids)
        self.connector = KVConnector()            # reservations, leases, held pages
        parts.core.attach_connector(self.connector)
        self.connector.on_release = self._revoke
        self.engine = AsyncEngine(parts, cfg)
        self.pool = parts.core.pool
        self.transport = create_transport(cfg.disagg.kv_transport, **transport_options(
            cfg.disagg, self.transfer_key))
        self.transport.attach(self.pool.pages)
        self.tp = parts.core.runner.tp          # tensor parallel: this actor is rank 0
        self.ranks = RankTransfers(self.tp, self.pool.pages) if self.tp.size > 1 else None
        self.incarnation = os.urandom(8).hex()    # changes when Ray restarts the actor
        self._tickets: dict[str, str] = {}        # request id -> open transfer ticket id
        self.gate = ExitGate(DEVICE_FAULT_EXIT_CODE)   # exits only once in-flight calls answered
        log.info("%s worker %s ready (%s transport)", role, worker_id, cfg.disagg.kv_transport)

    # ---- identity and state ----
    async def info(self) -> dict:
        lay = self.pool.layout
        return {"worker_id": self.worker_id, "role": self.role, "pid": os.getpid(),
                "endpoint": self.transport.endpoint(), "fingerprint": self.engine.parts.fingerprint,
                "layout": dataclasses.asdict(lay), "recipe": self.pool.recipe_digest,
                "context_length": self.engine.context_length,
                "model_name": self.engine.model_name}

    async def stats(self) -> dict:
        """Gauges for the router's poll. A worker whose engine died of a device fault raises
        EngineDeadError here (the router routes around it) and exits (non-zero, so Ray
        restarts the actor on a fresh device context) once every call in flight has
        answered: the call that hit the fault reports its cause (exit_gate.py)."""
        if not self.engine.is_healthy():
            why = f"worker {self.worker_id}: {self.engine.dead_reason or 'engine thread gone'}"
            self.gate.request_exit(why)
            raise EngineDeadError(f"{why}; restarting")
        s = self.engine.core.stats()
        s["free_pages"] = self.pool.allocator.num_free
        s["total_pages"] = self.pool.num_pages
        s.update(self.connector.stats())
        s["incarnation"] = self.incarnation
        s["pid"] = os.getpid()             # for operators (and the soak bench's worker kill)
        s["tp_follower_pids"] = self.follower_pids
        s["transfers_received"] = len(self.transport.received())   # drained each poll
        s["transfers_rejected"] = len(self.transport.rejected())
        return s

    async def kv_events(self, since: int) -> dict:
        return await self.engine.kv_events(since)

    async def flush_cache(self) -> bool:
        return await self.engine.flush_cache()

    @serving
    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)
        await self.engine.call(self.connector.cancel, request_id)
        await self.engine.call(self.connector.release_held, request_id)

    async def abort_all(self) -> int:
        return await self.engine.abort_all()

    # ---- decode role ----
    @serving
    async def reserve(self, req: GenerateRequest, lease_s: float, deadline_s: float) -> dict:
        """Reserve pages for ``req``'s prompt; returns a signed ticket for the prefill worker."""
        res = await self.engine.call(self.connector.reserve, req, lease_s)
        ticket = self.transport.issue_ticket(req.request_id, list(res.new_pages), deadline_s)
        self._tickets[req.request_id] = ticket.ticket_id
        peers = None
        if self.ranks is not None:          # the same pages on every rank: a ticket each
            peers = await self.engine.call(self.ranks.expect, req.request_id,
                                           list(res.new_pages), deadline_s)
        return {"ticket": ticket, "prefix_pages": len(res.prefix_pages),
                "endpoint": self.transport.endpoint(), "rank_peers": peers}

    def _revoke(self, request_id: str) -> None:
        """Engine thread, before a reservation's pages are freed: refuse late writes."""
        ticket_id = self._tickets.pop(request_id, None)
        if ticket_id is not None:
            self.transport.revoke(ticket_id)
            if self.ranks is not None:
                self.ranks.close(request_id, consumed=False)

    @serving
    async def extend_lease(self, request_id: str, lease_s: float) -> bool:
        return await self.engine.call(self.connector.extend, request_id, lease_s)

    @serving
    async def cancel(self, request_id: str) -> bool:
        return await self.engine.call(self.connector.cancel, request_id)

    @serving
    async def decode(self, req: GenerateRequest, ticket: TransferTicket, first_token: int,
                     checksum: str, tag: bytes, first_logprob: TokenLogprob | None = None):
        """Verify the pages the prefill worker wrote, then stream the rest of the request.

        The transport already refused writes without a ticket this worker issued;
        ``tag`` proves the prefill worker signed ``checksum`` for this ticket, and
        the checksum that the reserved pages hold exactly what it sent.
        """
        if not await self.engine.call(self.connector.has_reservation, req.request_id):
            # retryable: the orchestrator recomputes instead of failing the request
            raise TransferError(f"{req.request_id}: the reservation expired before install")
        got = await self._received_checksum(req.request_id, list(ticket.dst_pages))
        try:
            check_transfer(self.transfer_key, ticket, checksum, tag, got)
        except TransferError:
            await self.cancel(req.request_id)
            raise
        self._tickets.pop(req.request_id, None)          # complete: nothing left to revoke
        self.transport.consume(ticket.ticket_id, ticket.nbytes)
        if self.ranks is not None:
            await self.engine.call(self.ranks.close, req.request_id, True)
        async for out in self.engine.generate_prefilled(req, first_token, first_logprob):
            yield out

    async def _received_checksum(self, request_id: str, pages: list[int]) -> str:
        """The checksum of ``pages`` as they landed: this pool's, or under tensor parallelism
        the group checksum over every rank's pool (rank_transfer.py)."""
        if self.ranks is None:
            return await asyncio.to_thread(page_set_checksum, self.pool.pages, pages)
        return await self.engine.call(self.ranks.checksum, request_id, pages)

    @serving
    async def generate(self, req: GenerateRequest):
        """Colocated generation on this worker (skipped prefill, or recompute after a failure)."""
        async for out in self.engine.generate(req):
            yield out

    # ---- prefill role ----
    @serving
    async def prefill(self, req: GenerateRequest, ticket: TransferTicket, prefix_pages: int,
                      peer_endpoint: bytes, rank_peers: list | None = None) -> dict:
        """Compute ``req``'s prompt, write pages ``prefix_pages..`` into the reservation.

        Tensor parallel: ``rank_peers`` are the decode ranks 1..'s (ticket, endpoint); each
        follower writes its own pages to its peer, and the checksum returned (and signed for
        ``ticket``) is the group checksum over every rank's pages."""
        pre = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, max_tokens=1),
                                  hold_pages=True)
        first: RequestOutput | None = None
        async for out in self.engine.generate(pre):
            first = out if out.new_token_ids else first
            if out.error:
                raise TransferError(f"prefill of {req.request_id} failed: {out.error}")
        if first is None:
            raise TransferError(f"prefill of {req.request_id} produced no token")
        try:
            held = await self.engine.call(self.connector.held_pages, req.request_id)
            if held is None:
                raise TransferError(f"{req.request_id}: the prefill kept no pages")
            pages, _ = held
            src = pages[prefix_pages:prefix_pages + len(ticket.dst_pages)]
            if len(src) != len(ticket.dst_pages):
                raise TransferError(f"{req.request_id}: {len(src)} pages for "
                                    f"{len(ticket.dst_pages)} reserved")
            checksum = await asyncio.to_thread(page_set_checksum, self.pool.pages, src)
            nbytes = len(src) * self.pool.layout.page_nbytes
            if self.ranks is None:
                await self._send(peer_endpoint, ticket, src, checksum)
            else:                # every rank pair at once; the followers' on the engine thread
                if rank_peers is None:
                    raise TransferError(f"{req.request_id}: a tensor-parallel prefill needs "
                                        f"the decode group's per-rank tickets")
                theirs, _ = await asyncio.gather(
                    self.engine.call(self.ranks.send, req.request_id, rank_peers, src),
                    self._send(peer_endpoint, ticket, src, checksum))
                checksum = group_checksum([checksum, *theirs])
                nbytes += sum(t.nbytes for t, _ in rank_peers)
            return {"first_token": first.new_token_ids[0], "checksum": checksum,
                    "first_logprob": (first.logprobs or [None])[0],
                    "checksum_tag": checksum_tag(self.transfer_key, ticket, checksum),
                    "nbytes": nbytes, "pages": len(src)}
        finally:
            await self.engine.call(self.connector.release_held, req.request_id)

    async def _send(self, peer_endpoint: bytes, ticket: TransferTicket, src: list[int],
                    checksum: str) -> None:
        handle = self.transport.write_pages(peer_endpoint, ticket, src, checksum=checksum)
        while True:
            status = self.transport.poll(handle)
            if status.state == "success":
                return
            if status.state == "failed":
                raise TransferError(f"{ticket.request_id}: transfer failed: {status.error}")
            if time.time() > ticket.deadline:
                raise TransferError(f"{ticket.request_id}: transfer missed its deadline")
            await asyncio.sleep(0.001)


def make_worker_class(role: str, num_gpus: float, num_cpus: float):
    """``ray.remote`` classes named PrefillWorker / DecodeWorker for the dashboard.

    Where the cluster's nodes advertise ``nibble_prefill`` / ``nibble_decode`` resources
    (the Helm chart's worker groups), each actor asks for one, so roles land on their
    own nodes.
    """
    import ray

    name = {"prefill": "PrefillWorker", "decode": "DecodeWorker"}[role]
    cls = type(name, (EngineWorker,), {})
    custom = f"nibble_{role}"
    resources = {custom: 1} if custom in ray.cluster_resources() else None
    return ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, resources=resources,
                      max_restarts=-1, max_task_retries=0)(cls)
