"""bench/decode_forms.py's split arithmetic and plot (the timing itself needs an sm_90 GPU)."""

import json

import pytest

from nibble.bench import decode_forms


@pytest.mark.parametrize("base,slots,pairs,want", [
    (4, 528, 128, 33),      # 16 x 8 pairs on 132 SMs x 4 CTAs: 33 x 128 = 8 x 528
    (8, 528, 64, 33),
    (2, 264, 128, 33),
    (4, 512, 128, 4),       # already whole waves
    (40, 528, 128, 66),     # at least base
])
def test_whole_wave_splits(base, slots, pairs, want):
    got = decode_forms.whole_wave_splits(base, slots, pairs)
    assert got == want and got >= base and pairs * got % slots == 0


def test_decode_forms_plot(tmp_path):
    forms = {"v10424 x4": 170.0, "v10434 x4": 174.0}
    data = {"read_ceiling": 4.5e12, "results": [
        {"fmt": "nvfp4", "batch": 16, "ctx": 32768, "us_per_layer": forms},
        {"fmt": "fp8_e4m3", "batch": 16, "ctx": 32768, "us_per_layer": {"v110602 x2": 265.9}}]}
    (tmp_path / "d.json").write_text(json.dumps(data))
    decode_forms.plot(data, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
