"""KVPool: capacity per format and page views."""

import pytest
import torch

from nibble.kernels import PageLayout
from nibble.tiering import KVPool, pages_for_budget

GEOM = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16)  # SmolLM2-135M


def test_same_bytes_hold_1_78x_tokens_in_nvfp4():
    budget = 64 << 20
    tokens = {f: pages_for_budget(PageLayout(f, **GEOM), budget) * 16
              for f in ("bf16", "fp8_e4m3", "nvfp4")}
    assert tokens["nvfp4"] / tokens["fp8_e4m3"] == pytest.approx(16 / 9, rel=2e-3)
    assert tokens["fp8_e4m3"] / tokens["bf16"] == pytest.approx(2.0, rel=2e-3)
    # 0.5625 bytes per value for nvfp4 (codes + E4M3 scales), 1 for fp8.
    nv, f8 = PageLayout("nvfp4", **GEOM), PageLayout("fp8_e4m3", **GEOM)
    values_per_token = 30 * 3 * 64 * 2
    assert nv.bytes_per_token / values_per_token == 0.5625
    assert f8.bytes_per_token / values_per_token == 1.0


def test_pool_capacity_and_views():
    layout = PageLayout("nvfp4", num_layers=2, num_kv_heads=2, head_dim=32, page_size=16)
    pool = KVPool(layout, 5)
    cap = pool.capacity()
    assert (cap.num_pages, cap.max_tokens, cap.pool_bytes) == (5, 80, 5 * layout.page_nbytes)
    view = pool.layer(1)
    assert view.k_data.shape == (5, 2, 16, 16) and view.k_scale.shape == (5, 2, 16, 2)
    view.v_scale[3, 1, 15, 1] = 7
    # The last byte of layer 1 of page 3 is that scale byte.
    assert pool.pages[3, 1, -1].item() == 7
    assert int(pool.pages.sum()) == 7


def test_global_scales_change_only_on_an_empty_pool():
    layout = PageLayout("fp8_e4m3", num_layers=2, num_kv_heads=1, head_dim=16, page_size=16)
    pool = KVPool(layout, 2)
    pool.set_global_scales(torch.full((2, 2), 0.5))
    assert pool.scale_version == 1 and pool.scales(1) == (0.5, 0.5)
    pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.set_global_scales(torch.ones(2, 2))
