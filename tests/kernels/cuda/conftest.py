"""Map ``nibble.*`` onto the repository's folders when the package is not installed."""

import sys
import types
from pathlib import Path

try:
    import nibble.kernels  # noqa: F401
except ImportError:
    _pkg = types.ModuleType("nibble")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[3])]
    sys.modules["nibble"] = _pkg
