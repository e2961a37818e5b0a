"""Tensor parallelism: the rank group (``group.py``) and how a model splits across it
(``partition.py``). With one rank everything here is a no-op."""

from .group import SingleGroup, TorchGroup, TPGroup
from .partition import TPPartition, shard_arch

__all__ = ["SingleGroup", "TorchGroup", "TPGroup", "TPPartition", "shard_arch"]
