"""Finding 4c of issue 14: the KV secret reaches the actors through a private file, not Ray.

The old gateway put ``$NIBBLE_KV_SECRET`` into the Ray ``runtime_env``, which Ray
writes to world-readable session logs. (The end-to-end check of the logs is in
``tests/e2e/test_disaggregated.py``.)
"""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest

from nibble.services.config import CacheConfig, DisaggConfig, NibbleConfig, ServerConfig
from nibble.services.credentials import KV_SECRET_ENV, load_kv_secret
from nibble.services.disagg.client import _init_ray, actor_config
from nibble.services.disagg.secret_handoff import prepare_kv_secret
from nibble.services.errors import ConfigError

SECRET = "deployment-secret-0123456789abcdef"


def _cfg(ray_address=None, secret_file=None) -> NibbleConfig:
    return NibbleConfig(cache=CacheConfig(kv_secret_file=secret_file),
                        disagg=DisaggConfig(disaggregate=True, ray_address=ray_address))


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_local_cluster_gets_a_private_file_with_a_fresh_secret():
    env: dict[str, str] = {}
    cfg, d = prepare_kv_secret(_cfg(), env)
    try:
        path = cfg.cache.kv_secret_file
        assert path == d.secret_file and _mode(path) == 0o600 and _mode(d.path) == 0o700
        secret = load_kv_secret(path, {})
        assert secret is not None and len(secret.raw()) >= 32
        other, d2 = prepare_kv_secret(_cfg(), {})
        assert load_kv_secret(other.cache.kv_secret_file, {}) != secret   # random per run
        d2.remove()
    finally:
        d.remove()
    assert not os.path.exists(d.path)


def test_a_secret_from_the_environment_moves_into_the_file_and_out_of_the_environment():
    env = {KV_SECRET_ENV: SECRET, "OTHER": "x"}
    cfg, d = prepare_kv_secret(_cfg(), env)
    try:
        assert open(cfg.cache.kv_secret_file).read() == SECRET
        assert env == {"OTHER": "x"}          # Ray's processes will not inherit it
    finally:
        d.remove()


def test_a_given_secret_file_is_used_as_is(tmp_path):
    f = tmp_path / "s"
    f.write_text(SECRET)
    f.chmod(0o600)
    for address in (None, "10.0.0.1:6379"):
        cfg = _cfg(address, str(f))
        assert prepare_kv_secret(cfg, {}) == (cfg, None)


def test_a_joined_cluster_needs_the_secret_on_every_node():
    with pytest.raises(ConfigError, match="every node"):
        prepare_kv_secret(_cfg("10.0.0.1:6379"), {})
    cfg = _cfg("10.0.0.1:6379")
    assert prepare_kv_secret(cfg, {KV_SECRET_ENV: SECRET}) == (cfg, None)


def test_ray_is_started_without_a_runtime_env(monkeypatch):
    calls = []

    class FakeRay:
        _private = type("P", (), {"utils": type("U", (), {
            "get_dashboard_dependency_error": staticmethod(lambda: None)})})

        @staticmethod
        def is_initialized():
            return False

        @staticmethod
        def init(**kw):
            calls.append(kw)
    monkeypatch.setitem(__import__("sys").modules, "ray", FakeRay)
    _init_ray(_cfg())
    _init_ray(_cfg("10.0.0.1:6379"))
    assert len(calls) == 2 and all("runtime_env" not in kw for kw in calls)


def test_actors_do_not_get_the_api_keys():
    cfg = dataclasses.replace(_cfg(), server=ServerConfig(api_keys=("k1",),
                                                          admin_api_keys=("k2",)))
    got = actor_config(cfg)
    assert (got.server.api_keys, got.server.admin_api_keys) == ((), ())
    assert got.cache == cfg.cache and got.disagg == cfg.disagg
