"""The attention backend interface and its per-step metadata.

The model runner flattens a step's sequences into one token stream of ``T``
tokens and builds one :class:`AttentionMetadata`; every layer's attention call
reuses it. A backend implements three paths:

1. **prefill** (no cached prefix): attend over the fresh K/V, then store pages;
2. **extend** (cached prefix + new chunk): dequantize the prefix into a
   workspace shared by all layers, attend over prefix + chunk, store the chunk;
3. **decode** (one new token): store it, then attend over the pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from nibble.kernels.errors import KernelInputError
from nibble.kernels.nvfp4 import e4m3_round


@dataclass
class AttentionMetadata:
    """Layout of one step's flattened token stream (shared by all layers).

    ``new_lens[b]`` tokens of sequence ``b`` start at ``seq_starts[b]`` in the
    stream; ``cached_lens[b]`` of its tokens were already in pages.
    """

    seq_starts: list[int]            # [B] offset of each sequence's new tokens
    new_lens: list[int]              # [B] tokens run this step
    cached_lens: list[int]           # [B] tokens already stored in pages
    slot_mapping: torch.Tensor       # int64 [T]: page_id * page_size + offset of each new token
    block_tables: torch.Tensor       # int32 [B, M]: page ids per sequence (padded with 0)

    def __post_init__(self) -> None:
        b = len(self.seq_starts)
        if not len(self.new_lens) == len(self.cached_lens) == b == self.block_tables.shape[0]:
            raise KernelInputError("AttentionMetadata lists disagree on the batch size")
        self.prefill = [i for i in range(b) if self.cached_lens[i] == 0]
        self.decode = [i for i in range(b) if self.cached_lens[i] > 0 and self.new_lens[i] == 1]
        self.extend = [i for i in range(b) if self.cached_lens[i] > 0 and self.new_lens[i] > 1]

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend(ABC):
    """Stores each layer's new K/V as pages and computes attention."""

    name: str = ""

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare per-step state (gather indices, the shared workspace) once per step."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k``/``v`` ``[T, H, D]`` (RoPE applied) -> ``[T, Hq, D]`` in q's dtype."""


def fresh_kv(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Fresh K/V as prefill attends over them: ``--prefill-kv-dtype fp8_e4m3`` casts them to
    float8_e4m3fn (RNE, saturating, as SGLang's recipe does) and they are quantized from there."""
    return e4m3_round(x.float()) if fp8 else x


ATTENTION_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str):
    """Class decorator: register an attention backend under ``name``."""
    def deco(cls):
        if name in ATTENTION_BACKENDS:
            raise KernelInputError(f"attention backend {name!r} already registered")
        cls.name = name
        ATTENTION_BACKENDS[name] = cls
        return cls
    return deco
