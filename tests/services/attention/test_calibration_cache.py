"""The calibration cache (services/attention/calibration_cache.py): read back only what is
ours, matches its key and hashes to its digest; anything else is recalibrated."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from nibble.services.attention import calibration
from nibble.services.attention.calibration import calibrate_pool
from nibble.services.attention.calibration_cache import (CalibrationCache, default_dir,
                                                         resolve_dir)

from .conftest import make_engine_with, tiny_arch, tiny_model
from .test_k_recipe_backends import TextTokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_model(tiny_arch("qwen3"), torch.float32)


@pytest.fixture
def forwards(monkeypatch):
    """Counts the calibration's model forwards."""
    calls = []
    real = calibration.capture_qkv

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(calibration, "capture_qkv", counting)
    return calls


def calibrate(model, cache, fingerprint="weights-a", tp=None):
    pool = make_engine_with(model, "torch", kv="nvfp4").pool
    return calibrate_pool(model, TextTokenizer(), pool, model.arch, 4096, cache, fingerprint,
                          tp), pool


def the_file(root):
    (path,) = [p for p in root.iterdir() if p.suffix == ".safetensors"]
    return path


def test_second_start_reads_the_same_parameters_back(model, tmp_path, forwards):
    cache = CalibrationCache(tmp_path / "cal")
    first, _ = calibrate(model, cache)
    assert forwards and oct(the_file(tmp_path / "cal").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "cal").stat().st_mode & 0o777) == "0o700"
    forwards.clear()
    again, pool = calibrate(model, cache)
    assert not forwards                                 # no forward: read back
    assert again.digest == first.digest == pool.recipe_digest
    for name in ("k_shift", "k_map", "q_map", "v_shift", "k_bias"):
        a, b = getattr(first, name), getattr(again, name)
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("change", ["fingerprint", "context"])
def test_other_inputs_miss(model, tmp_path, forwards, change):
    cache = CalibrationCache(tmp_path)
    calibrate(model, cache)
    forwards.clear()
    pool = make_engine_with(model, "torch", kv="nvfp4").pool
    calibrate_pool(model, TextTokenizer(), pool, model.arch,
                   300 if change == "context" else 4096, cache,   # the model: 512
                   "weights-b" if change == "fingerprint" else "weights-a")
    assert forwards
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


def test_no_fingerprint_no_cache(model, tmp_path, forwards):
    calibrate(model, CalibrationCache(tmp_path), fingerprint=None)
    assert forwards and not list(tmp_path.iterdir())


def test_a_damaged_record_is_recalibrated_and_rewritten(model, tmp_path, forwards, caplog):
    cache = CalibrationCache(tmp_path)
    first, _ = calibrate(model, cache)
    path = the_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40                                    # a bit of the last tensor's bytes
    path.write_bytes(bytes(data))
    forwards.clear()
    with caplog.at_level(logging.WARNING):
        again, _ = calibrate(model, cache)
    assert forwards and again.digest == first.digest
    assert "damaged" in caplog.text or "unusable" in caplog.text
    forwards.clear()
    calibrate(model, cache)                             # the rewritten record is good
    assert not forwards


def test_a_record_under_another_key_is_refused(model, tmp_path, forwards, caplog):
    cache = CalibrationCache(tmp_path)
    calibrate(model, cache, fingerprint="weights-b")
    (b,) = list(tmp_path.glob("*.safetensors"))
    calibrate(model, cache, fingerprint="weights-a")
    a = next(p for p in tmp_path.glob("*.safetensors") if p != b)
    os.replace(b, a)                                    # b's parameters swapped in for a
    forwards.clear()
    with caplog.at_level(logging.WARNING):
        calibrate(model, cache, fingerprint="weights-a")
    assert forwards and "does not match its key" in caplog.text


@pytest.mark.parametrize("what", ["file", "dir"])
def test_records_others_can_write_are_not_used(model, tmp_path, forwards, caplog, what):
    root = tmp_path / "cal"
    cache = CalibrationCache(root)
    calibrate(model, cache)
    os.chmod(the_file(root) if what == "file" else root, 0o666 if what == "file" else 0o777)
    forwards.clear()
    with caplog.at_level(logging.WARNING):
        calibrate(model, cache)
    assert forwards and "not private" in caplog.text


def test_an_unwritable_cache_only_warns(model, tmp_path, forwards, caplog):
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING):
        params, _ = calibrate(model, CalibrationCache(tmp_path / "file" / "cal"))
    assert params is not None and "could not write" in caplog.text


def test_tensor_parallel_ranks_calibrate_together_unless_all_hit(model, tmp_path, forwards):
    cache = CalibrationCache(tmp_path)
    missing_elsewhere = SimpleNamespace(rank=0, size=2, all_min=lambda v: 0)
    calibrate(model, cache, tp=missing_elsewhere)
    forwards.clear()
    calibrate(model, cache, tp=missing_elsewhere)       # this rank hits, the other does not
    assert forwards
    forwards.clear()
    calibrate(model, cache, tp=SimpleNamespace(rank=0, size=2, all_min=lambda v: v))
    assert not forwards


def test_directory_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert resolve_dir("auto") == default_dir() == tmp_path / "nibble" / "calibration"
    assert resolve_dir("off") is None
    assert resolve_dir("/srv/cal") == type(tmp_path)("/srv/cal")
