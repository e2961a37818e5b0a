"""Page records are authenticated for their key; content keys are keyed; scales must be finite."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from nibble.kernels import PageLayout
from nibble.kernels.formats import get_kv_format
from nibble.tiering import KVPool
from nibble.tiering.page_record import (MAGIC, PageHeader, PageRecordError, chain_keys,
                                        check_finite, decode_page, encode_page, namespace_root)
from nibble.tiering.secret import KVSecret

GEOM = dict(num_layers=2, num_kv_heads=2, head_dim=32, page_size=16)
SECRET = KVSecret("page-record-tests-secret-0123456789")


def quantized_page(fmt: str, seed: int = 0):
    """A pool of one page holding real quantized K/V, and its header."""
    layout = PageLayout(fmt, **GEOM)
    pool = KVPool(layout, 1)
    g = torch.Generator().manual_seed(seed)
    f = get_kv_format(fmt)
    for layer in range(layout.num_layers):
        view = pool.layer(layer)
        for elem, data, scale in ((f.k, view.k_data, view.k_scale), (f.v, view.v_data, view.v_scale)):
            x = torch.randn(1, layout.num_kv_heads, layout.page_size, layout.head_dim, generator=g)
            codes, scales = elem.quantize(x, torch.tensor(1.0))
            data.copy_(codes)
            if scale is not None:
                scale.copy_(scales)
    return layout, pool, PageHeader.for_pool(layout, pool.scale_version, pool.global_scales)


def keys_for(tokens, tenant="t", secret=SECRET):
    layout = PageLayout("nvfp4", **GEOM)
    return chain_keys(namespace_root("model", layout, tenant, secret=secret), tokens, 16,
                      secret=secret)


def test_a_record_verifies_only_under_its_own_key_and_secret():
    layout, pool, header = quantized_page("nvfp4")
    k1, k2 = keys_for(list(range(32)))
    blob = encode_page(header, pool.pages[0], key=k1, secret=SECRET)
    assert bytes(decode_page(blob, header, key=k1, secret=SECRET)) == bytes(pool.pages[0].numpy())
    for key, secret in ((k2, SECRET), (k1, KVSecret.generate())):
        with pytest.raises(PageRecordError, match="authenticate") as err:
            decode_page(blob, header, key=key, secret=secret)
        assert err.value.reason == "auth"


def _forge(header: PageHeader, payload: bytes, version: int) -> bytes:
    """What an attacker without the secret can build: the tag slot holds SHA-256."""
    head = json.dumps(header.__dict__, separators=(",", ":")).encode()
    digest = hashlib.sha256(head + payload).digest()
    return struct.pack("<4sHI", MAGIC, version, len(head)) + head + digest + payload


@pytest.mark.parametrize("version,reason", [(1, "malformed"), (2, "auth")])
def test_forged_records_with_a_recomputed_checksum_are_refused(version, reason):
    layout, pool, header = quantized_page("nvfp4")
    key = keys_for(list(range(16)))[0]
    with pytest.raises(PageRecordError) as err:
        decode_page(_forge(header, bytes(layout.page_nbytes), version), header, key=key,
                    secret=SECRET)
    assert err.value.reason == reason


def test_every_byte_is_covered_by_the_tag():
    layout, pool, header = quantized_page("fp8_e4m3")
    key = keys_for(list(range(16)))[0]
    blob = encode_page(header, pool.pages[0], key=key, secret=SECRET)
    for pos in (0, 5, 12, 40, len(blob) - 40, len(blob) - 1):
        bad = bytearray(blob)
        bad[pos] ^= 0x10
        with pytest.raises(PageRecordError):
            decode_page(bytes(bad), header, key=key, secret=SECRET)
    with pytest.raises(PageRecordError, match="truncated"):
        decode_page(blob[:20], header, key=key, secret=SECRET)
    with pytest.raises(PageRecordError) as err:                  # random bytes
        decode_page(torch.randint(0, 256, (len(blob),), generator=torch.Generator().manual_seed(
            1), dtype=torch.uint8).numpy().tobytes(), header, key=key, secret=SECRET)
    assert err.value.reason in ("auth", "malformed")


def test_a_genuine_record_for_another_scale_version_is_stale():
    layout, pool, header = quantized_page("nvfp4")
    key = keys_for(list(range(16)))[0]
    blob = encode_page(header, pool.pages[0], key=key, secret=SECRET)
    moved = PageHeader(**{**header.__dict__, "scale_version": header.scale_version + 1})
    with pytest.raises(PageRecordError) as err:
        decode_page(blob, moved, key=key, secret=SECRET)
    assert err.value.reason == "stale"


def test_content_keys_depend_on_the_secret_and_chain():
    tokens = list(range(64))
    mine, again = keys_for(tokens), keys_for(tokens)
    assert mine == again and len(set(mine)) == 4
    assert not set(mine) & set(keys_for(tokens, secret=KVSecret.generate()))
    assert not set(mine) & set(keys_for(tokens, tenant="u"))
    # Without the secret, the key of the next page cannot be derived from a leaked one.
    nxt = hashlib.sha256(mine[0] + struct.pack("<16i", *tokens[16:32])).digest()
    assert nxt != mine[1]


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3", "bf16"])
def test_clean_pages_are_finite(fmt):
    layout, pool, header = quantized_page(fmt)
    check_finite(layout, pool.pages[0].numpy().tobytes(), header)


@pytest.mark.parametrize("fmt,section,value", [
    ("nvfp4", "k_scale", 0x7F), ("nvfp4", "v_scale", 0xFF),
    ("fp8_e4m3", "k_data", 0xFF), ("bf16", "v_data", 0x7F)])
def test_nan_scales_or_values_are_refused(fmt, section, value):
    layout, pool, header = quantized_page(fmt)
    view = getattr(pool.layer(1), section)
    flat = view.reshape(-1)
    i = flat.numel() // 2                         # even: a bf16 value's low byte
    flat[i + (fmt == "bf16")] = value
    if fmt == "bf16":
        flat[i] = 0xC0                            # exponent all ones, mantissa != 0: NaN
    with pytest.raises(PageRecordError, match="non-finite") as err:
        check_finite(layout, pool.pages[0].numpy().tobytes(), header)
    assert err.value.reason == "nonfinite"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_global_scales_must_be_finite_and_positive(bad):
    layout, pool, header = quantized_page("nvfp4")
    scales = ((1.0, 1.0), (bad, 1.0))
    with pytest.raises(PageRecordError, match="global scales"):
        check_finite(layout, pool.pages[0].numpy().tobytes(),
                     PageHeader(**{**header.__dict__, "global_scales": scales}))
