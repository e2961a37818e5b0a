"""Disaggregated workers must share the K-recipe parameters (and model, layout)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from nibble.kernels import PageLayout  # noqa: E402
from nibble.services.disagg.orchestrator import check_same_kv_identity  # noqa: E402
from nibble.services.disagg.router import Router  # noqa: E402
from nibble.services.errors import ConfigError  # noqa: E402
from nibble.tiering.page_record import chain_keys, namespace_root  # noqa: E402
from nibble.tiering.secret import KVSecret  # noqa: E402

LAYOUT = dict(kv_format="nvfp4", num_layers=2, num_kv_heads=2, head_dim=16, page_size=16)


def info(wid: str, recipe: str = "abcd", fingerprint: str = "fp") -> dict:
    return {"worker_id": wid, "fingerprint": fingerprint, "layout": dict(LAYOUT), "recipe": recipe}


def test_workers_with_the_same_parameters_pass():
    check_same_kv_identity([info("p0"), info("d0"), info("d1")])


@pytest.mark.parametrize("odd", [info("d1", recipe="ffff"), info("d1", fingerprint="other"),
                                 {**info("d1"), "layout": {**LAYOUT, "kv_format": "nvfp4_plain"}}])
def test_a_worker_with_other_parameters_is_refused(odd):
    with pytest.raises(ConfigError, match="d1.*not interchangeable"):
        check_same_kv_identity([info("p0"), info("d0"), odd])


def test_router_keys_include_the_parameters():
    layout = PageLayout(**LAYOUT)
    tokens = list(range(32))
    for recipe in ("", "abcd"):
        secret = KVSecret("identity-tests-secret-0123456789")
        router = Router.for_model("fp", layout, recipe=recipe, secret=secret)
        want = chain_keys(namespace_root("fp", layout, "", recipe, secret=secret), tokens, 16,
                          secret=secret)
        assert chain_keys(router._root_fn(""), tokens, 16, secret=secret) == want
