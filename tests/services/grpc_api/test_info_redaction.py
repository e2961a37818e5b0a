"""Issue 14, finding 4a: gRPC GetServerInfo never shows a credential of any URL."""

from __future__ import annotations


import pytest

from nibble.proto.nibble.v1 import nibble_pb2 as pb

from .conftest import run, serving


@pytest.mark.parametrize("url", ["redis://default:hunter2@redis.internal:6379/0",
                                 "redis://redis.internal:6379/0?password=hunter2"])
def test_get_server_info_redacts_url_credentials(FakeEngine, url):
    class Engine(FakeEngine):
        async def server_info(self):
            info = await super().server_info()
            info["config"] = {**info["config"], "hicache": {"hicache_storage_url": url}}
            return info

    async def main():
        async with serving(Engine()) as c:
            return await c.stub.GetServerInfo(pb.GetServerInfoRequest())

    info = run(main())
    assert "hunter2" not in info.json and "redis.internal:6379" in info.json
