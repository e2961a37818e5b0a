"""bench/kv_read_paths.py's expected XOR: every word of every tile the kernels read, once."""

from __future__ import annotations

import torch

from nibble.bench import kv_read_paths as krp
from nibble.kernels import PageLayout


def _slow_xor(view, tables, seq_len):
    acc = 0
    for b in range(tables.shape[0]):
        for sec in (view.k_data, view.v_data, view.k_scale, view.v_scale):
            for h in range(sec.shape[1]):
                for t in range(seq_len):
                    page, off = int(tables[b, t // sec.shape[2]]), t % sec.shape[2]
                    for w in sec[page, h, off].contiguous().view(torch.int32).tolist():
                        acc ^= w & 0xFFFFFFFF
    return acc


def test_expected_xor_matches_a_word_by_word_walk():
    layout = PageLayout("nvfp4", 1, 2, 128, 16)
    pool = layout.allocate(7).random_(0, 256, generator=torch.Generator().manual_seed(3))
    view = layout.layer_view(pool, 0)
    tables = torch.tensor([[4, 1, 6], [0, 5, 2]], dtype=torch.int32)
    assert krp._expected(view, tables, 48) == _slow_xor(view, tables, 48)
    assert krp._expected(view, tables, 32) == _slow_xor(view, tables, 32)


def test_xor_all_of_an_odd_count():
    w = torch.tensor([1, 2, 4, 8, 16], dtype=torch.int32)
    assert krp._xor_all(w) == 31


def test_plot(tmp_path):
    paths = {f"{m}_x4": {"share": 0.9} for m in krp.MODES}
    data = {"read_tbs": 4.47, "cases": [{"batch": 8, "ctx": 32768, "page_size": 16,
                                         "paths": paths}]}
    krp.plot(data, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
