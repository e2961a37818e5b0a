"""Which device each tensor-parallel rank computes on, and which backend carries its
collectives.

- CPU: every rank on the CPU, gloo.
- CUDA, NCCL (the default): one GPU per rank. Local ranks (``launch.py``) take GPUs
  ``--base-gpu-id + rank``; Ray ranks (``ray_group.py``) ask Ray for one GPU each and see
  only it, so each uses ``cuda:0`` of its own view. The activations' all-reduces and
  all-gathers run on NCCL (CUDA-graph capturable); the per-step batch and the small integer
  agreements go over a second, gloo group on the host, so no step waits on the GPU to learn
  what to run.
- CUDA, ``--tp-backend gloo``: the collectives copy through the host (no CUDA graphs). Ranks
  may share a GPU (rank ``r`` on GPU ``(base + r) % count``), which NCCL refuses: this is
  how the CUDA TP path runs on a one-GPU machine (tests, ``docs/benchmarks.md``).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def comm_backend(tp_backend: str, device_type: str) -> str:
    """``"gloo"`` or ``"nccl"`` for ranks on ``device_type`` (``"cpu"`` / ``"cuda"``)."""
    if device_type != "cuda":
        if tp_backend == "nccl":
            raise ConfigError("--tp-backend nccl needs --device cuda (CPU ranks use gloo)")
        return "gloo"
    return "gloo" if tp_backend == "gloo" else "nccl"


def local_rank_device(device_type: str, rank: int, size: int, base_gpu_id: int,
                      backend: str, visible: int | None = None) -> torch.device:
    """The device of local rank ``rank`` of ``size`` (all ranks in this machine's view of
    ``visible`` GPUs, default ``torch.cuda.device_count()``). ConfigError when NCCL would need
    more GPUs than are visible (NCCL refuses two ranks on one GPU)."""
    if device_type != "cuda":
        return torch.device("cpu")
    count = torch.cuda.device_count() if visible is None else visible
    if base_gpu_id < 0 or base_gpu_id >= max(count, 1):
        raise ConfigError(f"--base-gpu-id {base_gpu_id}: this machine shows {count} GPU(s)")
    if backend == "nccl" and base_gpu_id + size > count:
        raise ConfigError(
            f"--tp-size {size} with NCCL needs one GPU per rank: GPUs {base_gpu_id}.."
            f"{base_gpu_id + size - 1}, but this machine shows {count}; lower --tp-size or "
            "--base-gpu-id, or pass --tp-backend gloo to share GPUs (slow; for tests)")
    return torch.device("cuda", (base_gpu_id + rank) % count)


def rank_placement(dev_cfg, device_type: str, rank: int, in_ray: bool = False
                   ) -> tuple[str, torch.device]:
    """(backend, device) of rank ``rank`` of ``dev_cfg.tp_size`` (a ``DeviceConfig``) on
    ``device_type``. ``in_ray``: the rank is a Ray actor that asked for one GPU and sees
    only it."""
    backend = comm_backend(dev_cfg.tp_backend, device_type)
    if device_type == "cuda" and in_ray:
        return backend, torch.device("cuda", 0)
    return backend, local_rank_device(device_type, rank, dev_cfg.tp_size, dev_cfg.base_gpu_id,
                                      backend)
