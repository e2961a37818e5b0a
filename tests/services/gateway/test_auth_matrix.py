"""The HTTP auth matrix: every route kind x {no key, tenant A, tenant B, admin key} x
{loopback client, remote client}, for three deployments, with the exact status of each cell.

Each row of a table is ``"<loopback: none A B admin> | <remote: none A B admin>"``. A
request of tenant A is in flight (``A_RID``; anonymous in the keyless deployment), so the
abort rows show who may abort whose request. A loopback request that came through a proxy
(X-Forwarded-For) must be treated exactly like a remote one.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from nibble.services.config import ServerConfig
from nibble.services.gateway import create_app
from nibble.services.frontend.auth import tenant_id

from .conftest import LOCAL, REMOTE

A_RID = "cmpl-owned-by-a"
KEYS = {"none": None, "A": "sk-tenant-a", "B": "sk-tenant-b", "admin": "sk-admin"}
DEPLOYMENTS = {
    "tenants+admin": ServerConfig(api_keys=("sk-tenant-a", "sk-tenant-b"),
                                  admin_api_keys=("sk-admin",)),
    # No admin key: "sk-admin" is just an unknown key here.
    "tenants only": ServerConfig(api_keys=("sk-tenant-a", "sk-tenant-b")),
    "no keys": ServerConfig(host="0.0.0.0", allow_unauthenticated=True),
}

EXPECTED = {
    "tenants+admin": {
        "health":          "200 200 200 200 | 200 200 200 200",
        "metrics":         "200 200 200 200 | 200 200 200 200",
        "completions":     "401 200 200 200 | 401 200 200 200",
        "models":          "401 200 200 200 | 401 200 200 200",
        "flush_cache":     "401 403 403 200 | 401 403 403 200",
        "get_server_info": "401 403 403 200 | 401 403 403 200",
        "kv_events":       "401 403 403 200 | 401 403 403 200",
        "abort_all":       "401 403 403 200 | 401 403 403 200",
        "abort A's rid":   "401 200 404 200 | 401 200 404 200",
        "abort unknown":   "401 404 404 404 | 401 404 404 404",
    },
    "tenants only": {
        "health":          "200 200 200 200 | 200 200 200 200",
        "metrics":         "200 200 200 200 | 200 200 200 200",
        "completions":     "401 200 200 401 | 401 200 200 401",
        "models":          "401 200 200 401 | 401 200 200 401",
        "flush_cache":     "200 200 200 200 | 403 403 403 403",
        "get_server_info": "200 200 200 200 | 403 403 403 403",
        "kv_events":       "200 200 200 200 | 403 403 403 403",
        "abort_all":       "200 200 200 200 | 401 403 403 401",
        "abort A's rid":   "200 200 200 200 | 401 200 404 401",
        "abort unknown":   "404 404 404 404 | 401 404 404 401",
    },
    "no keys": {       # no identities: every caller is the same anonymous tenant
        "health":          "200 200 200 200 | 200 200 200 200",
        "metrics":         "200 200 200 200 | 200 200 200 200",
        "completions":     "200 200 200 200 | 200 200 200 200",
        "models":          "200 200 200 200 | 200 200 200 200",
        "flush_cache":     "200 200 200 200 | 403 403 403 403",
        "get_server_info": "200 200 200 200 | 403 403 403 403",
        "kv_events":       "200 200 200 200 | 403 403 403 403",
        "abort_all":       "200 200 200 200 | 403 403 403 403",
        "abort A's rid":   "200 200 200 200 | 200 200 200 200",
        "abort unknown":   "404 404 404 404 | 404 404 404 404",
    },
}


def send(client: TestClient, route: str, headers: dict[str, str]):
    if route == "completions":
        return client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2},
                           headers=headers)
    if route == "flush_cache":
        return client.post("/flush_cache", headers=headers)
    if route == "abort_all":
        return client.post("/abort_request", json={"abort_all": True}, headers=headers)
    if route == "abort A's rid":
        return client.post("/abort_request", json={"rid": A_RID}, headers=headers)
    if route == "abort unknown":
        return client.post("/abort_request", json={"rid": "cmpl-nobody"}, headers=headers)
    path = {"health": "/health", "metrics": "/metrics", "models": "/v1/models",
            "get_server_info": "/get_server_info", "kv_events": "/kv_events"}[route]
    return client.get(path, headers=headers)


def statuses(client: TestClient, route: str, extra: dict[str, str]) -> list[int]:
    out = []
    for key in KEYS.values():
        headers = {**extra, **({"Authorization": f"Bearer {key}"} if key else {})}
        out.append(send(client, route, headers).status_code)
    return out


@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_http_auth_matrix(FakeEngine, deployment):
    cfg = DEPLOYMENTS[deployment]
    engine = FakeEngine()
    app = create_app(engine, cfg)
    owner = tenant_id(b"sk-tenant-a") if cfg.api_keys else None
    app.state.inflight.track(A_RID, owner)          # a request of tenant A, mid-stream
    got, mismatches = {}, []
    with TestClient(app, client=LOCAL, raise_server_exceptions=False) as local, \
            TestClient(app, client=REMOTE, raise_server_exceptions=False) as remote:
        for route, row in EXPECTED[deployment].items():
            cells = statuses(local, route, {}) + statuses(remote, route, {})
            got[route] = " ".join(map(str, cells[:4])) + " | " + " ".join(map(str, cells[4:]))
            if got[route] != row:
                mismatches.append(f"{route}: expected {row}, got {got[route]}")
            proxied = statuses(local, route, {"X-Forwarded-For": "203.0.113.9"})
            if proxied != cells[4:]:
                mismatches.append(f"{route}: proxied loopback {proxied} != remote {cells[4:]}")
    assert not mismatches, "\n".join(mismatches)
    row = EXPECTED[deployment]["abort A's rid"]
    allowed = row.split().count("200") + row.split("|")[1].split().count("200")  # + proxied
    assert engine.aborted.count(A_RID) == allowed
    assert "cmpl-nobody" not in engine.aborted
