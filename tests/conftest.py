"""Suite-wide settings: Triton's CPU interpreter without a GPU; GPU tests skip without CUDA.

Triton picks the interpreter when a kernel is *decorated*, so
``TRITON_INTERPRET`` is set here, first, before any test module imports
``nibble.kernels.triton`` (directly or through ``nibble.services.attention``).
An explicit setting in the environment wins.
"""

import os
import shutil
import sys


def _may_have_nvidia_gpu() -> bool:
    """A cheap guess made without importing torch or triton."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


if not _may_have_nvidia_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402  (importing torch does not import triton)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "triton" not in sys.modules:
    # A driver without a CUDA-enabled torch (e.g. the CPU wheel on a GPU host).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


pytest_plugins = ["tests.redis_fixtures"]
