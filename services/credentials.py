"""Secrets from files and the environment, never from argv.

Command lines are world-readable (``/proc/<pid>/cmdline``, ``ps``), so every
secret Nibble takes has a file flag and an environment variable:

* API keys: ``--api-key-file`` / ``$NIBBLE_API_KEY``; admin keys:
  ``--admin-api-key-file`` / ``$NIBBLE_ADMIN_API_KEY`` (a file holds one key per
  line, ``#`` comments and blank lines skipped; the variable holds one key or
  several separated by commas). ``--api-key KEY`` still works, with a warning.
* The KV secret: ``--kv-secret-file`` / ``$NIBBLE_KV_SECRET`` (see
  ``nibble.tiering.secret``).
* The L3 storage (Redis) password: ``--hicache-storage-password-file`` /
  ``$NIBBLE_HICACHE_STORAGE_PASSWORD``, kept out of ``--hicache-storage-url``.

Whatever config is shown (``/get_server_info``, gRPC GetServerInfo) goes
through ``redact_urls``: the user-info part and credential-like query
parameters of every URL in it are replaced by ``<redacted>``.

A secret file that others can read, or that group or others can write, is
accepted with a warning (a Kubernetes Secret volume is 0644 by default unless
``defaultMode`` says otherwise; the chart sets 0400, to which the kubelet adds
group read for the pod's ``fsGroup``, so group read alone is not warned about).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping

from nibble.tiering.secret import KVSecret

from .errors import ConfigError

log = logging.getLogger(__name__)

MAX_SECRET_FILE_BYTES = 1 << 16
API_KEY_ENV = "NIBBLE_API_KEY"
ADMIN_API_KEY_ENV = "NIBBLE_ADMIN_API_KEY"
KV_SECRET_ENV = "NIBBLE_KV_SECRET"
STORAGE_PASSWORD_ENV = "NIBBLE_HICACHE_STORAGE_PASSWORD"
REDACTED = "<redacted>"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*")
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|key|auth|credential|sig", re.IGNORECASE)


def read_secret_file(path: str, flag: str) -> str:
    """The text of a secret file (at most 64 KiB). Raises ConfigError naming ``flag``."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{flag} {path}: not a regular file")
        if st.st_size > MAX_SECRET_FILE_BYTES:
            raise ConfigError(f"{flag} {path}: larger than {MAX_SECRET_FILE_BYTES} bytes")
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path}: not UTF-8 text") from None
    if st.st_mode & 0o027:
        log.warning("%s %s is open to other users (mode %o); chmod 600 it",
                    flag, path, stat.S_IMODE(st.st_mode))
    return text


def read_key_file(path: str, flag: str) -> tuple[str, ...]:
    """Keys of a key file: one per line, blank lines and ``#`` comments skipped."""
    lines = (line.strip() for line in read_secret_file(path, flag).splitlines())
    keys = tuple(line for line in lines if line and not line.startswith("#"))
    if not keys:
        raise ConfigError(f"{flag} {path}: holds no key")
    return keys


def env_keys(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """Keys from an environment variable: comma-separated, blanks dropped."""
    return tuple(k.strip() for k in env.get(name, "").split(",") if k.strip())


def collect_keys(argv_keys: tuple[str, ...] | list[str] | None, files: list[str] | None,
                 env: Mapping[str, str], env_name: str, flag: str) -> tuple[str, ...]:
    """Every key given by flag, file or environment, in that order, without duplicates."""
    keys = list(argv_keys or ())
    if argv_keys:
        log.warning("%s on the command line is visible to every local user (ps, /proc); "
                    "prefer %s-file or $%s", flag, flag, env_name)
    for path in files or ():
        keys += read_key_file(path, f"{flag}-file")
    keys += env_keys(env, env_name)
    return tuple(dict.fromkeys(keys))


def load_kv_secret(path: str | None, env: Mapping[str, str] | None = None) -> KVSecret | None:
    """The deployment's KV secret from ``--kv-secret-file`` or ``$NIBBLE_KV_SECRET``; None if
    neither is set. Raises ConfigError for an unreadable or too short secret."""
    env = os.environ if env is None else env
    if path:
        raw, where = read_secret_file(path, "--kv-secret-file").strip(), f"--kv-secret-file {path}"
    elif env.get(KV_SECRET_ENV):
        raw, where = env[KV_SECRET_ENV].strip(), f"${KV_SECRET_ENV}"
    else:
        return None
    try:
        return KVSecret(raw)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_storage_password(path: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The L3 storage password from ``--hicache-storage-password-file`` (first line) or
    ``$NIBBLE_HICACHE_STORAGE_PASSWORD``; None if neither is set."""
    env = os.environ if env is None else env
    flag = "--hicache-storage-password-file"
    if path:
        lines = read_secret_file(path, flag).splitlines()
        if not lines or not lines[0].strip():
            raise ConfigError(f"{flag} {path}: holds no password")
        return lines[0].strip()
    return env.get(STORAGE_PASSWORD_ENV) or None


def _redact_params(part: str) -> str:
    """``a=1&password=x`` -> ``a=1&password=<redacted>`` (credential-like names only)."""
    out = []
    for item in part.split("&"):
        name, eq, _ = item.partition("=")
        out.append(f"{name}={REDACTED}" if eq and _SECRET_PARAM.search(name) else item)
    return "&".join(out)


def redact_url(url: str) -> str:
    """``url`` without credentials: the user-info (``user:password@``) becomes
    ``<redacted>@``; credential-like query or fragment parameters get ``<redacted>`` values.
    Over-redacts rather than leaks (an ``@`` before any ``?``/``#`` ends the user-info)."""
    scheme, _, rest = url.partition("://")
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, cut)
    user = f"{REDACTED}@" if at >= 0 else ""
    head, tail = user + rest[at + 1:cut], rest[cut:]
    if tail.startswith("?"):
        query, hash_, frag = tail[1:].partition("#")
        tail = f"?{_redact_params(query)}" + (f"#{_redact_params(frag)}" if hash_ else "")
    elif tail:
        tail = f"#{_redact_params(tail[1:])}"
    return f"{scheme}://{head}{tail}"


def redact_urls(obj):
    """A copy of ``obj`` (nested dicts/lists/tuples of JSON-like values) with every URL in
    every string passed through ``redact_url``."""
    if isinstance(obj, str):
        return _URL.sub(lambda m: redact_url(m.group(0)), obj) if "://" in obj else obj
    if isinstance(obj, dict):
        return {k: redact_urls(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_urls(v) for v in obj]
    return obj
