"""Builds the plain-C CPU kernels of ``csrc/`` on first use and loads them with ctypes.

The C files include no torch header, so the system C compiler builds them in well under
a second (the CUDA extension's torch-header build takes about a minute): a first
``nibble serve`` on a CPU does not wait for it. The library lands in
``$NIBBLE_CPU_KERNEL_DIR`` (default ``~/.cache/nibble/cpu_kernels``) under a name that
hashes the source, the headers beside it, the flags, the compiler's version and the CPU
model, so a changed source or another machine sharing the home directory gets its own
build. A missing compiler or a failed build is reported once (:func:`load` returns None)
and callers keep their torch path.

``-ffp-contract=off`` and no ``-ffast-math``: every fp32 operation rounds as written,
which is what makes the quantizer bit-identical to the torch reference.

``$NIBBLE_CPU_MARCH`` (default ``native``) is the ``-march`` of the build: ``x86-64-v3``
builds the AVX2 paths on an AVX512 machine, to test or time them as an AVX2 CPU runs them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().with_name("csrc")
CFLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
DISABLE_ENV = "NIBBLE_CPU_KERNELS"          # "0": never build or load them
MARCH_ENV = "NIBBLE_CPU_MARCH"              # -march of the build (default native)


def cflags() -> tuple[str, ...]:
    """The compiler flags: :data:`CFLAGS` and ``-march`` from ``$NIBBLE_CPU_MARCH``."""
    march = os.environ.get(MARCH_ENV, "native")
    if not march or not all(c.isalnum() or c in "-_." for c in march):
        raise ValueError(f"${MARCH_ENV}={march!r} is not an -march value")
    return (*CFLAGS, f"-march={march}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _tag(cc: str, source: Path) -> str:
    h = hashlib.sha1(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):        # what the sources may include
        h.update(b"\0" + header.name.encode() + b"\0" + header.read_bytes())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    for part in (" ".join(cflags()), version.stdout, _cpu_model(), platform.machine()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:12]


def _cache_dir() -> Path:
    root = os.environ.get("NIBBLE_CPU_KERNEL_DIR")
    return Path(root) if root else Path.home() / ".cache" / "nibble" / "cpu_kernels"


def _compile(cc: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *cflags(), "-o", tmp, str(source), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)          # atomic: a concurrent builder loads a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` as a loaded library, built first if needed; None where it cannot
    be built here (no C compiler, a failed build, or ``NIBBLE_CPU_KERNELS=0``)."""
    if os.environ.get(DISABLE_ENV) == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    source = CSRC_DIR / f"{name}.c"
    if cc is None:
        log.warning("no C compiler found: the CPU kernel %s is not built (torch path used)", name)
        return None
    try:
        target = _cache_dir() / f"{name}_{_tag(cc, source)}.so"
        if not target.exists():
            _compile(cc, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("the CPU kernel %s could not be built (torch path used): %s", name, detail)
        return None
