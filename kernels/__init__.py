"""NVFP4/FP8/BF16 KV formats, the page layout, and the paged-KV kernels.

Imports only torch (and triton, in the Triton kernel modules); nothing else of
Nibble's.
"""

from .errors import KernelInputError, NonFiniteInputError
from .formats import (KV_CACHE_FORMATS, ElementFormat, KVCacheFormat, get_kv_format,
                      kv_format_names, register_kv_format)
from .fp8 import dequantize_fp8, quantize_fp8
from .layout import LayerPages, PageLayout
from .nvfp4 import dequantize_nvfp4, quantize_nvfp4
from . import recipes  # registers the K-recipe KV formats (nvfp4_k46, nvfp4_khad*, fp8k_nvfp4v)
from .paged_ref import (attention_ref, decode_attention_ref, gather_kv_ref, gather_rows_ref,
                        store_kv_ref)

__all__ = [
    "KernelInputError", "NonFiniteInputError", "KV_CACHE_FORMATS", "KVCacheFormat",
    "ElementFormat", "get_kv_format", "kv_format_names", "register_kv_format", "dequantize_fp8", "quantize_fp8",
    "LayerPages", "PageLayout", "dequantize_nvfp4", "quantize_nvfp4", "attention_ref",
    "decode_attention_ref", "gather_kv_ref", "gather_rows_ref", "store_kv_ref",
]
