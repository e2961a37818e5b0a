"""Run the Triton kernels through the CPU interpreter when there is no CUDA GPU.

``TRITON_INTERPRET`` must be set before the kernel modules are decorated
(imported), so this happens at conftest import, ahead of the test modules.
On a GPU machine the kernels run natively and the CPU-interpreter cases skip.
"""

import os
import sys
import types
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import nibble.kernels  # noqa: F401
except ImportError:
    # Not installed (e.g. a bare GPU machine): map nibble.* onto the repo's folders.
    _pkg = types.ModuleType("nibble")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[3])]
    sys.modules["nibble"] = _pkg
