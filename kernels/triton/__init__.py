"""Portable Triton paged-KV kernels (any Triton backend; CPU through the interpreter).

* :func:`store_kv` quantizes new tokens' K/V into one layer's pages;
* :func:`gather_kv` dequantizes whole sequences into a packed workspace (extend path);
* :func:`decode_attention` is split-K paged GQA decode with a reduce kernel;
* :func:`qkv_rope_store` turns a QKV projection's output into q' and stored K/V
  (QK-norm, RoPE, a K recipe, the store) in one launch;
* :func:`add_rms_norm` and :func:`silu_mul` are a decoder layer's fused elementwise ops.

Each wrapper checks its arguments and raises :class:`~nibble.kernels.KernelInputError`.
"""

from .decode import decode_attention, default_num_splits
from .gather import gather_kv
from .layer_ops import add_rms_norm, silu_mul
from .qkv import qkv_rope_store
from .store import store_kv

__all__ = ["add_rms_norm", "decode_attention", "default_num_splits", "gather_kv",
           "qkv_rope_store", "silu_mul", "store_kv"]
