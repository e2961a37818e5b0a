"""The gateway's engine in disaggregated mode: Ray actors behind the AsyncEngine interface.

``DisaggEngine.start(cfg)`` starts (or joins) a Ray cluster, creates named
actors ``nibble-prefill-<i>``, ``nibble-decode-<i>`` and ``nibble-router``,
and then serves the ``EngineClient`` interface, as the colocated engine does.
The actors load the KV secret from a file (``secret_handoff``), never from
Ray's runtime environment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import AsyncIterator

from ..config import NibbleConfig
from ..config.validate import role_tp_sizes
from ..engine.async_engine import redacted_config
from ..engine.client import EngineStats
from ..engine.types import GenerateRequest, RequestOutput
from ..errors import EngineDeadError, InvalidRequestError
from .secret_handoff import SecretDir, prepare_kv_secret

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 5.0
RAY_NAMESPACE = "nibble"      # actors are named within it, so `ray.get_actor(...)` finds them


def _init_ray(cfg: NibbleConfig) -> bool:
    """Connect to --ray-address or start a local cluster on loopback; True if we started it.

    No runtime environment carries a secret: Ray writes runtime environments into
    its session logs."""
    import ray

    if ray.is_initialized():
        return False
    if cfg.disagg.ray_address:
        ray.init(address=cfg.disagg.ray_address, namespace=RAY_NAMESPACE, log_to_driver=True)
        return False
    missing = ray._private.utils.get_dashboard_dependency_error()
    if missing:   # a core-only Ray install (no ray[default]) runs without the dashboard
        log.warning("Ray dashboard off: its dependencies are missing (%s)", missing)
    ray.init(_node_ip_address="127.0.0.1", dashboard_host="127.0.0.1",
             include_dashboard=not missing,
             num_cpus=max(2, os.cpu_count() or 2), namespace=RAY_NAMESPACE,
             log_to_driver=True)
    return True


def actor_config(cfg: NibbleConfig) -> NibbleConfig:
    """The config the actors get: without the API keys, which only the gateway checks, and
    with the workers' tensor-parallel size (--prefill-tp-size / --decode-tp-size, which
    validate.py keeps equal; default --tp-size) as the actors' --tp-size."""
    server = dataclasses.replace(cfg.server, api_keys=(), admin_api_keys=())
    device = dataclasses.replace(cfg.device, tp_size=role_tp_sizes(cfg)[0])
    return dataclasses.replace(cfg, server=server, device=device)


async def _within(aw, timeout: float):
    """Await a Ray reference (or several, gathered) for at most ``timeout`` seconds."""
    return await asyncio.wait_for(aw, timeout)


async def _start_worker(cfg: NibbleConfig, name: str, role: str, cuda: bool, n_workers: int):
    """One worker actor; under tensor parallelism rank 0 of a group whose bundles (one per
    rank, STRICT_PACK: one node) are reserved first, so the followers it starts as Ray actors
    in bundles 1.. (``parallel/ray_group.py``) always find their place beside it. On CPU each
    rank asks for 0.5 CPU, less where the cluster would not fit every rank of every worker."""
    import ray

    from ..parallel.ray_group import in_bundle, worker_placement
    from .worker import make_worker_class

    size, gpus = cfg.device.tp_size, 1 if cuda else 0
    cpus = min(0.5, ray.cluster_resources().get("CPU", 1) / (n_workers * size))
    actor_cls = make_worker_class(role, num_gpus=gpus, num_cpus=cpus)
    if size == 1:
        return actor_cls.options(name=name, get_if_exists=True).remote(cfg, role, name)
    custom = f"nibble_{role}"       # what make_worker_class asks for, where nodes offer it
    rank0 = {custom: 1} if custom in ray.cluster_resources() else None
    pg = await asyncio.to_thread(worker_placement, name, size, cpus, gpus, rank0)
    return actor_cls.options(name=name, get_if_exists=True, **in_bundle(pg, 0)).remote(
        cfg, role, name, (pg, cpus, gpus))


