"""API keys: which routes need which key, how keys are sent, tenant namespaces, redaction."""

from __future__ import annotations

import logging

import pytest

from nibble.services.config import ServerConfig
from nibble.services.errors import ConfigError
from nibble.services.frontend.auth import (AuthPolicy, KeySet, cache_namespace, is_local_client,
                                           is_loopback, presented_keys, tenant_id)
from nibble.services.gateway.auth import check_exposure, log_security_posture

from .conftest import REMOTE

COMPLETION = {"prompt": "ab", "max_tokens": 2}
BOTH = ServerConfig(api_keys=("sk-user", "sk-user2"), admin_api_keys=("sk-admin",))
API_ONLY = ServerConfig(api_keys=("sk-user",))
ADMIN_ONLY = ServerConfig(admin_api_keys=("sk-admin",))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def call(client, route: str, headers: dict | None = None):
    """One request per route kind: a generation, an admin call, an open route."""
    if route == "completions":
        return client.post("/v1/completions", json=COMPLETION, headers=headers)
    if route == "models":
        return client.get("/v1/models", headers=headers)
    if route == "server_info":
        return client.get("/get_server_info", headers=headers)
    if route == "flush":
        return client.post("/flush_cache", headers=headers)
    return client.get(route, headers=headers)


def assert_401(r) -> dict:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    return err


@pytest.mark.parametrize("route", ["completions", "models", "server_info", "flush"])
def test_missing_key_is_401(FakeEngine, make_client, route):
    engine = FakeEngine()
    err = assert_401(call(make_client(engine, BOTH), route))
    assert "Missing API key" in err["message"] and "Bearer" in err["message"]
    assert engine.requests == [] and engine.flushes == 0


@pytest.mark.parametrize("headers", [bearer("sk-nope"), {"x-api-key": "sk-nope"},
                                     bearer("sk-use"), bearer("sk-user-"), {"Authorization":
                                     "Basic sk-user"}, {"Authorization": "sk-user"}])
def test_wrong_key_is_401(FakeEngine, make_client, headers):
    engine = FakeEngine()
    r = call(make_client(engine, BOTH), "completions", headers)
    err = assert_401(r)
    if "x-api-key" in headers or headers["Authorization"].startswith("Bearer"):
        assert "Incorrect API key" in err["message"]
    assert engine.requests == []


@pytest.mark.parametrize("headers", [bearer("sk-user"), bearer("sk-user2"),
                                     {"Authorization": "bearer   sk-user "},
                                     {"x-api-key": "sk-user"}, bearer("sk-admin"),
                                     {"Authorization": "Bearer wrong", "x-api-key": "sk-user"}])
def test_right_key_opens_openai_routes(FakeEngine, make_client, headers):
    client = make_client(FakeEngine(), BOTH)
    r = call(client, "completions", headers)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "He"
    assert call(client, "models", headers).status_code == 200


def assert_403(r) -> dict:
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "permission_error" and err["code"] == "insufficient_permissions"
    return err


def test_admin_routes_need_the_admin_key(FakeEngine, make_client):
    engine = FakeEngine()
    client = make_client(engine, BOTH)
    for route in ("server_info", "flush"):
        err = assert_403(call(client, route, bearer("sk-user")))     # an API key is not enough
        assert "admin API key" in err["message"]
        assert_401(call(client, route))                  # loopback is no excuse with an admin key
        assert call(client, route, bearer("sk-admin")).status_code == 200
        assert call(client, route, {"x-api-key": "sk-admin"}).status_code == 200
    err = assert_403(client.post("/abort_request", json={"abort_all": True},
                                 headers=bearer("sk-user")))
    assert "abort_all" in err["message"]
    r = client.post("/abort_request", json={"abort_all": True}, headers=bearer("sk-admin"))
    assert r.status_code == 200
    assert engine.flushes == 2


