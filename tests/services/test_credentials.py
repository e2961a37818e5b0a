"""URL credentials are redacted wherever config is shown; the Redis password stays out of argv."""

from __future__ import annotations

import argparse

import pytest

from nibble.services.config import add_engine_args, config_from_args
from nibble.services.credentials import (STORAGE_PASSWORD_ENV, load_storage_password,
                                         redact_url, redact_urls)
from nibble.services.engine.async_engine import redacted_config
from nibble.services.errors import ConfigError

SECRET = "hunter2"


@pytest.mark.parametrize("url,want", [
    ("redis://:hunter2@10.0.0.5:6379/0", "redis://<redacted>@10.0.0.5:6379/0"),
    ("redis://default:hunter2@redis:6379/0", "redis://<redacted>@redis:6379/0"),
    ("rediss://user:hun/ter2@h:6380/1?ssl_cert_reqs=none",
     "rediss://<redacted>@h:6380/1?ssl_cert_reqs=none"),
    ("redis://h:6379/0?password=hunter2&db=2", "redis://h:6379/0?password=<redacted>&db=2"),
    ("unix:///run/redis.sock?db=0&password=hunter2",
     "unix:///run/redis.sock?db=0&password=<redacted>"),
    ("https://hunter2@host/x#access_token=hunter2&a=1",
     "https://<redacted>@host/x#access_token=<redacted>&a=1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_redact_url(url, want):
    assert redact_url(url) == want
    assert SECRET not in redact_url(url)


def test_redact_urls_walks_nested_values_and_text():
    obj = {"a": ["see redis://u:hunter2@h/0 now", 3, None], "b": {"c": ("x://:hunter2@y",)}}
    assert SECRET not in repr(redact_urls(obj))
    assert redact_urls(obj)["a"][1:] == [3, None]


def parse(argv, env=None):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return config_from_args(p.parse_args(argv), env=env or {})


def test_redacted_config_hides_every_url_credential():
    cfg = parse(["--enable-hierarchical-cache", "--hicache-storage-backend", "redis",
                 "--hicache-storage-url", "redis://admin:hunter2@redis:6379/0?password=hunter2"])
    shown = redacted_config(cfg)
    assert SECRET not in repr(shown)
    assert shown["hicache"]["hicache_storage_url"] == \
        "redis://<redacted>@redis:6379/0?password=<redacted>"


def test_the_storage_password_comes_from_a_file_or_the_environment(tmp_path):
    path = tmp_path / "pw"
    path.write_text("hunter2\n")
    path.chmod(0o600)
    cfg = parse(["--enable-hierarchical-cache", "--hicache-storage-backend", "redis",
                 "--hicache-storage-password-file", str(path)])
    assert cfg.hicache.hicache_storage_password_file == str(path)
    assert SECRET not in repr(redacted_config(cfg))             # the path only, never the value
    assert load_storage_password(str(path), {}) == SECRET
    assert load_storage_password(None, {STORAGE_PASSWORD_ENV: SECRET}) == SECRET
    assert load_storage_password(None, {}) is None
    path.write_text("\n")
    with pytest.raises(ConfigError, match="holds no password"):
        load_storage_password(str(path), {})
    with pytest.raises(ConfigError, match="password-file is for"):
        parse(["--hicache-storage-backend", "file", "--hicache-storage-password-file", "x"])


@pytest.mark.parametrize("mode,warned", [(0o600, False), (0o400, False), (0o440, False),
                                         (0o640, False), (0o644, True), (0o660, True),
                                         (0o604, True)])
def test_secret_file_modes_that_warn(tmp_path, caplog, mode, warned):
    """Group read is what a Kubernetes Secret with fsGroup gets; others' read or anyone
    else's write is warned about."""
    from nibble.services.credentials import read_secret_file

    path = tmp_path / "key"
    path.write_text("k" * 20)
    path.chmod(mode)
    with caplog.at_level("WARNING", logger="nibble.services.credentials"):
        assert read_secret_file(str(path), "--api-key-file") == "k" * 20
    assert ("open to other users" in caplog.text) == warned
