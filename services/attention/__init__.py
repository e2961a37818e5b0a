"""Attention backends (registered by name) and their per-step metadata.

``triton`` registers only where Triton imports; ``TRITON_IMPORT_ERROR`` then
says why not (None when it imported).
"""

from .base import ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata, register_backend
from .torch_backend import TorchAttentionBackend
from .torch_fast_backend import FastTorchAttentionBackend

TRITON_IMPORT_ERROR: str | None = None
try:
    from .triton_backend import TritonAttentionBackend
except ImportError as exc:  # no usable Triton: the torch backend remains
    TritonAttentionBackend = None
    TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "register_backend",
           "TorchAttentionBackend", "FastTorchAttentionBackend", "TritonAttentionBackend", "TRITON_IMPORT_ERROR"]
