"""Starting a tensor-parallel group on one machine: ranks 1..n-1 as local processes.

``start_group(cfg)`` (in the server's process, rank 0) spawns the followers, joins the
group with them (gloo on CPU; NCCL on GPUs ``--base-gpu-id + rank``, ``devices.py``) and
returns it; each follower loads its shard of the same model,
builds the same engine (its pool holds its KV heads; calibration runs in step with
rank 0, since the model's forwards collect) and runs rank 0's steps until told to stop
(follower.py). A follower whose parent is gone exits: it cannot be left waiting in a
collective. In a disaggregated worker the followers also get their own KV transport
(``services/disagg/rank_transfer.py``).

A disaggregated ``EngineWorker`` actor starts its followers as Ray actors in its placement
group instead (``ray_group.py``), through ``join`` and ``run_follower``.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time

import torch

from .devices import rank_placement
from .follower import follow
from .group import TorchGroup

log = logging.getLogger(__name__)
# a follower waits in a collective for rank 0's next step, however long the server idles
IDLE_TIMEOUT = datetime.timedelta(days=7)
# an NCCL collective only runs inside a step that every rank executes; one that waits this
# long means a rank is gone (NCCL's watchdog then aborts the process)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def threads_per_rank(size: int, cores: int, env: dict[str, str]) -> int | None:
    """Intra-op CPU threads for each of ``size`` ranks on ``cores`` cores, or None to keep
    torch's default (``OMP_NUM_THREADS`` set, as Ray does for its actors). Without a split,
    every rank starts one thread per core, and the ranks' small float64 ops of the K-recipe
    calibration took over 80 s against 9 s for one rank on the lent H200 host (16 cores,
    2 ranks sharing the GPU)."""
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, cores // size)


def join(rank: int, size: int, port: int, host: str = "127.0.0.1", backend: str = "gloo",
         device: torch.device | None = None) -> TorchGroup:
    """Join the group whose rank 0 listens on ``host:port``: ``backend`` carries the tensors
    (gloo, or NCCL on ``device``, this rank's GPU), a second gloo group the objects. The
    group's ``device`` is where this rank computes."""
    import torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    device = device or torch.device("cpu")
    threads = threads_per_rank(size, len(os.sched_getaffinity(0)), dict(os.environ))
    if threads is not None:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        dist.init_process_group("nccl", rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=device)
        tp = TorchGroup(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
        tp = TorchGroup()
    tp.device = device
    return tp


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _follower_main(rank: int, size: int, port: int, cfg, parent: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s "
                                                   "%(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    backend, device = placement_of(cfg, rank)
    run_follower(join(rank, size, port, backend=backend, device=device), cfg)


def placement_of(cfg, rank: int, in_ray: bool = False) -> tuple[str, torch.device]:
    """(backend, device) of ``rank`` under ``cfg`` (see ``devices.rank_placement``)."""
    from ..engine.builder import resolve_device
    return rank_placement(cfg.device, resolve_device(cfg.device).type, rank, in_ray)


def run_follower(tp: TorchGroup, cfg) -> None:
    """Rank ``tp.rank``: load its shard, build its engine, follow rank 0 until it stops."""
    from ..engine.builder import build_engine_core, resolve_dtype
    from ..models.loader import load_model
    rank, device = tp.rank, tp.device
    loaded = load_model(cfg.model.model_path, resolve_dtype(cfg.model.dtype, device), device,
                        cfg.model.load_format, tp=tp)
    core = build_engine_core(loaded.model, loaded.tokenizer, cfg, device=device,
                             fingerprint=loaded.fingerprint)
    from ..disagg.rank_transfer import follower_transfers
    follow(core.runner, tp, core.runner.tier_mirror,
           follower_transfers(cfg, core.pool.pages, rank))


def start_group(cfg) -> tuple[TorchGroup, list]:
    """Rank 0's group of ``cfg.device.tp_size`` ranks (this process and its followers)."""
    import torch.multiprocessing as mp
    size, port = cfg.device.tp_size, free_port()
    ctx = mp.get_context("spawn")
    placement = placement_of(cfg, 0)      # refuses a GPU count NCCL cannot use, first
    procs = [ctx.Process(target=_follower_main, args=(r, size, port, cfg, os.getpid()),
                         daemon=True, name=f"nibble-tp-rank{r}") for r in range(1, size)]
    for p in procs:
        p.start()
    log.info("tensor parallel: %d ranks on this machine (followers: pids %s)", size,
             [p.pid for p in procs])
    return join(0, size, port, backend=placement[0], device=placement[1]), procs
