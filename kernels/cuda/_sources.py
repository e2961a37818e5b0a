"""Where the CUDA C++ of :mod:`nibble.kernels.cuda` lives and how the extension is built.

The sources are files in ``csrc/`` next to this module (shipped as package data):

* ``params.cuh``: ``Params`` / ``StoreParams`` and the launchers' declarations, shared by the
  device code and the binding (plain C++, no CUDA or torch header);
* ``tile.cuh``, ``pipe.cuh``, ``fp8.cuh``: device code parts 1-3, each including the one
  before (loads and per-tile math; ``cp.async`` rings, softmax and the NVFP4 format policy;
  the FP8 format policy);
* ``decode.cu``: the decode and reduce kernels and their launchers, with the kernel design
  notes at its top; ``store.cu``: the NVFP4 quantize-and-store kernel;
* ``binding.cpp``: the torch binding (the only file that includes a torch header), exporting
  :data:`FUNCTIONS`.

:func:`load_kwargs` gives the arguments of ``torch.utils.cpp_extension.load``: the three
translation units of :data:`SOURCES`, ``csrc/`` as the include path, the compile flags, and
the name. No C++ is generated from Python; the constants that the Python wrapper and the
kernel must agree on (head dim, warps per CTA, query heads per KV head) are passed to nvcc as
``-D`` defines (:func:`defines`), and ``tile.cuh`` checks with ``static_assert`` that they
equal its own, so a drift fails the build instead of the results.

The name is ``nibble_nvfp4_decode_<tag>``, ``tag`` a hash of every file in ``csrc/`` (name and
bytes) and of the flags: any change of a source, a header or a flag gets a fresh build
directory in torch's extension cache (torch's own versioning hashes the listed sources only,
not the headers they include).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().with_name("csrc")
SOURCES = ("binding.cpp", "decode.cu", "store.cu")       # translation units
HEADERS = ("params.cuh", "tile.cuh", "pipe.cuh", "fp8.cuh", "store8.cuh")
FUNCTIONS = ("decode", "occupancy", "store")              # what binding.cpp exports
CFLAGS = ("-O2",)
CUDA_CFLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a")
NAME_PREFIX = "nibble_nvfp4_decode_"


def defines(constants: dict[str, int]) -> list[str]:
    """``-DNAME=value`` flags, sorted by name (``constants``: macro name -> int)."""
    return [f"-D{k}={int(v)}" for k, v in sorted(constants.items())]


def source_tag(flags: list[str]) -> str:
    """10 hex digits over every file in ``csrc/`` (sorted names and bytes) and ``flags``."""
    h = hashlib.sha1()
    for path in sorted(p for p in CSRC_DIR.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update("\0".join(flags).encode())
    return h.hexdigest()[:10]


def load_kwargs(constants: dict[str, int], verbose: bool = False) -> dict:
    """Keyword arguments of ``torch.utils.cpp_extension.load`` for the extension.

    ``constants`` (macro name -> int) become ``-D`` flags of the CUDA translation units.
    """
    cuda_cflags = [*CUDA_CFLAGS, *defines(constants)]
    return dict(name=NAME_PREFIX + source_tag([*CFLAGS, "|", *cuda_cflags]),
                sources=[str(CSRC_DIR / s) for s in SOURCES],
                extra_include_paths=[str(CSRC_DIR)], extra_cflags=list(CFLAGS),
                extra_cuda_cflags=cuda_cflags, verbose=verbose)
