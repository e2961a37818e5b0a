"""Hopper CUDA C++ kernels (sm_90a), compiled with torch's extension builder on first use.

* :func:`decode_attention_cuda`: split-K paged GQA decode over NVFP4 or FP8 E4M3 pages
  with register-level E2M1 / E4M3 conversion and ``mma.sync`` fp16 MMAs.
* :func:`store_kv_nvfp4_cuda`: NVFP4 quantize-and-store from bf16 or FP8 K/V, bit-identical
  to the reference quantizer.

Importing this package compiles nothing and needs no GPU; the wrapper checks its
arguments (raising :class:`~nibble.kernels.KernelInputError`) before building.
"""

from .decode import (DEFAULT_FP8_VARIANT, DEFAULT_VARIANT, FP8_VARIANTS, VARIANTS,
                     decode_attention_cuda, default_num_splits, default_variant, is_built)
from .store import store_kv_nvfp4_cuda

__all__ = ["DEFAULT_FP8_VARIANT", "DEFAULT_VARIANT", "FP8_VARIANTS", "VARIANTS",
           "decode_attention_cuda", "default_num_splits", "default_variant", "is_built",
           "store_kv_nvfp4_cuda"]
