#!/usr/bin/env python3
"""Entry point of the chart's gateway container: ``nibble serve`` built from mounted files.

Files (one argument or key per line; blank lines and lines starting with ``#`` are skipped):

- ``$NIBBLE_CONFIG_DIR/serve.args`` (ConfigMap): the ``nibble serve`` arguments.
- ``$NIBBLE_CONFIG_DIR/ray-start.args`` (ConfigMap, disaggregated mode only): arguments of
  ``ray start``, run first so that this pod joins the Ray cluster as a zero-CPU node. The
  driver then connects to the GCS directly: Ray Client (``ray://``) cannot carry the
  streaming generators that the disaggregated engine streams tokens through.
- ``$NIBBLE_SECRETS_DIR`` (Secret): ``api-keys`` and ``admin-api-keys`` (one key per line)
  become ``--api-key-file`` and ``--admin-api-key-file``, ``redis-password`` becomes
  ``--hicache-storage-password-file``, all naming the mounted file, so no secret is ever in
  argv (``/proc/<pid>/cmdline``) or in the pod spec; ``hicache-storage-url`` (an external
  Redis, its password already taken out by the chart) becomes ``--hicache-storage-url``.

``--print`` writes the commands as JSON instead of running them (used by the chart's tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CONFIG_DIR = os.environ.get("NIBBLE_CONFIG_DIR", "/etc/nibble/config")
SECRETS_DIR = os.environ.get("NIBBLE_SECRETS_DIR", "/etc/nibble/secrets")
RAY_START_TRIES = int(os.environ.get("NIBBLE_RAY_START_TRIES", "30"))
RAY_START_WAIT_S = 10.0


def read_lines(path: str) -> list[str]:
    """Non-empty, non-comment lines of ``path`` (stripped); [] when the file is absent."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except FileNotFoundError:
        return []
    return [line for line in lines if line and not line.startswith("#")]


def serve_argv(config_dir: str = CONFIG_DIR, secrets_dir: str = SECRETS_DIR) -> list[str]:
    argv = ["nibble", "serve", *read_lines(os.path.join(config_dir, "serve.args"))]
    for flag, name in (("--api-key-file", "api-keys"), ("--admin-api-key-file", "admin-api-keys"),
                       ("--hicache-storage-password-file", "redis-password")):
        path = os.path.join(secrets_dir, name)
        if read_lines(path):
            argv += [flag, path]
    url = read_lines(os.path.join(secrets_dir, "hicache-storage-url"))
    if url:
        argv += ["--hicache-storage-url", url[0]]
    return argv


def ray_start_argv(config_dir: str = CONFIG_DIR) -> list[str]:
    args = read_lines(os.path.join(config_dir, "ray-start.args"))
    return ["ray", "start", *args] if args else []


def join_ray(argv: list[str]) -> None:
    """Run ``ray start``; the head may still be starting, so retry for a while."""
    for attempt in range(1, RAY_START_TRIES + 1):
        if subprocess.run(argv, check=False).returncode == 0:
            return
        print(f"launch: ray start failed (try {attempt}/{RAY_START_TRIES}); retrying in "
              f"{RAY_START_WAIT_S:.0f}s", file=sys.stderr, flush=True)
        time.sleep(RAY_START_WAIT_S)
    sys.exit("launch: could not join the Ray cluster; is the RayCluster head running?")


def main(args: list[str]) -> None:
    ray_cmd, serve_cmd = ray_start_argv(), serve_argv()
    if args == ["--print"]:
        print(json.dumps({"ray_start": ray_cmd, "serve": serve_cmd}))
        return
    if args:
        sys.exit(f"launch: unknown arguments {args}; the only option is --print")
    if ray_cmd:
        join_ray(ray_cmd)
    os.execvp(serve_cmd[0], serve_cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
