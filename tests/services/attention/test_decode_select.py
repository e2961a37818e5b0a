"""Which decode and store kernels the Triton backend picks (``decode_select.py``).

Faked devices and capabilities; nothing is ever compiled (``no_compile``).
"""

from __future__ import annotations

import logging

import pytest
import torch

from nibble.services.attention import decode_select as ds
from nibble.services.errors import ConfigError

from .conftest import kv_layout as layout

CPU, CUDA = torch.device("cpu"), torch.device("cuda")   # no CUDA needed to name a device



@pytest.mark.parametrize("lay,cap,device,q_heads,want", [
    (layout(), (9, 0), CUDA, None, "cuda-sm90"),
    (layout(page_size=32), (9, 0), CUDA, 16, "cuda-sm90"),        # group 8: the limit
    (layout(page_size=64, kv_heads=1), (9, 0), CUDA, 4, "cuda-sm90"),
    (layout(page_size=48), (9, 0), CUDA, None, "triton"),          # 16 * 3
    (layout(head_dim=64), (9, 0), CUDA, None, "triton"),
    (layout(head_dim=256), (9, 0), CUDA, None, "triton"),
    (layout("fp8_e4m3"), (9, 0), CUDA, None, "cuda-sm90"),
    (layout("fp8_e4m3", page_size=64), (9, 0), CUDA, 16, "cuda-sm90"),
    (layout("fp8_e4m3", head_dim=64), (9, 0), CUDA, None, "triton"),
    (layout("fp8k_nvfp4v"), (9, 0), CUDA, None, "triton"),         # K and V formats differ
    (layout("bf16"), (9, 0), CUDA, None, "triton"),
    (layout(), (9, 0), CUDA, 32, "triton"),                        # group 16
    (layout(), (8, 0), CUDA, None, "triton"),
    (layout(), (10, 0), CUDA, None, "triton"),
    (layout(), (9, 0), CPU, None, "triton"),
])
def test_selection(fake_cap, no_compile, lay, cap, device, q_heads, want):
    fake_cap(cap)
    choice = ds.select_decode_impl(lay, device, q_heads)
    assert choice.impl == want and not choice.forced
    good = f"{lay.fmt.k.name} KV, head_dim 128, Hopper"
    assert (choice.why == good) == (want == "cuda-sm90"), choice.why


def test_reasons_name_the_mismatch(fake_cap, no_compile):
    def why(lay, q_heads=None, device=CUDA):
        return ds.select_decode_impl(lay, device, q_heads).why
    assert "page_size" in why(layout(page_size=48))
    assert "head_dim 128" in why(layout(head_dim=64))
    assert "NVFP4 or FP8 E4M3" in why(layout("bf16"))
    assert "'fp8k_nvfp4v'" in why(layout("fp8k_nvfp4v"))
    assert "32 query and 2 KV heads" in why(layout(), 32)
    assert "CUDA device" in why(layout(), device=CPU)
    fake_cap((8, 9))
    assert "8.9" in why(layout())


@pytest.mark.parametrize("lay,cap,device,env,want", [
    (layout(), (9, 0), CUDA, None, "triton"),                  # slower on an H200: opt-in
    (layout(), (9, 0), CUDA, "auto", "triton"),
    (layout(), (9, 0), CUDA, "cuda", "cuda-sm90"),
    (layout(head_dim=64), (9, 0), CUDA, "cuda", "cuda-sm90"),  # any head_dim % 16 == 0
    (layout("fp8_e4m3"), (9, 0), CUDA, "triton", "triton"),
])
def test_store_selection(fake_cap, no_compile, monkeypatch, lay, cap, device, env, want):
    fake_cap(cap)
    if env:
        monkeypatch.setenv(ds.STORE_ENV_VAR, env)
    assert ds.select_store_impl(lay, device) == want


