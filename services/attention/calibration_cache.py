"""A disk cache of calibrated K-recipe parameters: a restart skips the calibration forwards.

Calibrating the default format's K recipe runs the model over about 700 tokens at several
positions: 13 of the 19 s a CPU server needs to start, several seconds on a GPU. The
parameters depend only on what :func:`cache_key` hashes (the weights' fingerprint, dtype,
device kind, the format and its recipe, the engine's context, the calibration ids, the
pool's global scales, the sliding windows, the tensor-parallel rank, the torch version and
this module's ``CACHE_VERSION``), so they are stored under that key and read back instead.

Trust: the directory is the user's own, like the weights it sits beside
(``$XDG_CACHE_HOME/nibble/calibration``, else ``~/.cache/nibble/calibration``): created
mode 0700, and a directory or file owned by another user, or writable by group or others,
is neither read nor written. Files are safetensors (no pickle); a record is accepted only
if its recipe, key and shapes match and its tensors hash to the digest it names (a torn
or edited file is recalibrated and rewritten). Writes go to a temporary file renamed into
place, so workers that calibrate side by side never read half a file. A cache that cannot
be used (read-only file system, foreign owner) costs a warning, never the start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from nibble.kernels.recipes import RecipeParams

log = logging.getLogger(__name__)
CACHE_VERSION = 1          # bump when the calibration's inputs or algorithm change
_TENSORS = ("k_shift", "k_map", "v_shift")


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nibble" / "calibration"


def resolve_dir(setting: str | None) -> Path | None:
    """``--calibration-cache-dir``: ``auto`` (or None) = :func:`default_dir`, ``off`` = no
    cache, else that directory."""
    if setting in (None, "", "auto"):
        return default_dir()
    return None if setting == "off" else Path(setting)


def cache_key(*, fingerprint: str, kv_format: str, recipe, dtype: torch.dtype, device: str,
              context: int, ids: Sequence[int], global_scales: torch.Tensor,
              windows: Sequence[int | None], tp_rank: int, tp_size: int) -> str:
    """Hex sha256 of everything the calibrated parameters depend on."""
    h = hashlib.sha256()
    h.update(json.dumps({
        "version": CACHE_VERSION, "torch": torch.__version__, "fingerprint": fingerprint,
        "kv_format": kv_format, "recipe": recipe.__dict__, "dtype": str(dtype),
        "device": device, "context": context, "windows": list(windows),
        "tp": [tp_rank, tp_size]}, sort_keys=True).encode())
    h.update(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes())
    h.update(global_scales.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _private(path: Path) -> bool:
    """``path`` is ours and nobody else can write it."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class CalibrationCache:
    """Parameters by :func:`cache_key` under ``root`` (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = root

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def load(self, key: str, recipe, shape: tuple[int, int, int]) -> RecipeParams | None:
        """The stored parameters of ``key``, or None (absent, foreign, torn or edited)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        path = self._path(key)
        try:
            if not path.exists() or not _private(self.root) or not _private(path):
                if path.exists():
                    log.warning("calibration cache: %s is not private to this user; ignored",
                                path)
                return None
            tensors = load_file(str(path))
            with open(path, "rb") as f:      # the header's metadata
                meta = _metadata(f)
        except (OSError, SafetensorError, ValueError) as exc:
            log.warning("calibration cache: %s unreadable (%s); recalibrating", path, exc)
            return None
        return self._check(path, key, recipe, shape, tensors, meta)

    @staticmethod
    def _check(path, key, recipe, shape, tensors, meta) -> RecipeParams | None:
        want_recipe = json.dumps(recipe.__dict__, sort_keys=True)
        if meta.get("key") != key or meta.get("recipe") != want_recipe \
                or tuple(tensors.get("k_shift", torch.empty(0)).shape) != shape \
                or set(tensors) - set(_TENSORS):
            log.warning("calibration cache: %s does not match its key; recalibrating", path)
            return None
        try:
            params = RecipeParams.create(recipe, tensors["k_shift"], tensors.get("k_map"),
                                         tensors.get("v_shift"))
        except (RuntimeError, ValueError) as exc:       # singular map, non-finite values
            log.warning("calibration cache: %s holds unusable parameters (%s)", path, exc)
            return None
        if params.digest != meta.get("digest"):
            log.warning("calibration cache: %s is damaged (digest); recalibrating", path)
            return None
        return params

    def store(self, key: str, params: RecipeParams) -> None:
        """Write ``params`` under ``key`` (atomically); a failure is logged, not raised."""
        from safetensors.torch import save_file
        tensors = {n: getattr(params, n) for n in _TENSORS if getattr(params, n) is not None}
        meta = {"key": key, "digest": params.digest,
                "recipe": json.dumps(params.recipe.__dict__, sort_keys=True)}
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _private(self.root):
                log.warning("calibration cache: %s is not private to this user; not written",
                            self.root)
                return
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".safetensors")
            os.close(fd)
            try:
                save_file({n: t.contiguous() for n, t in tensors.items()}, tmp, metadata=meta)
                os.chmod(tmp, 0o600)
                os.replace(tmp, self._path(key))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as exc:
            log.warning("calibration cache: could not write under %s (%s); the next start "
                        "calibrates again (--calibration-cache-dir)", self.root, exc)


def _metadata(f) -> dict:
    """The ``__metadata__`` of a safetensors file (8-byte length, then the JSON header)."""
    n = int.from_bytes(f.read(8), "little")
    if not 0 < n <= 1 << 20:
        raise ValueError("bad safetensors header length")
    return json.loads(f.read(n)).get("__metadata__") or {}
