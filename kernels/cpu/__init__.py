"""CPU kernels in plain C, built with the system C compiler on first use (``build.py``).

* :func:`decode_nvfp4_cpu`: one NVFP4 decode layer (RoPE, the K recipe, the store, GQA
  attention over the pages) in one call; :func:`decode_nvfp4_ref` is its torch reference.
* ``layer_ops.add_rms_norm``: residual add + RMSNorm in one call (reference:
  ``kernels/fused_ref.add_rms_norm_ref``).
* ``int4_linear``: weight-only 4-bit and 8-bit linear layers over torch's CPU int4 kernel
  (no C of its own; ``linear_ref`` is the reference).

Importing this package builds nothing; :func:`available` builds (or loads) the library.
"""

from .decode import (IO_DTYPES, RECIPE_KEYS, DecodeStep, available, decode_nvfp4_cpu,
                     decode_nvfp4_ref, section_offsets, supports_layout)

__all__ = ["IO_DTYPES", "RECIPE_KEYS", "DecodeStep", "available", "decode_nvfp4_cpu",
           "decode_nvfp4_ref", "section_offsets", "supports_layout"]
