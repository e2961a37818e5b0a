"""A tensor-parallel group: the collectives a sharded model and its engine need.

``SingleGroup`` (one rank: every call returns its input) keeps the TP=1 path free
of collectives; ``TorchGroup`` wraps a ``torch.distributed`` process group (gloo on
CPU, NCCL on GPU, one device per rank; ``devices.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..errors import DeviceFaultError


@contextlib.contextmanager
def _group_alive(what: str):
    """A collective that fails means a rank is gone (its process died, its connection
    dropped): the whole group is unusable, like a broken device (the server exits 1 and its
    supervisor restarts the group)."""
    try:
        yield
    except RuntimeError as exc:
        raise DeviceFaultError(f"tensor-parallel group lost a rank during {what}: {exc}") from exc


class TPGroup:
    """``rank`` of ``size``; rank 0 schedules, every rank computes its shard."""

    rank: int = 0
    size: int = 1
    backend: str = "none"      # what carries the tensor collectives: "gloo", "nccl"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place where the backend allows)."""
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, w]`` of every rank (equal ``w``) joined along the last dim: ``[N, size*w]``."""
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; for a step's batch, not for tensors)."""
        return obj

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` copied into ``x`` of every rank (same shape and dtype; on the
        ranks' devices with NCCL, no host round trip)."""
        return x

    def gather_object(self, obj: Any = None) -> list | None:
        """Every rank's ``obj`` by rank, on rank 0 (None on the others; pickled, small)."""
        return [obj]

    def all_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (pool sizes, so every rank has the same pages)."""
        return value

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's ``value``, by rank (the group's capacity)."""
        return [value]


class SingleGroup(TPGroup):
    """TP size 1."""


class TorchGroup(TPGroup):
    """Ranks of the default ``torch.distributed`` process group (initialized by the caller):
    tensors (``all_reduce``, ``all_gather_last``) on its backend (gloo, or NCCL on the ranks'
    GPUs); objects and integers on ``cpu_group``, a gloo group over the same ranks (None: the
    default group is gloo already), so a step's batch never waits on a GPU stream."""

    def __init__(self, cpu_group=None) -> None:
        import torch.distributed as dist
        self._dist = dist
        self._cpu = cpu_group
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.backend = dist.get_backend()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        with _group_alive("all_reduce"):
            self._dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        with _group_alive("all_gather"):
            if self.backend == "nccl":     # one collective into one buffer: graph capturable
                out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
                self._dist.all_gather_into_tensor(out, x)
                return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self._dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        box = [obj]
        with _group_alive("broadcast"):
            self._dist.broadcast_object_list(box, src=0, group=self._cpu)
        return box[0]

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        with _group_alive("broadcast"):
            self._dist.broadcast(x, src=0)
        return x

    def gather_object(self, obj: Any = None) -> list | None:
        out = [None] * self.size if self.rank == 0 else None
        with _group_alive("gather"):
            self._dist.gather_object(obj, out, dst=0, group=self._cpu)
        return out

    def all_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        with _group_alive("all_reduce"):
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._cpu)
        return int(t.item())

    def gather_ints(self, value: int) -> list[int]:
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        with _group_alive("all_gather"):
            self._dist.all_gather(parts, torch.tensor([value], dtype=torch.int64),
                                  group=self._cpu)
        return [int(p.item()) for p in parts]
