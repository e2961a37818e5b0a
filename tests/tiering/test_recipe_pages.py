"""K-recipe parameters travel with the pages: pool, page records, content keys, tiers."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import KernelInputError, PageLayout
from nibble.kernels.formats import KRecipe
from nibble.kernels.recipes import RecipeParams
from nibble.tiering import KVPool
from nibble.tiering.page_record import (PageHeader, PageRecordError, decode_page, encode_page,
                                        namespace_root)
from nibble.tiering.radix_cache import RadixCache
from nibble.tiering.secret import KVSecret
from nibble.tiering.tier_manager import TierManager

GEOM = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16)
SECRET = KVSecret("recipe-tests-secret-0123456789")
KEY = bytes(32)


def _params(fmt: str = "nvfp4", seed: int = 0, shape=(2, 2, 16)) -> RecipeParams:
    layout = PageLayout(fmt, **GEOM)
    g = torch.Generator().manual_seed(seed)
    m = torch.eye(shape[2]) + 0.1 * torch.randn(*shape, shape[2], generator=g)
    return RecipeParams.create(layout.fmt.k_recipe, torch.randn(*shape, generator=g), m, None)


def test_pool_takes_only_matching_parameters_while_empty():
    pool = KVPool(PageLayout("nvfp4", **GEOM), 4)
    assert pool.recipe_digest == ""
    with pytest.raises(KernelInputError, match="do not belong"):
        pool.set_recipe_params(RecipeParams.create(KRecipe("sink"), torch.zeros(2, 2, 16),
                                                   None, None))
    with pytest.raises(KernelInputError, match="do not fit"):
        pool.set_recipe_params(_params(shape=(2, 1, 16)))
    p = _params()
    pool.set_recipe_params(p)
    assert pool.recipe_digest == p.digest
    pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.set_recipe_params(_params(seed=1))
    plain = KVPool(PageLayout("nvfp4_plain", **GEOM), 2)
    with pytest.raises(KernelInputError):
        plain.set_recipe_params(p)


def test_page_record_refuses_other_parameters():
    layout = PageLayout("nvfp4", **GEOM)
    scales = torch.ones(2, 2)
    a, b = _params(seed=0).digest, _params(seed=1).digest
    payload = torch.arange(layout.page_nbytes, dtype=torch.int32).to(torch.uint8).reshape(
        2, layout.layer_nbytes)
    auth = dict(key=KEY, secret=SECRET)
    blob = encode_page(PageHeader.for_pool(layout, 1, scales, a), payload, **auth)
    assert bytes(decode_page(blob, PageHeader.for_pool(layout, 1, scales, a), **auth)) == bytes(
        payload.numpy())
    for other in (b, ""):
        with pytest.raises(PageRecordError, match="K-recipe parameters"):
            decode_page(blob, PageHeader.for_pool(layout, 1, scales, other), **auth)
    # A record without a recipe (plain formats) still loads where none is expected.
    plain = PageLayout("nvfp4_plain", **GEOM)
    blob = encode_page(PageHeader.for_pool(plain, 0, scales), payload, **auth)
    decode_page(blob, PageHeader.for_pool(plain, 0, scales, ""), **auth)


def test_content_keys_are_namespaced_by_the_parameters():
    layout = PageLayout("nvfp4", **GEOM)
    a, b = _params(seed=0).digest, _params(seed=1).digest
    roots = {namespace_root("m", layout, "t", r, secret=SECRET) for r in ("", a, b)}
    assert len(roots) == 3
    assert namespace_root("m", layout, "t", secret=SECRET) == \
        namespace_root("m", layout, "t", "", secret=SECRET)


def test_tier_manager_headers_and_keys_follow_the_pool():
    pools = []
    for seed in (0, 1):
        pool = KVPool(PageLayout("nvfp4", **GEOM), 4)
        pool.set_recipe_params(_params(seed=seed))
        pools.append(pool)
    tms = [TierManager(p, RadixCache(16, p), "fp", None, None, secret=SECRET) for p in pools]
    try:
        assert tms[0].header().recipe == pools[0].recipe_digest != tms[1].header().recipe
        tokens = list(range(32))
        assert tms[0].keys("", tokens, 2) != tms[1].keys("", tokens, 2)
    finally:
        for tm in tms:
            tm.close()
