"""The gateway container's launcher (helm/nibble/files/launch.py) against the real CLIs.

The rendered ConfigMap and Secret are laid out as the pod mounts them; the launcher's
``--print`` output must then parse with ``nibble serve``'s own argument parser and config
validation, and its ``ray start`` arguments with Ray's ``ray start`` command.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import sys

import pytest

from nibble.services.cli import build_parser
from nibble.services.config import config_from_args

from .conftest import FULL_VALUES
from .helpers import CHART, NAMESPACE, one

LAUNCH = CHART / "files" / "launch.py"


def mount(docs: list[dict], tmp_path):
    """Write the ConfigMap and (if rendered) the Secret as the pod sees them."""
    config, secrets = tmp_path / "config", tmp_path / "secrets"
    config.mkdir()
    secrets.mkdir()
    for key, text in one(docs, "ConfigMap", "-config")["data"].items():
        (config / key).write_text(text)
    for secret in [d for d in docs if d["kind"] == "Secret"]:
        for key, b64 in secret["data"].items():
            (secrets / key).write_bytes(base64.b64decode(b64))
    return config, secrets


def arg_after(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def launch_print(config, secrets) -> dict:
    env = {"NIBBLE_CONFIG_DIR": str(config), "NIBBLE_SECRETS_DIR": str(secrets), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, str(config / "launch.py"), "--print"], env=env,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return json.loads(out)


def nibble_config(argv: list[str]):
    assert argv[:2] == ["nibble", "serve"]
    return config_from_args(build_parser().parse_args(argv[1:]))


def test_configmap_ships_the_launcher_verbatim(rendered):
    shipped = one(rendered("cpu"), "ConfigMap", "-config")["data"]["launch.py"]
    assert shipped == LAUNCH.read_text()


def test_default_values_give_a_valid_disaggregated_serve_command(rendered, tmp_path):
    docs = rendered("cpu")
    cmds = launch_print(*mount(docs, tmp_path))
    cfg = nibble_config(cmds["serve"])
    head = f"{one(docs, 'RayCluster')['metadata']['name']}-head-svc.{NAMESPACE}.svc.cluster.local:6379"
    assert (cfg.server.host, cfg.server.port, cfg.server.grpc_port) == ("0.0.0.0", 30000, 30001)
    assert cfg.disagg.disaggregate and cfg.disagg.ray_address == head
    assert (cfg.disagg.prefill_workers, cfg.disagg.decode_workers) == (1, 1)
    assert cfg.hicache.enable_hierarchical_cache and cfg.hicache.hicache_storage_backend == "redis"
    assert cfg.hicache.hicache_storage_url.startswith("redis://rel-nibble-redis.")
    assert cfg.device.device == "cpu" and cfg.cache.kv_cache_dtype == "nvfp4"
    generated = (tmp_path / "secrets" / "api-keys").read_text()
    assert cfg.server.api_keys == (generated,) and len(generated) >= 40   # generated: no open API
    assert cfg.cache.kv_secret_file == "/etc/nibble/secrets/kv-secret"
    assert arg_after(cmds["serve"], "--hicache-storage-password-file") == \
        str(tmp_path / "secrets" / "redis-password")
    assert cfg.server.graceful_shutdown_timeout == 25      # terminationGracePeriodSeconds - 5
    assert cmds["ray_start"][:2] == ["ray", "start"]


def test_keys_and_external_redis_come_from_the_secret(rendered, tmp_path):
    cmds = launch_print(*mount(rendered("full"), tmp_path))
    cfg = nibble_config(cmds["serve"])
    assert list(cfg.server.api_keys) == FULL_VALUES["auth"]["apiKeys"]
    assert list(cfg.server.admin_api_keys) == FULL_VALUES["auth"]["adminApiKeys"]
    # the password leaves the URL for a file of its own
    assert cfg.hicache.hicache_storage_url == "redis://redis.example.internal:6379/3"
    assert (tmp_path / "secrets" / "redis-password").read_text() == "hunter2-redis-pw"
    assert arg_after(cmds["serve"], "--hicache-storage-password-file") == \
        str(tmp_path / "secrets" / "redis-password")
    secrets = [*FULL_VALUES["auth"]["apiKeys"], *FULL_VALUES["auth"]["adminApiKeys"],
               FULL_VALUES["auth"]["kvSecret"], "hunter2-redis-pw"]
    assert not [a for a in cmds["serve"] if any(x in a for x in secrets)], "a secret in argv"
    assert cfg.cache.max_total_tokens == 1000000           # no 1e+06 from the template
    assert cfg.cache.mem_fraction_static == 0.5
    assert cfg.model.model_path == "/models/SmolLM2"
    assert cfg.scheduler.schedule_policy == "lpm"
    assert cfg.hicache.hicache_storage_ttl == 86400
    assert cfg.device.device == "auto"                     # null removed the default flag
    assert not cfg.cache.disable_radix_cache               # false leaves a bare flag out
    assert (cfg.disagg.prefill_workers, cfg.disagg.decode_workers) == (3, 2)


@pytest.mark.parametrize("variant", ["gpu-values", "colocated", "gpu-values-colocated",
                                     "existing-secret", "no-hicache"])
def test_every_variant_gives_a_valid_serve_command(rendered, tmp_path, variant):
    docs = rendered(variant)
    config, secrets = mount(docs, tmp_path)
    if variant == "existing-secret":             # the user's own Secret, as the pod mounts it
        (secrets / "kv-secret").write_text("user-kv-secret-0123456789")
        (secrets / "api-keys").write_text("user-api-key-0001\n")
    cmds = launch_print(config, secrets)
    cfg = nibble_config(cmds["serve"])
    assert cfg.server.api_keys                   # no variant serves the pod network openly
    disagg = any(d["kind"] == "RayCluster" for d in docs)
    assert cfg.disagg.disaggregate == disagg
    assert bool(cmds["ray_start"]) == disagg
    assert cfg.server.grpc_port == (None if variant == "existing-secret" else 30001)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pydantic, via ray.serve
def test_gateway_ray_start_arguments_parse_and_add_no_capacity(rendered, tmp_path):
    from ray.scripts.scripts import start

    cmds = launch_print(*mount(rendered("cpu"), tmp_path))
    ctx = start.make_context("start", cmds["ray_start"][2:])
    p = ctx.params
    assert (p["num_cpus"], p["num_gpus"], p["head"]) == (0, 0, False)
    assert p["address"].endswith(".svc.cluster.local:6379")
    assert p["metrics_export_port"] == 8080


def _load_launcher():
    spec = importlib.util.spec_from_file_location("nibble_chart_launch", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_launcher_reads_lines_and_refuses_unknown_arguments(tmp_path):
    launch = _load_launcher()
    (tmp_path / "serve.args").write_text("# comment\n--port\n\n  30000  \n")
    assert launch.read_lines(str(tmp_path / "serve.args")) == ["--port", "30000"]
    assert launch.read_lines(str(tmp_path / "missing")) == []
    assert launch.ray_start_argv(str(tmp_path)) == []
    with pytest.raises(SystemExit, match="unknown arguments"):
        launch.main(["--bogus"])


def test_launcher_gives_up_when_ray_never_starts(monkeypatch):
    launch = _load_launcher()
    calls = []
    monkeypatch.setattr(launch, "RAY_START_TRIES", 2)
    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    monkeypatch.setattr(launch.subprocess, "run",
                        lambda argv, check: calls.append(argv) or subprocess.CompletedProcess(argv, 1))
    with pytest.raises(SystemExit, match="could not join the Ray cluster"):
        launch.join_ray(["ray", "start", "--address=x:6379"])
    assert len(calls) == 2