@pytest.mark.parametrize("lay,cap,device,message", [
    (layout("fp8_e4m3"), (9, 0), CUDA, "writes NVFP4 pages"),
    (layout("fp8k_nvfp4v"), (9, 0), CUDA, "writes NVFP4 pages"),
    (layout(), (8, 0), CUDA, "compute capability 9.0"),
    (layout(), (9, 0), CPU, "compute capability 9.0"),
])
def test_forced_cuda_store_that_cannot_run(fake_cap, no_compile, monkeypatch, lay, cap, device,
                                           message):
    fake_cap(cap)
    monkeypatch.setenv(ds.STORE_ENV_VAR, "cuda")
    with pytest.raises(ConfigError, match=f"NIBBLE_STORE_KERNEL=cuda: .*{message}"):
        ds.select_store_impl(lay, device)


def test_store_env_must_be_known(monkeypatch):
    monkeypatch.setenv(ds.STORE_ENV_VAR, "fast")
    with pytest.raises(ConfigError, match="NIBBLE_STORE_KERNEL"):
        ds.select_store_impl(layout(), CUDA)


def test_capability_not_asked_for_cpu_or_unfit_layouts(monkeypatch, no_compile):
    monkeypatch.delenv(ds.ENV_VAR, raising=False)

    def boom(device=None):
        raise AssertionError("capability asked")
    monkeypatch.setattr(torch.cuda, "get_device_capability", boom)
    assert ds.select_decode_impl(layout(), CPU).impl == "triton"
    assert ds.select_decode_impl(layout("bf16"), CUDA).impl == "triton"


# ---------------------------------------------------------------- --decode-kernel / --store-kernel

def test_flag_forces_the_kernel(fake_cap, no_compile):
    choice = ds.select_decode_impl(layout(), CUDA, None, "triton")
    assert (choice.impl, choice.why, choice.forced) == ("triton", "--decode-kernel triton", True)
    choice = ds.select_decode_impl(layout(), CUDA, None, "cuda")
    assert (choice.impl, choice.why, choice.forced) == ("cuda-sm90", "--decode-kernel cuda", True)
    with pytest.raises(ConfigError, match=r"--decode-kernel cuda: .*head_dim 128"):
        ds.select_decode_impl(layout(head_dim=64), CUDA, None, "cuda")
    with pytest.raises(ConfigError, match=r"--decode-kernel cuda: .*query heads"):
        ds.confirm_group(choice, 32, 2)
    assert ds.select_store_impl(layout(), CUDA, "cuda") == "cuda-sm90"
    with pytest.raises(ConfigError, match="--store-kernel cuda: .*writes NVFP4 pages"):
        ds.select_store_impl(layout("fp8_e4m3"), CUDA, "cuda")
    with pytest.raises(ConfigError, match="--decode-kernel must be one of"):
        ds.select_decode_impl(layout(), CUDA, None, "flash")


def test_flag_wins_over_the_deprecated_env(fake_cap, no_compile, monkeypatch, caplog):
    monkeypatch.setenv(ds.ENV_VAR, "cuda")
    monkeypatch.setenv(ds.STORE_ENV_VAR, "cuda")
    assert ds.select_decode_impl(layout(), CUDA, None, "triton").impl == "triton"
    assert ds.select_store_impl(layout(), CUDA, "triton") == "triton"
    monkeypatch.setattr(ds, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=ds.__name__):
        why = ds.select_decode_impl(layout(), CUDA, None, "auto").why
        assert why == "NIBBLE_DECODE_KERNEL=cuda"
        assert ds.select_store_impl(layout(), CUDA) == "cuda-sm90"
    assert "$NIBBLE_DECODE_KERNEL is deprecated; use --decode-kernel cuda" in caplog.text
    assert "$NIBBLE_STORE_KERNEL is deprecated; use --store-kernel cuda" in caplog.text


def test_the_backend_reads_its_device_slice(fake_cap, no_compile):
    from types import SimpleNamespace

    from nibble.services.attention import TritonAttentionBackend
    from nibble.services.config import DeviceConfig
    if TritonAttentionBackend is None:
        pytest.skip("Triton is not importable")

    def backend(**kw):
        return TritonAttentionBackend(SimpleNamespace(layout=layout(), device=CUDA), 0.1,
                                      device_cfg=DeviceConfig(**kw))
    assert backend().decode_impl == "cuda-sm90" and backend().store_impl == "triton"
    b = backend(decode_kernel="triton", store_kernel="cuda")
    assert (b.decode_impl, b.store_impl) == ("triton", "cuda-sm90")
