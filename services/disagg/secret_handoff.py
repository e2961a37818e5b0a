"""How the deployment's KV secret reaches the Ray actors without passing through Ray.

Whatever goes into a Ray ``runtime_env`` (``env_vars`` included) is written to
Ray's session logs, which any local user can read, so the secret never goes
there. Every actor loads it itself with ``load_kv_secret(cfg.cache.kv_secret_file)``:

* **local cluster** (no ``--ray-address``; every actor runs on this host): unless
  ``--kv-secret-file`` names one already, the gateway writes the secret (from
  ``$NIBBLE_KV_SECRET``, or a fresh random one) to a file of mode 0600 in a new
  directory of mode 0700, points ``cfg.cache.kv_secret_file`` at it, and
  removes the directory at shutdown. ``$NIBBLE_KV_SECRET`` is taken out of this
  process's environment, so the Ray processes it starts do not inherit it;
* **joined cluster** (``--ray-address``): the actors run on other nodes, where
  a file written here does not exist. The deployment must provide the secret
  on every node: ``--kv-secret-file`` with a path every node can read (the
  Helm chart mounts a Secret there), or ``$NIBBLE_KV_SECRET`` in every node's
  environment. Without either, start-up fails with a ConfigError.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass

from nibble.tiering.secret import KVSecret

from ..config import NibbleConfig
from ..credentials import KV_SECRET_ENV, load_kv_secret
from ..errors import ConfigError

log = logging.getLogger(__name__)
SECRET_FILE_NAME = "kv-secret"


@dataclass
class SecretDir:
    """The private directory holding a local cluster's secret file (removed at shutdown)."""

    path: str

    @property
    def secret_file(self) -> str:
        return os.path.join(self.path, SECRET_FILE_NAME)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def write_secret_file(secret: KVSecret) -> SecretDir:
    """The secret in ``<new 0700 dir>/kv-secret``, mode 0600, created exclusively."""
    d = SecretDir(tempfile.mkdtemp(prefix="nibble-kv-secret-"))   # mkdtemp: mode 0700
    try:
        fd = os.open(d.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secret.raw().decode("utf-8"))
    except BaseException:
        d.remove()
        raise
    return d


def prepare_kv_secret(cfg: NibbleConfig, env: MutableMapping[str, str] | None = None
                      ) -> tuple[NibbleConfig, SecretDir | None]:
    """The config the actors get (its ``kv_secret_file`` set where needed) and the private
    directory to remove at shutdown, if one was made. Raises ConfigError (see the module
    docstring)."""
    env = os.environ if env is None else env
    secret = load_kv_secret(cfg.cache.kv_secret_file, env)
    if cfg.disagg.ray_address:
        if secret is None:
            raise ConfigError(
                "--ray-address: the workers on the cluster's nodes need the deployment's KV "
                "secret: give --kv-secret-file with a path readable on every node (the Helm "
                f"chart mounts one from a Secret) or set ${KV_SECRET_ENV} in every node's "
                "environment")
        return cfg, None
    if cfg.cache.kv_secret_file:
        return cfg, None
    if secret is None:
        secret = KVSecret.generate()
        log.warning("no --kv-secret-file or $%s: using a random KV secret for this run (L3 "
                    "records written now will not verify after a restart or on another "
                    "deployment)", KV_SECRET_ENV)
    d = write_secret_file(secret)
    env.pop(KV_SECRET_ENV, None)     # the Ray processes started next read the file instead
    cache = dataclasses.replace(cfg.cache, kv_secret_file=d.secret_file)
    return dataclasses.replace(cfg, cache=cache), d
