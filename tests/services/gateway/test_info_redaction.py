"""Issue 14, finding 4a: /get_server_info never shows a credential of any URL in the config."""

from __future__ import annotations

import dataclasses

import pytest

from nibble.services.config import HiCacheConfig, NibbleConfig
from nibble.services.engine.async_engine import redacted_config

URLS = ["redis://default:hunter2@redis.internal:6379/0",
        "redis://redis.internal:6379/0?password=hunter2&db=1"]


def config_with(url: str) -> NibbleConfig:
    return dataclasses.replace(NibbleConfig(), hicache=HiCacheConfig(
        enable_hierarchical_cache=True, hicache_storage_backend="redis", hicache_storage_url=url))


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("source", ["engine", "gateway"])
def test_get_server_info_redacts_url_credentials(FakeEngine, make_client, url, source):
    """``engine``: the engine's own redacted config; ``gateway``: an engine (a worker, a
    plugin) that hands over a raw config is redacted by the gateway all the same."""
    cfg = config_with(url)
    shown = redacted_config(cfg) if source == "engine" else dataclasses.asdict(cfg)

    class Engine(FakeEngine):
        async def server_info(self):
            return {**await super().server_info(), "config": shown}

    r = make_client(Engine()).get("/get_server_info")
    assert r.status_code == 200
    assert "hunter2" not in r.text
    assert "redis.internal:6379" in r.json()["config"]["hicache"]["hicache_storage_url"]
