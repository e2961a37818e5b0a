"""Calibrated K recipes (kernels/recipes.py, recipe_calibration.py): softmax invariance,
the exact sink, the balanced map, the digest, pooling runs at later positions, and that
centering removes the error a channel mean causes."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import KernelInputError, get_kv_format
from nibble.kernels.formats import BF16, NVFP4, KRecipe
from nibble.kernels.recipe_calibration import (RIDGE, _balanced_map, calibrate_recipe,
                                               element_roundtrip)
from nibble.kernels.recipes import RecipeParams

L, H, G, D, T = 2, 2, 3, 64, 96
SM = D ** -0.5


def _captures(seed: int = 0, offset: float = 6.0, sink: float = 3.0, t: int = T,
              spread: float = 8.0):
    """Per layer (q [t, H*G, D], k, v [t, H, D]): keys with a large per-channel mean
    (``offset`` on channels 0-7) and a large spread on channels 16-23 that the queries
    barely use, a distinct sink key at position 0."""
    g = torch.Generator().manual_seed(seed)
    caps = []
    for _ in range(L):
        mean = torch.zeros(H, D)
        mean[:, :8] = offset
        k = torch.randn(t, H, D, generator=g) + mean
        k[:, :, 16:24] *= spread
        k[0] = sink * torch.randn(H, D, generator=g)
        q = torch.randn(t, H * G, D, generator=g)
        q[..., :8] *= 0.3
        q[..., 16:24] *= 0.05
        v = torch.randn(t, H, D, generator=g)
        caps.append((q, k, v))
    return caps


def _attention(q, k, v):
    """Causal GQA attention, q [T, Hq, D], k/v [T, H, D] -> [T, Hq, D] (fp32 reference)."""
    t, hq, d = q.shape
    h = k.shape[1]
    s = torch.einsum("thgd,shd->hgts", q.reshape(t, h, hq // h, d).float(), k.float()) * SM
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hgts,shd->thgd", s.softmax(-1), v.float())
    return o.reshape(t, hq, d)


def _params(recipe: KRecipe, k_fmt=NVFP4, v_fmt=NVFP4, caps=None):
    caps = caps or _captures()
    return calibrate_recipe(recipe, [caps], SM, k_fmt, v_fmt, torch.ones(L, 2))


@pytest.mark.parametrize("recipe", [KRecipe("mean"), KRecipe("sink", "diag"),
                                    KRecipe("sink", "balanced", True)])
def test_transform_leaves_attention_unchanged_without_quantization(recipe):
    """q' . k' = q . k - q . c for every key: softmax, hence the output, does not change."""
    p = _params(recipe)
    for layer, (q, k, v) in enumerate(_captures(seed=1)):
        ref = _attention(q, k, v)
        q2, k2, v2 = p.apply(layer, q, k, v)
        assert not torch.allclose(k2, k)                       # K really is transformed
        got = p.finish(layer, _attention(q2, k2, v2))
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_transform_in_bf16_matches_within_bf16_rounding():
    p = _params(KRecipe("sink", "balanced"))
    q, k, v = (x.to(torch.bfloat16) for x in _captures(seed=2, spread=1.0)[0])
    ref = _attention(q, k, v)
    q2, k2, v2 = p.to("cpu", torch.bfloat16).apply(0, q, k, v)     # computed in bf16
    assert q2.dtype == k2.dtype == torch.bfloat16
    err = (_attention(q2, k2, v2) - ref).abs().max().item()
    assert err < 0.03, err
    # A shift applied to K but not to every key breaks it: the test can fail.
    k_bad = k2.clone()
    k_bad[: T // 2] += 3.0
    assert (_attention(q2, k_bad, v2) - ref).abs().max().item() > 0.1


def test_q_map_is_the_inverse_transpose_of_k_map():
    p = _params(KRecipe("sink", "balanced"))
    eye = torch.eye(D).expand(L, H, D, D)
    torch.testing.assert_close(p.q_map @ p.k_map.mT, eye, atol=1e-4, rtol=0)


@pytest.mark.parametrize("transform", ["none", "diag", "balanced"])
def test_sink_key_is_stored_exactly(transform):
    """The shift puts the calibration sink's k' on the NVFP4 grid: quantize is lossless."""
    caps = _captures()
    p = _params(KRecipe("sink", transform), caps=caps)
    rt = element_roundtrip(NVFP4, 1.0)
    for layer, (q, k, v) in enumerate(caps):
        k0 = p.apply(layer, q[:1], k[:1], v[:1])[1]
        assert (rt(k0) - k0).abs().max().item() < 1e-4 * k0.abs().max().item()
        # Plain centering (no nudge) does not have that property.
        kc = k[:1] - k[1:].mean(0)
        assert (rt(kc) - kc).abs().max().item() > 1e-2


def test_balanced_map_equalises_second_moments():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(D, D, generator=g, dtype=torch.float64), torch.randn(
        D, D, generator=g, dtype=torch.float64)
    sk, sq = a @ a.T / D + 0.1 * torch.eye(D, dtype=torch.float64), b @ b.T / D
    m = _balanced_map(sk, sq)
    eye = torch.eye(D, dtype=torch.float64)
    sk, sq = (x + (RIDGE * x.trace() / D + 1e-12) * eye for x in (sk, sq))   # as the map sees them
    ck, cq = m.T @ sk @ m, torch.linalg.inv(m) @ sq @ torch.linalg.inv(m).T
    assert torch.allclose(ck, torch.diag(torch.diagonal(ck)), atol=1e-9)
    torch.testing.assert_close(ck, cq, atol=1e-9, rtol=1e-6)


def _kl_of_quantized_keys(p: RecipeParams | None, caps) -> float:
    t = caps[0][1].shape[0]
    """Mean KL(exact || quantized K) of the attention rows, NVFP4 K, summed over layers."""
    rt = element_roundtrip(NVFP4, 1.0)
    total = 0.0
    for layer, (q, k, v) in enumerate(caps):
        if p is not None:
            q, k, v = p.apply(layer, q, k, v)
        hq = q.shape[1]
        s = torch.einsum("thgd,shd->hgts", q.reshape(t, H, hq // H, D), k) * SM
        sq = torch.einsum("thgd,shd->hgts", q.reshape(t, H, hq // H, D), rt(k)) * SM
        mask = ~torch.ones(t, t, dtype=torch.bool).tril()
        lp = s.masked_fill(mask, float("-inf")).log_softmax(-1)
        lq = sq.masked_fill(mask, float("-inf")).log_softmax(-1)
        total += (lp.exp() * (lp - lq)).nan_to_num().sum(-1).mean().item()
    return total


def test_centering_cuts_the_error_of_a_channel_mean():
    calib, evals = _captures(seed=0, offset=20.0, t=256), _captures(seed=5, offset=20.0, t=256)
    plain = _kl_of_quantized_keys(None, evals)
    centered = _kl_of_quantized_keys(_params(KRecipe("sink"), caps=calib), evals)
    smoothed = _kl_of_quantized_keys(_params(KRecipe("sink", "diag"), caps=calib), evals)
    balanced = _kl_of_quantized_keys(_params(KRecipe("sink", "balanced"), caps=calib), evals)
    assert centered < 0.7 * plain, (plain, centered)
    # The spread channels the queries ignore: smoothing moves their range to q's side.
    assert smoothed < 0.6 * centered and balanced < 0.8 * centered, (centered, smoothed, balanced)


def test_digest_is_deterministic_and_names_the_parameters():
    a, b = _params(KRecipe("sink", "balanced")), _params(KRecipe("sink", "balanced"))
    assert a.digest == b.digest and len(a.digest) == 16
    assert _params(KRecipe("sink", "diag")).digest != a.digest
    assert _params(KRecipe("sink", "balanced"), caps=_captures(seed=9)).digest != a.digest
    assert a.to("cpu").digest == a.digest


def test_bf16_elements_and_v_shift_roundtrip():
    p = _params(KRecipe("sink", "none", True), k_fmt=BF16, v_fmt=BF16)
    assert p.k_map is None and p.v_shift.shape == (L, H, D)
    out = torch.randn(5, H * G, D)
    back = p.finish(0, out) - p.v_shift[0].repeat_interleave(G, 0)
    torch.testing.assert_close(back, out)


def test_calibration_needs_a_sequence():
    q, k, v = _captures()[0]
    with pytest.raises(KernelInputError):
        calibrate_recipe(KRecipe(), [[(q[:2], k[:2], v[:2])]], SM, NVFP4, NVFP4, torch.ones(1, 2))


def test_default_nvfp4_has_the_recipe_and_plain_keeps_the_layout():
    nv, plain = get_kv_format("nvfp4"), get_kv_format("nvfp4_plain")
    assert nv.k_recipe is not None and plain.k_recipe is None
    assert nv.k is plain.k and nv.v is plain.v           # same bytes, same kernels
    assert get_kv_format("nvfp4_kc").k_recipe == KRecipe("sink")