def test_without_an_admin_key_admin_routes_are_loopback_only(FakeEngine, make_client):
    engine = FakeEngine()
    local, remote = make_client(engine, API_ONLY), make_client(engine, API_ONLY, REMOTE)
    assert call(local, "server_info").status_code == 200            # no key needed locally
    err = assert_403(call(remote, "server_info", bearer("sk-user")))  # a tenant key: no
    assert "loopback" in err["message"]
    proxied = call(local, "server_info", {"X-Forwarded-For": "203.0.113.9"})
    assert "loopback" in assert_403(proxied)["message"]               # a proxy on loopback: no
    assert engine.flushes == 0


def test_admin_keys_alone_leave_openai_routes_open(FakeEngine, make_client):
    client = make_client(FakeEngine(), ADMIN_ONLY)
    assert call(client, "completions").status_code == 200
    assert_401(call(client, "server_info"))
    assert call(client, "server_info", bearer("sk-admin")).status_code == 200


@pytest.mark.parametrize("cfg", [BOTH, API_ONLY, ServerConfig()], ids=["both", "api", "none"])
def test_health_and_metrics_stay_open(FakeEngine, make_client, cfg):
    client = make_client(FakeEngine(), cfg)
    assert call(client, "/health").status_code == 200
    assert call(client, "/metrics").status_code == 200


def test_no_keys_everything_open(FakeEngine, make_client):
    client = make_client(FakeEngine(), ServerConfig())
    for route in ("completions", "models", "server_info", "flush"):
        assert call(client, route).status_code == 200


def test_unknown_paths_need_a_key_first(FakeEngine, make_client):
    client = make_client(FakeEngine(), API_ONLY)
    assert_401(client.get("/v1/nope"))
    assert_401(client.get("/nope"))
    assert client.get("/v1/nope", headers=bearer("sk-user")).status_code == 404


def test_auth_runs_before_body_validation(FakeEngine, make_client):
    client = make_client(FakeEngine(), API_ONLY)
    r = client.post("/v1/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert_401(r)


def test_tenant_namespaces(FakeEngine, make_client):
    engine = FakeEngine()
    client = make_client(engine, BOTH)
    salts = []
    for key, salt in [("sk-user", None), ("sk-user", "s1"), ("sk-user2", None),
                      ("sk-user2", "s1"), ("sk-user", None)]:
        body = {**COMPLETION, **({"cache_salt": salt} if salt else {})}
        assert client.post("/v1/completions", json=body, headers=bearer(key)).status_code == 200
        salts.append(engine.requests[-1].cache_salt)
    t1, t2 = tenant_id(b"sk-user"), tenant_id(b"sk-user2")
    assert salts == [f"{t1}:", f"{t1}:s1", f"{t2}:", f"{t2}:s1", f"{t1}:"]
    assert len(t1) == 16 and t1 != t2 and "sk-user" not in t1


def test_without_keys_the_salt_passes_through(engine, client):
    client.post("/v1/completions", json={**COMPLETION, "cache_salt": "abc"})
    client.post("/v1/completions", json=COMPLETION)
    assert [r.cache_salt for r in engine.requests] == ["abc", None]


def test_namespaces_of_two_keys_never_collide():
    # A salt may contain ':'; the tenant prefix has a fixed length, so it cannot be forged.
    a, b = tenant_id(b"k1"), tenant_id(b"k2")
    assert cache_namespace(a, f"{b}:x") != cache_namespace(b, "x")
    assert cache_namespace(a, None) == cache_namespace(a, "")
    assert cache_namespace(None, "s") == "s" and cache_namespace(None, None) is None


def test_server_info_redacts_keys(FakeEngine, make_client):
    r = call(make_client(FakeEngine(), BOTH), "server_info", bearer("sk-admin"))
    assert r.status_code == 200
    assert "sk-user" not in r.text and "sk-admin" not in r.text
    server = r.json()["config"]["server"]
    assert server["api_keys"] == "<1 redacted>" and server["port"] == 1


def test_keyset_and_header_parsing():
    ks = KeySet(["a1", "b2"])
    assert ks.match(b"a1") and ks.match(b"b2")
    assert not ks.match(b"a") and not ks.match(b"a1 ") and not ks.match(b"")
    assert not KeySet([]) and len(ks) == 2
    assert presented_keys([(b"authorization", b"Bearer  k "), (b"x-api-key", b"k2")]) == \
        [b"k", b"k2"]
    assert presented_keys([(b"authorization", b"Bearer "), (b"x-api-key", b" ")]) == []


@pytest.mark.parametrize("keys", [("",), ("has space",), ("tab\tkey",), ("ключ",)])
def test_unusable_keys_are_config_errors(FakeEngine, keys):
    with pytest.raises(ConfigError):
        AuthPolicy(ServerConfig(api_keys=keys))
    with pytest.raises(ConfigError):
        AuthPolicy(ServerConfig(admin_api_keys=keys))


def test_keys_do_not_show_in_repr():
    assert "sk-user" not in repr(BOTH) and "sk-admin" not in repr(BOTH)


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True),
                                            ("::1", True), ("[::1]", True), ("127.8.9.1", True),
                                            ("::ffff:127.0.0.1", True), ("0.0.0.0", False),
                                            ("", False), ("10.1.2.3", False), ("myhost", False),
                                            ("::ffff:10.0.0.1", False), ("testclient", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("header", [b"x-forwarded-for", b"X-Real-IP", b"forwarded"])
def test_a_proxied_request_is_not_local(header):
    assert is_local_client("127.0.0.1", [(b"host", b"x")])
    assert not is_local_client("127.0.0.1", [(header, b"203.0.113.9")])
    assert not is_local_client(None, []) and not is_local_client("10.0.0.2", [])


def _posture(cfg: ServerConfig, caplog) -> list[logging.LogRecord]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="posture-test"):
        log_security_posture(cfg, logging.getLogger("posture-test"))
    return caplog.records


