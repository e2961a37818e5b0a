"""API keys over gRPC: the HTTP policy by method, tenants, and who may abort what."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from nibble.proto.nibble.v1 import nibble_pb2 as pb
from nibble.services.config import ServerConfig
from nibble.services.frontend.auth import tenant_id
from nibble.services.grpc_api.auth import GrpcAuth, peer_host

from .conftest import run, serving, wait_for

Code = grpc.StatusCode
KEYS = ServerConfig(api_keys=("sk-user", "sk-other"), admin_api_keys=("sk-admin",))


def bearer(key):
    return (("authorization", f"Bearer {key}"),)


async def code_of(aw) -> grpc.StatusCode:
    try:
        result = aw()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as err:
        return err.code()
    return Code.OK


LOCAL, REMOTE = "ipv4:127.0.0.1:5000", "ipv4:203.0.113.7:5000"


def test_policy_by_method():
    auth = GrpcAuth(KEYS)
    gen, info = "/nibble.v1.Nibble/Generate", "/nibble.v1.Nibble/GetServerInfo"
    assert auth.refusal("/grpc.health.v1.Health/Check", (), REMOTE) is None
    assert auth.refusal(gen, (), LOCAL)[0] == Code.UNAUTHENTICATED
    assert auth.refusal(gen, bearer("sk-nope"), LOCAL)[0] == Code.UNAUTHENTICATED
    assert auth.refusal(gen, bearer("sk-user"), REMOTE) is None
    assert auth.refusal(gen, (("x-api-key", "sk-other"),), REMOTE) is None
    assert auth.refusal(gen, bearer("sk-admin"), REMOTE) is None  # admin keys work on /v1 too
    assert auth.refusal(info, bearer("sk-user"), LOCAL)[0] == Code.PERMISSION_DENIED
    assert auth.refusal(info, (), LOCAL)[0] == Code.UNAUTHENTICATED
    assert auth.refusal(info, bearer("sk-admin"), REMOTE) is None
    assert auth.refusal("/unknown.Service/X", (), LOCAL)[0] == Code.UNAUTHENTICATED
    assert auth.identify(bearer("sk-user"), LOCAL).tenant == tenant_id(b"sk-user")
    assert not auth.identify(bearer("sk-user"), LOCAL).admin
    assert auth.identify(bearer("sk-admin"), REMOTE).admin
    no_admin_key = GrpcAuth(ServerConfig(api_keys=("sk-user",)))
    assert no_admin_key.refusal(info, (), LOCAL) is None
    assert no_admin_key.refusal(info, bearer("sk-user"), REMOTE)[0] == Code.PERMISSION_DENIED
    assert no_admin_key.refusal(info, (("x-forwarded-for", "1.2.3.4"),), LOCAL)[0] == \
        Code.PERMISSION_DENIED
    open_auth = GrpcAuth(ServerConfig())
    assert open_auth.refusal(info, (), LOCAL) is None and open_auth.identify((), LOCAL).admin
    assert open_auth.refusal(info, (), REMOTE)[0] == Code.PERMISSION_DENIED


@pytest.mark.parametrize("peer, host", [("ipv4:127.0.0.1:5000", "127.0.0.1"),
                                        ("ipv6:[::1]:5000", "::1"),
                                        ("ipv6:%5B::1%5D:5000", "::1"),
                                        ("ipv6:[::ffff:10.0.0.1]:1", "::ffff:10.0.0.1"),
                                        ("unix:/tmp/s", None), ("", None), (None, None)])
def test_peer_host(peer, host):
    assert peer_host(peer) == host


def test_keys_enforced_on_the_wire(FakeEngine):
    engine = FakeEngine("ok")

    async def main():
        async with serving(engine, KEYS) as c:
            req = pb.GenerateRequest(text="hi", cache_salt="s")
            codes = {
                "no key": await code_of(lambda: c.stub.Generate(req)),
                "wrong key": await code_of(lambda: c.stub.Generate(req, metadata=bearer("x"))),
                "user key": await code_of(lambda: c.stub.Generate(
                    req, metadata=bearer("sk-user"))),
                "info as user": await code_of(lambda: c.stub.GetServerInfo(
                    pb.GetServerInfoRequest(), metadata=bearer("sk-user"))),
                "flush as admin": await code_of(lambda: c.stub.FlushCache(
                    pb.FlushCacheRequest(), metadata=bearer("sk-admin"))),
                "health open": await code_of(lambda: c.health.Check(
                    health_pb2.HealthCheckRequest())),
            }
            refl = reflection_pb2_grpc.ServerReflectionStub(c.channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            codes["reflection no key"] = await code_of(lambda: refl.ServerReflectionInfo(
                iter([ask])))
            return codes

    codes = run(main())
    assert codes == {"no key": Code.UNAUTHENTICATED, "wrong key": Code.UNAUTHENTICATED,
                     "user key": Code.OK, "info as user": Code.PERMISSION_DENIED,
                     "flush as admin": Code.OK, "health open": Code.OK,
                     "reflection no key": Code.UNAUTHENTICATED}
    (req,) = engine.requests                      # refused calls never reach the engine
    assert req.cache_salt == f"{tenant_id(b'sk-user')}:s"


def test_abort_is_scoped_to_the_tenant(FakeEngine):
    engine = FakeEngine("abcdef", hang_after=1)

    async def main():
        async with serving(engine, KEYS) as c:
            call = c.stub.Generate(pb.GenerateRequest(request_id="job", text="hi"),
                                   metadata=bearer("sk-user"))
            await call.read()
            engine_id = engine.requests[0].request_id
            other = await c.stub.Abort(pb.AbortRequest(request_id="job"),
                                       metadata=bearer("sk-other"))
            other_by_engine_id = await c.stub.Abort(pb.AbortRequest(request_id=engine_id),
                                                    metadata=bearer("sk-other"))
            with pytest.raises(grpc.aio.AioRpcError) as all_as_user:
                await c.stub.Abort(pb.AbortRequest(abort_all=True), metadata=bearer("sk-user"))
            admin = await c.stub.Abort(pb.AbortRequest(request_id=engine_id),
                                       metadata=bearer("sk-admin"))
            await wait_for(lambda: engine.aborted)
            call.cancel()
            return other, other_by_engine_id, all_as_user.value, admin

    other, other_by_engine_id, all_as_user, admin = run(main())
    assert other.num_aborted == 0 and other_by_engine_id.num_aborted == 0
    assert all_as_user.code() == Code.PERMISSION_DENIED
    assert admin.num_aborted == 1
    assert engine.aborted[0] == engine.requests[0].request_id


def test_reflection_lists_the_services(FakeEngine):
    async def main():
        async with serving(FakeEngine()) as c:
            refl = reflection_pb2_grpc.ServerReflectionStub(c.channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            return [r async for r in refl.ServerReflectionInfo(iter([ask]))]

    (reply,) = run(main())
    names = {s.name for s in reply.list_services_response.service}
    assert {"nibble.v1.Nibble", "grpc.health.v1.Health"} <= names
