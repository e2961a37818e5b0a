"""How a model splits over ``size`` ranks, and the rank-local architecture.

- Attention by KV head: rank ``r`` owns KV heads ``[r*K//n, (r+1)*K//n)`` and their
  query groups. Head counts that do not divide (SmolLM2: 9 query and 3 KV heads over 2
  ranks) split unevenly: rank 0 gets one KV head, rank 1 two; each rank's pool holds
  its own heads, so its pages differ in bytes but not in number. With fewer KV heads
  than ranks each KV head is replicated on ``n/K`` ranks, which split its query group.
- The MLP by intermediate channel, the embedding and the LM head by vocabulary row
  (``ceil(V/n)`` rows per rank, the last one short), so the gathered logits are the full
  vocabulary after trimming the padding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:     # models import this module (their layers are sharded by it)
    from ..models.config import ModelArchConfig


def _split(n: int, size: int, rank: int) -> range:
    return range(rank * n // size, (rank + 1) * n // size)


@dataclass(frozen=True)
class TPPartition:
    """Rank ``rank``'s share of an architecture split over ``size`` ranks."""

    arch: ModelArchConfig               # the full model
    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        k, n, h = self.arch.num_kv_heads, self.size, self.arch.num_heads
        if not 0 <= self.rank < n:
            raise ConfigError(f"rank {self.rank} is not in a group of {n}")
        if k < n and (n % k or (h // k) % (n // k)):
            raise ConfigError(
                f"--tp-size {n} cannot split {h} query heads over {k} KV heads: with fewer KV "
                f"heads than ranks, the ranks must divide into groups per KV head, each "
                f"taking an equal share of its {h // k} query heads")

    @property
    def kv_heads(self) -> range:
        k, n = self.arch.num_kv_heads, self.size
        if k >= n:
            return _split(k, n, self.rank)
        head = self.rank * k // n
        return range(head, head + 1)

    @property
    def q_heads(self) -> range:
        a, n = self.arch, self.size
        group = a.num_heads // a.num_kv_heads
        kv = self.kv_heads
        if a.num_kv_heads >= n:
            return range(kv.start * group, kv.stop * group)
        share = n // a.num_kv_heads                       # ranks sharing this KV head
        per = group // share
        j = self.rank - kv.start * share
        return range(kv.start * group + j * per, kv.start * group + (j + 1) * per)

    @property
    def mlp(self) -> range:
        return _split(self.arch.intermediate_size, self.size, self.rank)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.arch.vocab_size // self.size)

    @property
    def vocab(self) -> range:
        per = self.vocab_per_rank
        return range(min(self.rank * per, self.arch.vocab_size),
                     min((self.rank + 1) * per, self.arch.vocab_size))

    def rows(self, heads: range) -> slice:
        """Rows (of a projection's output) of ``heads``, ``head_dim`` each."""
        d = self.arch.head_dim
        return slice(heads.start * d, heads.stop * d)


def shard_arch(part: TPPartition) -> ModelArchConfig:
    """The rank-local architecture: its heads and MLP channels (the vocabulary stays whole:
    the sampler sees the gathered logits)."""
    if part.size == 1:
        return part.arch
    return dataclasses.replace(part.arch, num_heads=len(part.q_heads),
                               num_kv_heads=len(part.kv_heads),
                               intermediate_size=len(part.mlp))


# which dimension of a parameter is split, by parameter name (its last path component)
_ROW_HEADS = {"qkv_weight", "qkv_bias"}          # fused q/k/v rows: by query or KV head
_COL_Q = {"o_weight"}                            # columns: by query head
_ROW_MLP = {"gate_up_weight"}                    # fused gate/up rows: by channel
_COL_MLP = {"down_weight"}                       # columns: by channel
_ROW_VOCAB = {"embed", "lm_head"}                # rows: by vocabulary entry


def shard_tensor(part: TPPartition, key: str, fused_part: int | None, tensor):
    """The rank's slice of a checkpoint tensor bound for parameter ``key`` (fused part
    ``fused_part``: 0/1/2 = q/k/v, 0/1 = gate/up); replicated tensors come back whole."""
    if part.size == 1:
        return tensor
    name = key.rsplit(".", 1)[-1]
    if name in _ROW_HEADS:
        return tensor[part.rows(part.q_heads if fused_part == 0 else part.kv_heads)]
    if name in _COL_Q:
        return tensor[:, part.rows(part.q_heads)]
    if name in _ROW_MLP:
        return tensor[part.mlp.start:part.mlp.stop]
    if name in _COL_MLP:
        return tensor[:, part.mlp.start:part.mlp.stop]
    if name in _ROW_VOCAB:
        return tensor[part.vocab.start:part.vocab.stop]
    return tensor
