"""The router actor: picks workers, drives each transfer's state machine, survives worker death.

For every request: choose a decode worker (cache-aware) and, unless the decode
worker already holds the prompt, a prefill worker; reserve the decode pages
(BOOTSTRAPPING), run the prefill that writes them (TRANSFERRING, with lease
heartbeats and a deadline), then stream decode (SUCCESS). Any failure releases
the reservation (FAILED) and, under ``--kv-transfer-failure-policy recompute``,
the request runs on a live decode worker instead. A decode worker dying
mid-stream is recovered the same way: the prompt plus the tokens already sent
are recomputed elsewhere and the stream continues.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time

import ray
from ray.exceptions import RayActorError, RayTaskError

from nibble.kernels import PageLayout

from ..config import NibbleConfig
from ..credentials import KV_SECRET_ENV, load_kv_secret
from ..errors import ConfigError
from ..engine.types import FinishReason, GenerateRequest, RequestOutput, Usage
from .metrics import RayMetrics
from .router import Router
from .transfer_state import Transfer, TransferError, TransferState

log = logging.getLogger(__name__)
POLL_S = 0.2
WORKER_ERRORS = (RayActorError, RayTaskError, TransferError, asyncio.TimeoutError)


def check_same_kv_identity(infos: list[dict]) -> None:
    """Workers exchange raw pages: they must agree on model, layout and K-recipe parameters.

    Raises:
        ConfigError: naming the first worker that differs from the first one.
    """
    first = infos[0]
    for info in infos[1:]:
        for key in ("fingerprint", "layout", "recipe"):
            if info.get(key) != first.get(key):
                raise ConfigError(
                    f"worker {info['worker_id']} has {key} {info.get(key)!r}, worker "
                    f"{first['worker_id']} has {first.get(key)!r}: their KV pages are not "
                    f"interchangeable (same weights, dtype, device kind and --kv-cache-dtype "
                    f"give the same K-recipe calibration)")


class Orchestrator:
    def __init__(self, cfg: NibbleConfig, workers: dict[str, str]):
        logging.basicConfig(level=cfg.server.log_level.upper())
        self.cfg, self.dcfg = cfg, cfg.disagg
        self.roles = dict(workers)                       # actor name -> role
        self.alive: dict[str, object] = {}               # actor name -> handle
        self.router: Router | None = None
        self.page_size = cfg.cache.page_size
        self.transfers: collections.deque[Transfer] = collections.deque(maxlen=1000)
        self.counts = collections.Counter()
        self.inflight: dict[str, set[str]] = {}          # request id -> workers serving it
        self.aborted: set[str] = set()                   # in flight, aborted by the client
        self.metrics = RayMetrics()
        self._poller: asyncio.Task | None = None
        self._incarnation: dict[str, str] = {}

    async def start(self) -> dict:
        infos = await asyncio.gather(*(ray.get_actor(n).info.remote() for n in self.roles))
        first = infos[0]
        check_same_kv_identity(infos)
        secret = load_kv_secret(self.cfg.cache.kv_secret_file)
        if secret is None:       # the gateway hands one to every actor (secret_handoff)
            raise ConfigError(f"no KV secret reached the router: give --kv-secret-file or "
                              f"${KV_SECRET_ENV} (the router keys pages like the workers)")
        self.router = Router.for_model(first["fingerprint"], PageLayout(**first["layout"]),
                                       recipe=first.get("recipe", ""), secret=secret)
        for name in self.roles:
            self._add(name)
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
        return {"model_name": first["model_name"], "context_length": first["context_length"]}

    def _add(self, name: str) -> None:
        self.alive[name] = ray.get_actor(name)
        self.router.add_worker(name, self.roles[name])

    def _dead(self, name: str, err: BaseException) -> None:
        if self.alive.pop(name, None) is not None:
            log.warning("worker %s is unavailable (%s); routing around it", name, type(err).__name__)
            self.router.remove_worker(name)
            self.counts["worker_failures"] += 1

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(n) for n in self.roles), return_exceptions=True)
            self.metrics.export(self)
            await asyncio.sleep(POLL_S)

    async def _poll(self, name: str) -> None:
        handle = self.alive.get(name) or ray.get_actor(name)
        try:
            stats, events = await asyncio.wait_for(asyncio.gather(
                handle.stats.remote(),
                handle.kv_events.remote(self.router.last_seq(name) if name in self.alive else 0)),
                timeout=5)
        except (*WORKER_ERRORS, ValueError) as e:
            self._dead(name, e)
            return
        known = self._incarnation.get(name)
        self._incarnation[name] = stats["incarnation"]
        if name not in self.alive or (known and known != stats["incarnation"]):
            log.info("worker %s is (back) up; starting its cache view afresh", name)
            self._add(name)                              # restarted by Ray: a fresh, empty view
            return
        self.router.update_load(name, stats["num_running"], stats["num_queued"],
                                stats["token_usage"])
        self.router.apply_poll(name, events)

    # ---- serving ----
    async def generate(self, req: GenerateRequest):
        """Stream ``RequestOutput``s for ``req`` (a Ray streaming generator)."""
        self.inflight[req.request_id] = set()
        sent: list[int] = []
        try:
            async for out in self._serve(req, sent):
                sent += out.new_token_ids
                yield out
                if out.finished:
                    return
                if req.request_id in self.aborted:
                    break
            # Every stream ends with a finished output, as the colocated engine's does: a
            # client abort gives finish_reason ABORT, a stream that just stopped an error.
            why = None if req.request_id in self.aborted else "the decode stream ended early"
            yield RequestOutput(req.request_id, [], "", True, FinishReason.ABORT,
                                Usage(len(req.prompt_token_ids), len(sent)), error=why)
        finally:
            self.inflight.pop(req.request_id, None)
            self.aborted.discard(req.request_id)

    async def _serve(self, req: GenerateRequest, sent: list[int]):
        decision = self.router.choose(req.cache_salt or "", req.prompt_token_ids, self.page_size)
        d_name, p_name = decision.decode_worker, decision.prefill_worker
        if decision.skip_prefill or p_name is None:
            self.counts["prefill_skipped"] += 1
            stream = self._colocated(d_name, req)
        else:
            stream = await self._disaggregated(req, p_name, d_name)
        try:
            async for out in stream:
                yield out
        except WORKER_ERRORS as e:
            self._dead(d_name, e)
            async for out in self._recover(req, sent, f"decode worker {d_name} failed: {e}"):
                yield out

    def _colocated(self, name: str, req: GenerateRequest):
        self.inflight[req.request_id].add(name)
        return self._iter(self.alive[name].generate.options(num_returns="streaming").remote(req))

    @staticmethod
    async def _iter(gen):
        async for ref in gen:
            yield await ref

    async def _disaggregated(self, req: GenerateRequest, p_name: str, d_name: str):
        t = Transfer(req.request_id, p_name, d_name, time.monotonic() + self.dcfg.kv_transfer_timeout)
        self.transfers.append(t)
        d, p = self.alive[d_name], self.alive[p_name]
        self.inflight[req.request_id].update((d_name, p_name))
        reserved = False
        try:
            grant = await asyncio.wait_for(d.reserve.remote(req, self.dcfg.kv_lease,
                                                            self.dcfg.kv_transfer_timeout),
                                           t.remaining())
            reserved = True
            t.advance(TransferState.TRANSFERRING)
            beat = asyncio.get_running_loop().create_task(self._heartbeat(d, req.request_id))
            try:
                res = await asyncio.wait_for(p.prefill.remote(
                    req, grant["ticket"], grant["prefix_pages"], grant["endpoint"],
                    grant.get("rank_peers")), t.remaining())
            finally:
                beat.cancel()
            stream = self._iter(d.decode.options(num_returns="streaming").remote(
                req, grant["ticket"], res["first_token"], res["checksum"], res["checksum_tag"],
                res.get("first_logprob")))
            first = await asyncio.wait_for(stream.__anext__(), t.remaining() + 5)
        except WORKER_ERRORS as e:
            t.advance(TransferState.FAILED, f"{type(e).__name__}: {e}")
            self.counts["transfer_failed"] += 1
            if reserved:
                await self._quiet(d.cancel.remote(req.request_id))
            dead = p_name if isinstance(e, RayActorError) and not await self._is_up(p) else None
            if dead:
                self._dead(dead, e)
            return self._after_failure(req, d_name, t.error)
        t.nbytes, t.pages = res["nbytes"], res["pages"]
        t.advance(TransferState.SUCCESS)
        self.counts["transfer_success"] += 1
        self.counts["transfer_bytes"] += res["nbytes"]
        return self._prepend(first, stream)

    @staticmethod
    async def _prepend(first, stream):
        yield first
        async for out in stream:
            yield out

    async def _after_failure(self, req: GenerateRequest, d_name: str, error: str):
        if self.dcfg.kv_transfer_failure_policy == "fail" or req.request_id in self.aborted:
            yield RequestOutput(req.request_id, [], "", True, FinishReason.ABORT,
                                Usage(len(req.prompt_token_ids), 0),
                                error=f"KV transfer failed: {error}")
            return
        log.warning("%s: KV transfer failed (%s); recomputing on a decode worker",
                    req.request_id, error)
        async for out in self._recover(req, [], error):
            yield out

    async def _recover(self, req: GenerateRequest, sent: list[int], why: str):
        """Run the rest of ``req`` (prompt + tokens already sent) on a live decode worker."""
        left = req.sampling.max_tokens - len(sent)
        live = [n for n in self.alive if self.roles[n] == "decode"]
        if self.dcfg.kv_transfer_failure_policy == "fail" or not live or left <= 0 or \
                req.request_id in self.aborted:
            yield RequestOutput(req.request_id, [], "", True, FinishReason.ABORT,
                                Usage(len(req.prompt_token_ids), len(sent)), error=why)
            return
        self.counts["recomputed"] += 1
        again = dataclasses.replace(req, prompt_token_ids=list(req.prompt_token_ids) + sent,
                                    sampling=dataclasses.replace(req.sampling, max_tokens=left))
        async for out in self._colocated(live[0], again):
            u = out.usage
            out.usage = Usage(len(req.prompt_token_ids), len(sent) + u.completion_tokens,
                              u.cached_tokens, u.cached_by_tier)
            yield out

    async def _heartbeat(self, d, request_id: str) -> None:
        while True:
            await asyncio.sleep(self.dcfg.kv_lease / 3)
            await d.extend_lease.remote(request_id, self.dcfg.kv_lease)

    @staticmethod
    async def _quiet(ref) -> None:
        try:
            await asyncio.wait_for(ref, 5)
        except WORKER_ERRORS as e:
            log.info("cleanup call failed (%s); the lease frees the pages", type(e).__name__)

    @staticmethod
    async def _is_up(handle) -> bool:
        try:
            await asyncio.wait_for(handle.stats.remote(), 2)
            return True
        except WORKER_ERRORS:
            return False

    # ---- control ----
    async def abort(self, request_id: str) -> bool:
        if request_id in self.inflight:
            self.aborted.add(request_id)
        names = self.inflight.get(request_id, set())
        await asyncio.gather(*(self._quiet(self.alive[n].abort.remote(request_id))
                               for n in names if n in self.alive))
        return bool(names)

    async def abort_all(self) -> int:
        n = len(self.inflight)
        await asyncio.gather(*(self._quiet(h.abort_all.remote()) for h in self.alive.values()))
        return n

    async def flush_cache(self) -> bool:
        if self.inflight:
            return False
        done = await asyncio.gather(*(h.flush_cache.remote() for h in self.alive.values()),
                                    return_exceptions=True)
        return all(x is True for x in done)

    async def worker_stats(self) -> dict:
        names = list(self.alive)
        got = await asyncio.gather(*(self.alive[n].stats.remote() for n in names),
                                   return_exceptions=True)
        return {n: s for n, s in zip(names, got) if isinstance(s, dict)}

    async def stats(self) -> dict:
        """Engine-style gauges summed over the decode workers, plus transfer counters."""
        per = await self.worker_stats()
        decode = [s for n, s in per.items() if self.roles[n] == "decode"] or [{}]
        total = sum(s.get("total_pages", 0) for s in decode) or 1
        free = sum(s.get("free_pages", 0) for s in decode)
        out = {
            "num_running": sum(s.get("num_running", 0) for s in per.values()),
            "num_queued": sum(s.get("num_queued", 0) for s in per.values()),
            "token_usage": 1 - free / total,
            "max_total_tokens": sum(s.get("max_total_tokens", 0) for s in decode),
            "kv_bytes_per_token": decode[0].get("kv_bytes_per_token"),
            "kv_cache_dtype": decode[0].get("kv_cache_dtype"),
            "num_preemptions": sum(s.get("num_preemptions", 0) for s in per.values()),
            "num_cached_pages": sum(s.get("num_cached_pages", 0) for s in per.values()),
            "transfers": self.transfer_stats(),
        }
        return out

    def transfer_stats(self) -> dict:
        states = collections.Counter(t.state.value for t in self.transfers)
        return {**dict(self.counts), "recent_states": dict(states),
                "alive_workers": sorted(self.alive), "workers": dict(self.roles)}

    async def info(self) -> dict:
        return {"workers": await self.worker_stats(), "transfers": self.transfer_stats(),
                "kv_transport": self.dcfg.kv_transport,
                "failure_policy": self.dcfg.kv_transfer_failure_policy}


def make_orchestrator_class():
    return ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)(Orchestrator)