def test_security_posture_logging(caplog):
    recs = _posture(ServerConfig(), caplog)
    assert [r.levelno for r in recs] == [logging.INFO, logging.INFO]
    assert "unauthenticated" in recs[0].message and "loopback" in recs[0].message
    assert "loopback clients only" in recs[1].message
    recs = _posture(ServerConfig(host="0.0.0.0", allow_unauthenticated=True), caplog)
    assert recs[0].levelno == logging.WARNING and "SECURITY WARNING" in recs[0].message
    recs = _posture(ServerConfig(host="0.0.0.0", api_keys=("k",), admin_api_keys=("a",)),
                    caplog)
    assert all(r.levelno == logging.INFO for r in recs)
    assert not any("unauthenticated" in r.message for r in recs)
    assert "need a key from --admin-api-key" in recs[1].message
    assert all("k" not in r.args for r in recs if r.args)


@pytest.mark.parametrize("cfg", [ServerConfig(host="0.0.0.0"), ServerConfig(host=""),
                                 ServerConfig(host="10.1.2.3", grpc_port=50051),
                                 ServerConfig(host="::", admin_api_keys=("adm",))],
                         ids=["any-v4", "all", "lan-grpc", "admin-key-only"])
def test_exposed_host_without_api_key_is_refused(cfg, caplog):
    with pytest.raises(ConfigError, match="refusing to serve") as e:
        _posture(cfg, caplog)
    assert "--allow-unauthenticated" in str(e.value) and "--api-key-file" in str(e.value)
    if cfg.grpc_port:
        assert "gRPC port 50051" in str(e.value)


@pytest.mark.parametrize("cfg", [ServerConfig(host="127.0.0.1"), ServerConfig(host="::1"),
                                 ServerConfig(host="localhost"),
                                 ServerConfig(host="0.0.0.0", api_keys=("k",)),
                                 ServerConfig(host="0.0.0.0", allow_unauthenticated=True)])
def test_loopback_keys_or_explicit_opt_out_start(cfg):
    check_exposure(cfg)
