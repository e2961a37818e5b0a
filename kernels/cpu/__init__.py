"""CPU kernels in plain C, built with the system C compiler on first use (``build.py``).

* :func:`decode_nvfp4_cpu`: one NVFP4 decode layer (RoPE, the K recipe, the store, GQA
  attention over the pages) in one call; :func:`decode_nvfp4_ref` is its torch reference.

Importing this package builds nothing; :func:`available` builds (or loads) the library.
"""

from .decode import (RECIPE_KEYS, DecodeStep, available, decode_nvfp4_cpu, decode_nvfp4_ref,
                     section_offsets, supports_layout)

__all__ = ["RECIPE_KEYS", "DecodeStep", "available", "decode_nvfp4_cpu", "decode_nvfp4_ref",
           "section_offsets", "supports_layout"]