class DisaggEngine:
    """An ``EngineClient`` (services/engine/client.py) over the router and worker actors."""

    def __init__(self, cfg: NibbleConfig, router, workers: dict[str, object], meta: dict,
                 tokenizer, started_ray: bool, secret_dir: SecretDir | None = None):
        self.cfg, self.router, self.workers = cfg, router, workers
        self.model_name = cfg.model.served_model_name or meta["model_name"]
        self.context_length = meta["context_length"]
        self.tokenizer = tokenizer
        self._started_ray = started_ray
        self._secret_dir = secret_dir          # the local cluster's secret file, if we wrote it
        self._healthy = True

    @classmethod
    async def start(cls, cfg: NibbleConfig) -> "DisaggEngine":
        cfg, secret_dir = prepare_kv_secret(cfg)
        try:
            return await cls._start(cfg, secret_dir)
        except BaseException:
            if secret_dir is not None:
                secret_dir.remove()
            raise

    @classmethod
    async def _start(cls, cfg: NibbleConfig, secret_dir: SecretDir | None) -> "DisaggEngine":
        import ray

        from ..models.loader import load_tokenizer
        from .orchestrator import make_orchestrator_class

        started = await asyncio.to_thread(_init_ray, cfg)
        actor_cfg = actor_config(cfg)
        # The gateway may have no GPU while the workers do: ask the cluster, not this process.
        cuda = cfg.device.device == "cuda" or (
            cfg.device.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        roles = {f"nibble-prefill-{i}": "prefill" for i in range(cfg.disagg.prefill_workers)}
        roles |= {f"nibble-decode-{i}": "decode" for i in range(cfg.disagg.decode_workers)}
        workers = {}
        for name, role in roles.items():
            workers[name] = await _start_worker(actor_cfg, name, role, cuda, len(roles))
        await asyncio.gather(*(w.info.remote() for w in workers.values()))
        router = make_orchestrator_class().options(name="nibble-router", get_if_exists=True).remote(
            actor_cfg, roles)
        meta = await router.start.remote()
        tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model.model_path,
                                            cfg.model.load_format)
        log.info("disaggregated: %d prefill + %d decode workers over %s; Ray dashboard at %s",
                 cfg.disagg.prefill_workers, cfg.disagg.decode_workers, cfg.disagg.kv_transport,
                 ray.get_runtime_context().gcs_address if not started else "http://127.0.0.1:8265")
        return cls(cfg, router, workers, meta, tokenizer, started, secret_dir)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not req.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        gen = self.router.generate.options(num_returns="streaming").remote(req)
        finished = False
        try:
            async for ref in gen:
                out: RequestOutput = await ref
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._post_abort(req.request_id)

    async def abort(self, request_id: str) -> None:
        self._post_abort(request_id)

    def _post_abort(self, request_id: str) -> None:
        self.router.abort.remote(request_id)      # fire and forget: the router answers nothing

    async def abort_all(self) -> int:
        return int(await _within(self.router.abort_all.remote(), STATS_TIMEOUT_S))

    async def flush_cache(self) -> bool:
        return bool(await _within(self.router.flush_cache.remote(), 30))

    async def stats(self) -> EngineStats:
        try:
            s = await _within(self.router.stats.remote(), STATS_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - reported as unhealthy, never raised to a scrape
            self._healthy = False
            raise EngineDeadError(f"router unreachable: {e}") from e
        self._healthy = True
        return EngineStats.from_dict(s)

    async def server_info(self) -> dict:
        info = await _within(self.router.info.remote(), STATS_TIMEOUT_S)
        return {"model": self.model_name, "context_length": self.context_length,
                "config": redacted_config(self.cfg), "disaggregated": True, **info}

    async def kv_events(self, since: int = 0, limit: int = 1000) -> dict:
        names = list(self.workers)
        got = await _within(asyncio.gather(*(self.workers[n].kv_events.remote(since)
                                             for n in names)), STATS_TIMEOUT_S)
        return {"workers": dict(zip(names, got))}

    def is_healthy(self) -> bool:
        return self._healthy

    @property
    def dead_reason(self) -> str | None:
        return None if self._healthy else "the router did not answer"

    async def shutdown(self) -> None:
        import ray
        for actor in [self.router, *self.workers.values()]:
            ray.kill(actor, no_restart=True)
        if self._started_ray:
            await asyncio.to_thread(ray.shutdown)
        if self._secret_dir is not None:
            self._secret_dir.remove()
