"""A tensor-parallel group of Ray actors: a disaggregated worker's followers.

Why a placement group: the ranks of one worker exchange an all-reduce per layer and step,
so they must sit on one node (NCCL over NVLink on GPU, loopback gloo on CPU), and the group
must be scheduled as a whole or not at all (a rank 0 whose followers cannot be placed would wait in
``init_process_group`` forever). ``worker_placement`` reserves one bundle per rank with
``STRICT_PACK`` (all bundles on one node) before any actor starts; the rank-0
``EngineWorker`` actor takes bundle 0 and ``start_ray_group`` (called in that actor while it
builds its engine) starts ranks 1.. as ``TPFollower`` actors in bundles 1.., then forms the
group with them over the node's address (loopback on a local cluster): each rank asked Ray
for one GPU and sees only it, so every rank computes on its ``cuda:0``.

Lifetimes: the followers are owned by the rank-0 actor (not detached), so Ray kills them
when it dies; when Ray restarts rank 0 (in the same bundle), it starts new followers. A
follower that dies breaks the next collective on rank 0 (``DeviceFaultError``): rank 0's
engine stops, its next stats poll makes the actor exit once its calls in flight have
answered (``disagg/exit_gate.py``), and Ray restarts the group. A follower
whose group broke exits too (``os._exit``): it holds a bundle and nothing else useful.
"""

from __future__ import annotations

import logging
import os

from ..errors import ConfigError, DeviceFaultError
from .group import TorchGroup
from .launch import free_port, join, placement_of, run_follower

log = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 120.0


def worker_placement(name: str, size: int, num_cpus: float, num_gpus: float,
                     rank0: dict | None = None, strategy: str = "STRICT_PACK"):
    """A placement group of ``size`` bundles (one per rank) for worker ``name``, ready;
    ``rank0``: custom resources the rank-0 actor asks for (the Helm chart's
    ``nibble_prefill``/``nibble_decode``), added to bundle 0. ConfigError when the cluster
    cannot place it within ``PLACEMENT_TIMEOUT_S``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    bundles = [dict(bundle, **(rank0 or {}))] + [dict(bundle) for _ in range(size - 1)]
    pg = placement_group(bundles, strategy=strategy,
                         name=f"{name}-tp{size}")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise ConfigError(f"{name}: Ray cannot place {size} tensor-parallel ranks of {bundle} "
                          f"on one node ({strategy}) within {PLACEMENT_TIMEOUT_S:.0f} s")
    return pg


def in_bundle(pg, index: int):
    """Ray scheduling options that put an actor in bundle ``index`` of ``pg``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index)}


class TPFollower:
    """Rank ``rank`` of a worker's group, as a Ray actor (``ray.remote`` in start_ray_group)."""

    def __init__(self, rank: int, size: int, cfg) -> None:
        logging.basicConfig(level=logging.INFO)
        self.rank, self.size, self.cfg = rank, size, cfg

    def pid(self) -> int:
        return os.getpid()

    def run(self, host: str, port: int) -> None:
        """Join rank 0's group and run its steps until it stops the group."""
        try:
            backend, device = placement_of(self.cfg, self.rank, in_ray=True)
            run_follower(join(self.rank, self.size, port, host, backend, device), self.cfg)
        except DeviceFaultError as exc:
            log.critical("tensor-parallel rank %d: %s; exiting", self.rank, exc)
            os._exit(1)
        except Exception:    # noqa: BLE001 - any failure: leave the group, never hang rank 0
            log.critical("tensor-parallel rank %d failed; exiting so its group breaks",
                         self.rank, exc_info=True)
            os._exit(1)


def start_ray_group(cfg, pg, num_cpus: float, num_gpus: float) -> tuple[TorchGroup, list[int]]:
    """In the rank-0 actor (bundle 0 of ``pg``): start ranks 1.. in bundles 1.. and join the
    group with them. Returns the group and the followers' pids."""
    import ray
    size = cfg.device.tp_size
    host = ray.util.get_node_ip_address()
    port = free_port(host)
    cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)(TPFollower)
    followers = [cls.options(**in_bundle(pg, r)).remote(r, size, cfg) for r in range(1, size)]
    pids = ray.get([f.pid.remote() for f in followers])
    runs = [f.run.remote(host, port) for f in followers]
    log.info("tensor parallel: %d ranks in placement group %s (followers: pids %s)", size,
             pg.id.hex(), pids)
    backend, device = placement_of(cfg, 0, in_ray=True)
    tp = join(0, size, port, host, backend, device)
    tp.followers = followers, runs           # keep the handles: the actors live with them
    return tp, pids
