"""The gRPC auth matrix: the HTTP matrix (gateway/test_auth_matrix.py) by method, on a real
in-process server, keys sent as metadata.

Cells are status names; an Abort that is allowed answers OK with ``num_aborted`` 1 or 0
(``OK/1``, ``OK/0``: a foreign id looks exactly like an unknown one). The remote column
is simulated by making the server read every peer as 203.0.113.7 (``peer_host``
patched): the call still travels over loopback.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from nibble.proto.nibble.v1 import nibble_pb2 as pb
from nibble.services.config import ServerConfig
from nibble.services.frontend.auth import tenant_id
from nibble.services.grpc_api import auth as grpc_auth

from .conftest import run, serving

A_RID = "cmpl-owned-by-a"
KEYS = {"none": None, "A": "sk-tenant-a", "B": "sk-tenant-b", "admin": "sk-admin"}
DEPLOYMENTS = {
    "tenants+admin": ServerConfig(api_keys=("sk-tenant-a", "sk-tenant-b"),
                                  admin_api_keys=("sk-admin",)),
    "tenants only": ServerConfig(api_keys=("sk-tenant-a", "sk-tenant-b")),
    "no keys": ServerConfig(host="0.0.0.0", allow_unauthenticated=True),
}
U, D = "UNAUTHENTICATED", "PERMISSION_DENIED"
EXPECTED = {
    "tenants+admin": {
        "Health":        "OK OK OK OK | OK OK OK OK",
        "Generate":      f"{U} OK OK OK | {U} OK OK OK",
        "FlushCache":    f"{U} {D} {D} OK | {U} {D} {D} OK",
        "GetServerInfo": f"{U} {D} {D} OK | {U} {D} {D} OK",
        "abort_all":     f"{U} {D} {D} OK | {U} {D} {D} OK",
        "abort A's rid": f"{U} OK/1 OK/0 OK/1 | {U} OK/1 OK/0 OK/1",
        "abort unknown": f"{U} OK/0 OK/0 OK/0 | {U} OK/0 OK/0 OK/0",
    },
    "tenants only": {
        "Health":        "OK OK OK OK | OK OK OK OK",
        "Generate":      f"{U} OK OK {U} | {U} OK OK {U}",
        "FlushCache":    f"OK OK OK OK | {D} {D} {D} {D}",
        "GetServerInfo": f"OK OK OK OK | {D} {D} {D} {D}",
        "abort_all":     f"OK OK OK OK | {U} {D} {D} {U}",
        "abort A's rid": f"OK/1 OK/1 OK/1 OK/1 | {U} OK/1 OK/0 {U}",
        "abort unknown": f"OK/0 OK/0 OK/0 OK/0 | {U} OK/0 OK/0 {U}",
    },
    "no keys": {
        "Health":        "OK OK OK OK | OK OK OK OK",
        "Generate":      "OK OK OK OK | OK OK OK OK",
        "FlushCache":    f"OK OK OK OK | {D} {D} {D} {D}",
        "GetServerInfo": f"OK OK OK OK | {D} {D} {D} {D}",
        "abort_all":     f"OK OK OK OK | {D} {D} {D} {D}",
        "abort A's rid": "OK/1 OK/1 OK/1 OK/1 | OK/1 OK/1 OK/1 OK/1",
        "abort unknown": "OK/0 OK/0 OK/0 OK/0 | OK/0 OK/0 OK/0 OK/0",
    },
}


def call_for(c, method: str, metadata):
    if method == "Health":
        return c.health.Check(health_pb2.HealthCheckRequest(), metadata=metadata)
    if method == "FlushCache":
        return c.stub.FlushCache(pb.FlushCacheRequest(), metadata=metadata)
    if method == "GetServerInfo":
        return c.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata)
    if method == "abort_all":
        return c.stub.Abort(pb.AbortRequest(abort_all=True), metadata=metadata)
    rid = A_RID if method == "abort A's rid" else "cmpl-nobody"
    return c.stub.Abort(pb.AbortRequest(request_id=rid), metadata=metadata)


async def cell(c, method: str, key: str | None) -> str:
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    try:
        if method == "Generate":
            async for _ in c.stub.Generate(pb.GenerateRequest(text="hi"), metadata=metadata):
                pass
            return "OK"
        reply = await call_for(c, method, metadata)
    except grpc.aio.AioRpcError as err:
        return err.code().name
    return f"OK/{reply.num_aborted}" if method.startswith("abort ") else "OK"


async def row(c, method: str) -> str:
    return " ".join([await cell(c, method, key) for key in KEYS.values()])


@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_grpc_auth_matrix(FakeEngine, deployment, monkeypatch):
    cfg = DEPLOYMENTS[deployment]
    engine = FakeEngine("ok")
    real_peer_host = grpc_auth.peer_host

    async def main() -> dict[str, str]:
        async with serving(engine, cfg) as c:
            owner = tenant_id(b"sk-tenant-a") if cfg.api_keys else None
            c.server.servicer.inflight.track(A_RID, owner)
            local = {m: await row(c, m) for m in EXPECTED[deployment]}
            monkeypatch.setattr(grpc_auth, "peer_host", lambda peer: "203.0.113.7")
            remote = {m: await row(c, m) for m in EXPECTED[deployment]}
            monkeypatch.setattr(grpc_auth, "peer_host", real_peer_host)
            return {m: f"{local[m]} | {remote[m]}" for m in local}

    got = run(main())
    mismatches = [f"{m}: expected {want}, got {got[m]}"
                  for m, want in EXPECTED[deployment].items() if got[m] != want]
    assert not mismatches, "\n".join(mismatches)
    assert "cmpl-nobody" not in engine.aborted
