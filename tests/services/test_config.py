"""The config tree's one declaration per field: argparse generated from it, defaults stated
once, choices read from the registries, SGLang's names, the experimental KV formats' gate."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from nibble.kernels import KV_CACHE_FORMATS, KVCacheFormat
from nibble.kernels.formats import BF16
from nibble.services.cli import build_parser, main
from nibble.services.config import (CacheConfig, ConfigError, DeviceConfig, DisaggConfig,
                                    HiCacheConfig, ModelConfig, NibbleConfig, SchedulerConfig,
                                    ServerConfig, config_from_args, flag_aliases, slices, specs)
from nibble.services.config.flags import META_KEY


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def parse(*argv: str, env=None) -> NibbleConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]), env or {})


# ---------------------------------------------------------------- one declaration per field

def test_every_field_is_declared_once_with_a_unique_flag():
    seen: dict[str, str] = {}
    for name, cls, _ in slices():
        for f in dataclasses.fields(cls):
            assert META_KEY in f.metadata, f"{cls.__name__}.{f.name} lacks flag()"
        for f, spec, _ in specs(cls):
            names = [*spec.option_strings, *(n for n, _ in spec.extra)]
            names += [spec.sglang.name] if spec.sglang else []
            for opt in names:
                assert opt.startswith("--") and opt not in seen, (opt, seen.get(opt))
                seen[opt] = f"{name}.{f.name}"
    # ... and the parser has exactly these options (plus --help): nothing written by hand
    assert set(actions(serve_parser())) - {"-h", "--help"} == set(seen)


def test_argparse_defaults_are_the_dataclass_defaults():
    by_dest = {a.dest: a for a in serve_parser()._actions}
    for _, cls, _ in slices():
        for f, spec, _ in specs(cls):
            action = by_dest[f.name]
            if isinstance(f.default, tuple):             # repeatable: absent means ()
                assert action.default is None and f.default == ()
            else:
                assert action.default == f.default, f.name
    assert parse() == NibbleConfig()


def test_secret_fields_stay_out_of_repr():
    cfg = parse("--api-key", "sk-one-key-1234", "--admin-api-key", "sk-admin-key-123")
    assert "sk-" not in repr(cfg)
    assert cfg.server.api_keys == ("sk-one-key-1234",)


# ---------------------------------------------------------------- choices from the registries

def test_a_registered_kv_format_is_offered(monkeypatch):
    monkeypatch.setitem(KV_CACHE_FORMATS, "test_fmt", KVCacheFormat("test_fmt", BF16, BF16))
    choices = actions(serve_parser())["--kv-cache-dtype"].choices
    assert "test_fmt" in list(choices) and list(choices)[0] == "auto"
    assert parse("--kv-cache-dtype", "test_fmt").cache.kv_cache_dtype == "test_fmt"


def test_a_registered_storage_backend_and_attention_backend_are_offered(monkeypatch):
    from nibble.services.attention import ATTENTION_BACKENDS
    from nibble.tiering.storage import base as storage_base
    monkeypatch.setitem(storage_base._BACKENDS._classes, "dummy_store", object)
    monkeypatch.setitem(ATTENTION_BACKENDS, "dummy_attn", object)
    opts = actions(serve_parser())
    assert list(opts["--hicache-storage-backend"].choices) == ["dummy_store", "file", "redis",
                                                               "none"]
    assert "dummy_attn" in opts["--attention-backend"].choices
    assert set(opts["--kv-transport"].choices) == {"grpc", "nixl"}
    assert list(opts["--decode-kernel"].choices) == ["auto", "triton", "cuda"]


# ---------------------------------------------------------------- experimental KV formats

EXPERIMENTAL = sorted(n for n, f in KV_CACHE_FORMATS.items() if f.experimental)


def test_only_the_documented_formats_are_offered():
    assert list(actions(serve_parser())["--kv-cache-dtype"].choices) == \
        ["auto", "bf16", "fp8_e4m3", "nvfp4"]
    assert {"nvfp4_plain", "nvfp4_kcb", "fp8k_nvfp4v", "nvfp4_khad"} <= set(EXPERIMENTAL)


@pytest.mark.parametrize("fmt", EXPERIMENTAL)
def test_experimental_formats_need_the_flag(fmt):
    with pytest.raises(ConfigError, match=f"{fmt} is an experimental KV format: add "
                                          "--enable-experimental-kv-formats"):
        parse("--kv-cache-dtype", fmt)
    cfg = parse("--kv-cache-dtype", fmt, "--enable-experimental-kv-formats")
    assert cfg.cache.kv_cache_dtype == fmt and cfg.cache.enable_experimental_kv_formats


def test_experimental_format_without_the_flag_exits_2(capsys, monkeypatch):
    import nibble.services.cli as cli
    monkeypatch.setattr(cli, "run_serve", lambda cfg: pytest.fail("the engine was built"))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--kv-cache-dtype", "nvfp4_kcb"])
    assert e.value.code == 2
    assert "--enable-experimental-kv-formats" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--kv-cache-dtype", "nvfp5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "nvfp4_kcb" not in err     # not offered


# ---------------------------------------------------------------- SGLang's names

def test_sglang_aliases():
    assert flag_aliases() == {
        "--hicache-storage-prefetch-policy": "--hicache-prefetch-policy",
        "--disaggregation-mode": "--disaggregate",
        "--disaggregation-transfer-backend": "--kv-transport",
        "--tensor-parallel-size": "--tp-size"}
    h = serve_parser().format_help()
    assert all(alias in h for alias in flag_aliases())
    assert parse("--hicache-storage-prefetch-policy", "timeout").hicache.hicache_prefetch_policy \
        == "timeout"
    assert parse("--disaggregation-mode", "prefill").disagg.disaggregate
    assert parse("--disaggregation-mode", "decode").disagg.disaggregate
    assert not parse("--disaggregation-mode", "null").disagg.disaggregate
    assert parse("--disaggregate", "--disaggregation-mode", "decode").disagg.disaggregate
    assert parse("--disaggregation-transfer-backend", "nixl").disagg.kv_transport == "nixl"
    assert parse("--disaggregation-transfer-backend", "grpc").disagg.kv_transport == "grpc"
    assert parse("--tensor-parallel-size", "2", "--device", "cpu").device.tp_size == 2


@pytest.mark.parametrize("argv,message", [
    (["--disaggregation-mode", "both"], "null, prefill or decode"),
    (["--disaggregate", "--disaggregation-mode", "null"], "contradicts --disaggregate"),
    (["--disaggregation-transfer-backend", "mooncake"], "mooncake: Nibble moves KV pages over "
                                                        "grpc or nixl"),
    (["--kv-transport", "nixl", "--disaggregation-transfer-backend", "grpc"],
     "contradicts --kv-transport nixl"),
])
def test_sglang_values_nibble_cannot_honour(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


# ---------------------------------------------------------------- kernels and lease

def test_kernel_and_lease_flags():
    cfg = parse("--decode-kernel", "triton", "--store-kernel", "cuda", "--kv-lease-seconds", "2.5")
    assert (cfg.device.decode_kernel, cfg.device.store_kernel) == ("triton", "cuda")
    assert cfg.disagg.kv_lease == 2.5
    assert NibbleConfig().disagg.kv_lease == 5.0
    with pytest.raises(ConfigError, match="--kv-lease-seconds must be > 0"):
        parse("--kv-lease-seconds", "0")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--decode-kernel", "flash"])


# ---------------------------------------------------------------- a whole command line

def test_full_command_line_round_trip(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-file-key-0001\n")
    keys.chmod(0o600)
    argv = ["--model-path", "/m", "--served-model-name", "m", "--dtype", "bfloat16",
            "--context-length", "4096", "--load-format", "dummy", "--quantization", "none",
            "--kv-cache-dtype", "nvfp4_kcb", "--enable-experimental-kv-formats",
            "--page-size", "32", "--mem-fraction-static", "0.5", "--max-total-tokens", "8192",
            "--prefill-kv-dtype", "fp8_e4m3", "--kv-secret-file", "/s",
            "--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-size", "1.5",
            "--hicache-storage-backend", "redis", "--hicache-storage-url", "redis://h:1/0",
            "--hicache-storage-prefix", "p:", "--hicache-storage-ttl", "60",
            "--hicache-storage-size", "2", "--hicache-write-policy", "write_back",
            "--hicache-storage-prefetch-policy", "timeout", "--hicache-prefetch-timeout", "1",
            "--hicache-storage-password-file", "/pw",
            "--max-running-requests", "8", "--chunked-prefill-size", "256",
            "--max-prefill-tokens", "1024", "--max-queued-requests", "10",
            "--schedule-policy", "lpm", "--schedule-conservativeness", "0.5",
            "--disaggregation-mode", "prefill", "--prefill-workers", "2", "--decode-workers", "3",
            "--ray-address", "auto", "--disaggregation-transfer-backend", "nixl",
            "--kv-transfer-failure-policy", "fail", "--kv-transfer-timeout", "9",
            "--kv-lease-seconds", "7", "--kv-transfer-host", "10.0.0.1",
            "--device", "cuda", "--attention-backend", "triton", "--disable-cuda-graph",
            "--cuda-graph-max-bs", "32", "--decode-kernel", "cuda", "--store-kernel", "triton",
            "--host", "0.0.0.0", "--port", "8000", "--log-level", "debug",
            "--api-key", "sk-flag-key-0001", "--api-key-file", str(keys), "--grpc-port",
            "--allow-unauthenticated", "--graceful-shutdown-timeout", "5",
            "--max-request-body-bytes", "4096"]
    want = NibbleConfig(
        ModelConfig("/m", "m", "bfloat16", 4096, "dummy", quantization="none"),
        CacheConfig("nvfp4_kcb", 32, 0.5, 8192, "fp8_e4m3", False, "/s", True),
        HiCacheConfig(True, 3.0, 1.5, "redis", "redis://h:1/0", "p:", 60, 2.0, "write_back",
                      "timeout", 1.0, "/pw"),
        SchedulerConfig(8, 256, 1024, 10, "lpm", 0.5),
        DisaggConfig(True, 2, 3, "auto", "nixl", "fail", 9.0, 7.0, "10.0.0.1"),
        DeviceConfig("cuda", "triton", True, 32, "cuda", "triton"),
        ServerConfig("0.0.0.0", 8000, "debug", ("sk-flag-key-0001", "sk-file-key-0001",
                                                "sk-env-key-00001"), (), 30001,
                     allow_unauthenticated=True, graceful_shutdown_timeout=5.0,
                     max_request_body_bytes=4096))
    assert parse(*argv, env={"NIBBLE_API_KEY": "sk-env-key-00001"}) == want


@pytest.mark.parametrize("args,needle", [
    (["--tp-size", "0"], "--tp-size must be >= 1"),
    (["--tp-size", "2", "--device", "cpu", "--tp-backend", "nccl"], "needs --device cuda"),
    (["--base-gpu-id", "-1"], "--base-gpu-id must be >= 0"),
    (["--disaggregate", "--decode-tp-size", "2"], "re-slicing KV heads during the prefill"),
    (["--tp-size", "2", "--disaggregate", "--prefill-tp-size", "1"],
     "--prefill-tp-size 1 and --decode-tp-size 2 differ"),
    (["--prefill-tp-size", "2"], "--prefill-tp-size size the workers of --disaggregate"),
    (["--disaggregate", "--decode-tp-size", "0", "--prefill-tp-size", "0"], "must be >= 1"),
])
def test_tensor_parallel_limits_are_refused_by_name(args, needle):
    with pytest.raises(ConfigError, match=needle):
        parse(*args)


def test_disaggregated_tensor_parallel_workers_of_equal_size_are_accepted():
    from nibble.services.config.validate import role_tp_sizes
    from nibble.services.disagg.client import actor_config
    assert role_tp_sizes(parse("--tp-size", "2", "--disaggregate", "--device", "cpu")) == (2, 2)
    cfg = parse("--disaggregate", "--device", "cpu", "--prefill-tp-size", "2",
                "--decode-tp-size", "2")
    assert cfg.device.tp_size == 1 and actor_config(cfg).device.tp_size == 2


def test_role_tp_sizes_default_to_tp_size():
    from nibble.services.config.validate import role_tp_sizes
    assert role_tp_sizes(parse("--disaggregate")) == (1, 1)
    cfg = parse("--disaggregate", "--prefill-tp-size", "1", "--decode-tp-size", "1")
    assert (cfg.disagg.prefill_tp_size, cfg.disagg.decode_tp_size) == (1, 1)
    assert role_tp_sizes(cfg) == (1, 1)


def test_tensor_parallel_takes_the_hierarchical_cache():
    cfg = parse("--tp-size", "2", "--device", "cpu", "--enable-hierarchical-cache")
    assert cfg.device.tp_size == 2 and cfg.hicache.enable_hierarchical_cache
