"""bench/cpu_context: the engine stepped to each context, the C decode attention timed."""

from __future__ import annotations

import json

import pytest

from nibble.kernels.cpu import decode as cpu_decode
from nibble.services.errors import ModelLoadError
from nibble.services.models import default_model_path

try:
    default_model_path()
except ModelLoadError as e:
    pytest.skip(f"embedded model not installed: {e}", allow_module_level=True)


@pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler here")
def test_rows_per_context_with_the_layer_timed(tmp_path):
    from nibble.bench import cpu_context
    orig = cpu_decode.DecodeStep._run
    cpu_context.main(["--contexts", "48", "60", "--steps", "2", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "cpu_context.json").read_text())
    assert [r["context"] for r in rows] == [48, 60]
    assert all(r["step_ms"] > 0 and r["decode_layer_us"] > 0 for r in rows)
    assert cpu_decode.DecodeStep._run is orig             # the timer is taken off again
