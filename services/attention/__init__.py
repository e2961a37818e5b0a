"""Attention backends (registered by name) and their per-step metadata."""

from .base import ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata, register_backend
from .torch_backend import TorchAttentionBackend

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "register_backend",
           "TorchAttentionBackend"]
