"""RecipeHook.layer_params: what the fused QKV kernel reads, kept current in place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nibble.kernels import PageLayout
from nibble.kernels.formats import DEFAULT_K_RECIPE
from nibble.kernels.recipes import RecipeParams
from nibble.services.attention.base import RecipeHook

L, H, D = 2, 2, 32


def _params(seed: int) -> RecipeParams:
    gen = torch.Generator().manual_seed(seed)
    qr = torch.linalg.qr(torch.randn(L, H, D, D, generator=gen, dtype=torch.float64))[0]
    return RecipeParams.create(DEFAULT_K_RECIPE, torch.randn(L, H, D, generator=gen),
                               qr.float(), None)


def _check(device: str, map_dtype: torch.dtype) -> None:
    pool = SimpleNamespace(layout=PageLayout("nvfp4", L, H, D, 16), recipe_params=_params(1))
    hook = RecipeHook(pool, torch.device(device))
    dev = torch.empty(0, device=device).device
    first = hook.layer_params(1, dev)
    assert first["k_map"].dtype == map_dtype and first["q_map"].dtype == map_dtype
    assert first["k_shift"].dtype == torch.float32            # shifts are subtracted in fp32
    p = pool.recipe_params
    assert torch.equal(first["k_map"].cpu(), p.k_map[1].to(map_dtype))
    assert torch.equal(first["k_shift"].cpu(), p.k_shift[1])
    pool.recipe_params = _params(2)                          # recalibrated: same tensors, new values
    again = hook.layer_params(1, dev)
    assert again["k_map"].data_ptr() == first["k_map"].data_ptr()
    assert torch.equal(first["k_map"].cpu(), pool.recipe_params.k_map[1].to(map_dtype))
    assert torch.equal(first["q_map"].cpu(), pool.recipe_params.q_map[1].to(map_dtype))


def test_layer_params_fp32_maps_on_cpu():
    _check("cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layer_params_bf16_maps_on_gpu():
    """The kernel rounds the maps to bf16 for its MMAs: bf16 copies read half the bytes."""
    _check("cuda", torch.bfloat16)
