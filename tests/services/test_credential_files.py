"""Secrets from files and the environment (services/credentials.py), and how the server
config collects API keys from flags, files and variables."""

from __future__ import annotations

import logging
import os

import pytest

from nibble.services.cli import build_parser
from nibble.services.config import config_from_args
from nibble.services.credentials import (ADMIN_API_KEY_ENV, API_KEY_ENV, KV_SECRET_ENV,
                                         MAX_SECRET_FILE_BYTES, collect_keys, env_keys,
                                         load_kv_secret, read_key_file, read_secret_file)
from nibble.services.errors import ConfigError

SECRET = "0123456789abcdef0123456789abcdef"


def private_file(tmp_path, name: str, text: str, mode: int = 0o600):
    path = tmp_path / name
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_key_file_skips_comments_and_blanks(tmp_path):
    path = private_file(tmp_path, "keys", "# tenants\n\n  sk-a  \nsk-b\n# sk-c\n")
    assert read_key_file(path, "--api-key-file") == ("sk-a", "sk-b")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_key_file_without_keys_is_an_error(tmp_path, text):
    with pytest.raises(ConfigError, match="--api-key-file .* holds no key"):
        read_key_file(private_file(tmp_path, "keys", text), "--api-key-file")


def test_unreadable_secret_files_name_their_flag(tmp_path):
    with pytest.raises(ConfigError, match="--kv-secret-file .*: cannot read it"):
        read_secret_file(str(tmp_path / "missing"), "--kv-secret-file")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_secret_file(str(tmp_path), "--api-key-file")
    big = private_file(tmp_path, "big", "k" * (MAX_SECRET_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match="larger than"):
        read_secret_file(big, "--api-key-file")
    binary = tmp_path / "bin"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_secret_file(str(binary), "--api-key-file")


def test_world_readable_secret_file_warns_without_the_secret(tmp_path, caplog):
    path = private_file(tmp_path, "keys", "sk-visible\n", mode=0o644)
    with caplog.at_level(logging.WARNING, logger="nibble.services.credentials"):
        assert read_key_file(path, "--api-key-file") == ("sk-visible",)
    assert "open to other users" in caplog.text and "644" in caplog.text
    assert "sk-visible" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nibble.services.credentials"):
        read_key_file(private_file(tmp_path, "ok", "sk-private\n"), "--api-key-file")
    assert caplog.text == ""


def test_env_keys_split_on_commas():
    assert env_keys({API_KEY_ENV: " sk-a, ,sk-b,"}, API_KEY_ENV) == ("sk-a", "sk-b")
    assert env_keys({}, API_KEY_ENV) == ()


def test_collect_keys_merges_flag_file_env_without_duplicates(tmp_path, caplog):
    path = private_file(tmp_path, "keys", "sk-file\nsk-flag\n")
    with caplog.at_level(logging.WARNING, logger="nibble.services.credentials"):
        keys = collect_keys(("sk-flag",), [path], {API_KEY_ENV: "sk-env,sk-file"},
                            API_KEY_ENV, "--api-key")
    assert keys == ("sk-flag", "sk-file", "sk-env")
    assert "visible to every local user" in caplog.text and "sk-flag" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nibble.services.credentials"):
        assert collect_keys(None, None, {}, API_KEY_ENV, "--api-key") == ()
    assert caplog.text == ""                  # no flag, no warning


def test_server_config_takes_keys_from_files_and_env(tmp_path):
    api = private_file(tmp_path, "api", "sk-file-user\n")
    admin = private_file(tmp_path, "admin", "sk-file-admin\n")
    args = build_parser().parse_args(["serve", "--api-key-file", api,
                                      "--admin-api-key-file", admin])
    env = {API_KEY_ENV: "sk-env-user", ADMIN_API_KEY_ENV: "sk-env-admin"}
    server = config_from_args(args, env).server
    assert server.api_keys == ("sk-file-user", "sk-env-user")
    assert server.admin_api_keys == ("sk-file-admin", "sk-env-admin")
    assert "sk-" not in repr(server)
    assert config_from_args(build_parser().parse_args(["serve"]), {}).server.api_keys == ()


def test_kv_secret_from_file_env_or_none(tmp_path):
    path = private_file(tmp_path, "kv", SECRET + "\n")
    from_file = load_kv_secret(path, {KV_SECRET_ENV: "ignored-because-the-file-wins"})
    assert from_file is not None and from_file.raw() == SECRET.encode()
    from_env = load_kv_secret(None, {KV_SECRET_ENV: f" {SECRET} "})
    assert from_env == from_file and SECRET not in repr(from_env)
    assert load_kv_secret(None, {}) is None
    with pytest.raises(ConfigError, match=r"\$NIBBLE_KV_SECRET: the KV secret must be"):
        load_kv_secret(None, {KV_SECRET_ENV: "short"})
    with pytest.raises(ConfigError, match="--kv-secret-file"):
        load_kv_secret(private_file(tmp_path, "short", "short"), {})
