"""bench/decode_l2_warm.py's plot (the timing itself needs an sm_90 GPU)."""

from __future__ import annotations

from nibble.bench import decode_l2_warm


def test_decode_l2_warm_plot(tmp_path):
    forms = decode_l2_warm.FORMS
    data = {"results": [{"fmt": f, "batch": 16, "ctx": 32768,
                         "us_per_layer": {x: 100.0 + i for i, x in enumerate(forms)}}
                        for f in ("nvfp4", "fp8_e4m3")]}
    decode_l2_warm.plot(data, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
