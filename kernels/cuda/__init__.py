"""Hopper CUDA C++ kernels (sm_90a), compiled with torch's extension builder on first use.

* :func:`decode_attention_nvfp4_cuda`: split-K paged GQA decode over NVFP4 pages with
  register-level E2M1 dequantization and ``mma.sync`` fp16 MMAs.

Importing this package compiles nothing and needs no GPU; the wrapper checks its
arguments (raising :class:`~nibble.kernels.KernelInputError`) before building.
"""

from .decode import (DEFAULT_VARIANT, VARIANTS, decode_attention_nvfp4_cuda, default_num_splits,
                     is_built)

__all__ = ["DEFAULT_VARIANT", "VARIANTS", "decode_attention_nvfp4_cuda", "default_num_splits",
           "is_built"]
