"""bench/decode_pdl.py's plot (the timing itself needs an sm_90 GPU)."""

from __future__ import annotations

from nibble.bench import decode_pdl


def test_decode_pdl_plot(tmp_path):
    data = {"results": [{"fmt": "nvfp4", "batch": 16, "ctx": 32768, "us_per_layer_plain": 181.5,
                         "us_per_layer_pdl": 178.3}]}
    decode_pdl.plot(data, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
