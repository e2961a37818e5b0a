"""Portable Triton paged-KV kernels (any Triton backend; CPU through the interpreter).

* :func:`store_kv` quantizes new tokens' K/V into one layer's pages;
* :func:`gather_kv` dequantizes whole sequences into a packed workspace (extend path);
* :func:`decode_attention` is split-K paged GQA decode with a reduce kernel.

Each wrapper checks its arguments and raises :class:`~nibble.kernels.KernelInputError`.
"""

from .decode import decode_attention, default_num_splits
from .gather import gather_kv
from .store import store_kv

__all__ = ["decode_attention", "default_num_splits", "gather_kv", "store_kv"]
