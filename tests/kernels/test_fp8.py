"""FP8 E4M3 per-layer-scale quantizer: hand-computed bytes and round-trip bounds.

E4M3 byte = sign << 7 | exponent (bias 7) << 3 | mantissa; exponent 0 is
subnormal (m * 2**-9); 0x7E = 448 is the largest finite value, 0x7F/0xFF NaN.
Expected bytes are hand-computed literals.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nibble.kernels import KernelInputError, NonFiniteInputError, dequantize_fp8, quantize_fp8
from nibble.kernels.formats import FP8_E4M3

U = 2.0 ** -9

# (x, per-layer scale, expected byte)
QUANT_CASES = [
    (1.0, 1.0, 0x38), (-1.0, 1.0, 0xB8), (0.0, 1.0, 0x00), (-0.0, 1.0, 0x80),
    (0.1, 1.0, 0x1D),                       # 1.6 * 2**-4 -> 1.625 * 2**-4
    (240.0, 1.0, 0x77), (256.0, 1.0, 0x78),
    # saturation at 448 (no NaN, no inf)
    (448.0, 1.0, 0x7E), (-448.0, 1.0, 0xFE), (449.0, 1.0, 0x7E), (464.0, 1.0, 0x7E),
    (1e9, 1.0, 0x7E), (-1e9, 1.0, 0xFE), (3e38, 1.0, 0x7E),
    # round-to-nearest-even ties
    (1.0625, 1.0, 0x38), (1.1875, 1.0, 0x3A), (1.0625 + 2.0 ** -10, 1.0, 0x39),
    (17.0, 1.0, 0x58), (19.0, 1.0, 0x5A), (-17.0, 1.0, 0xD8),
    # subnormals
    (U, 1.0, 0x01), (3 * U, 1.0, 0x03), (7 * U, 1.0, 0x07), (2.0 ** -6, 1.0, 0x08),
    (0.5 * U, 1.0, 0x00), (1.5 * U, 1.0, 0x02), (2.5 * U, 1.0, 0x02), (7.5 * U, 1.0, 0x08),
    (0.5 * U + 2.0 ** -20, 1.0, 0x01), (-U, 1.0, 0x81), (1e-10, 1.0, 0x00), (-1e-10, 1.0, 0x80),
    # per-layer scale
    (3.0, 2.0, 0x3C), (224.0, 0.5, 0x7E), (1000.0, 0.5, 0x7E), (0.25 * U, 0.25, 0x01),
    (3.0, 3.0, 0x38), (51.0, 3.0, 0x58), (-4.5, 3.0, 0xBC),
    # x / 7 is exactly a tie (1/7 is inexact, so x * (1/7) is not): 0.0244140625 lies
    # between 0x0C (1.5 * 2**-6) and 0x0D (1.625 * 2**-6); 0.09765625 between 0x1C
    # (1.5 * 2**-4) and 0x1D.
    (0.1708984375, 7.0, 0x0C), (0.68359375, 7.0, 0x1C),
]


def test_quantize_table():
    for x, scale, byte in QUANT_CASES:
        got = quantize_fp8(torch.tensor([x]), scale)
        assert got.dtype == torch.uint8
        assert got.item() == byte, (x, scale, hex(got.item()), hex(byte))


def test_quantize_keeps_shape_and_accepts_tensor_scale():
    x = torch.tensor([[1.0, 17.0, 448.0], [-U, 0.1, 1e9]], dtype=torch.bfloat16)
    got = quantize_fp8(x, torch.tensor([1.0]))
    # bf16(0.1) = 0.10009765625 -> still 0x1D
    assert got.tolist() == [[0x38, 0x58, 0x7E], [0x81, 0x1D, 0x7E]]


DEQ_CASES = [
    (0x7E, 2.0, 896.0), (0xFE, 1.0, -448.0), (0x01, 1.0, U), (0x81, 1.0, -U),
    (0x3C, 3.0, 4.5), (0x39, 0.5, 0.5625), (0x07, 4.0, 7 * U * 4), (0x00, 5.0, 0.0),
    (0x80, 5.0, -0.0), (0x58, 0.25, 4.0),
]


def test_dequantize_table():
    data = torch.tensor([c[0] for c in DEQ_CASES], dtype=torch.uint8)
    for i, (_, scale, expected) in enumerate(DEQ_CASES):
        out = dequantize_fp8(data[i:i + 1], scale)
        assert out.dtype == torch.float32
        assert out.item() == expected
        assert math.copysign(1, out.item()) == math.copysign(1, expected)
    assert dequantize_fp8(data, 1.0, torch.bfloat16).dtype == torch.bfloat16


def test_element_format_wrapper():
    data, scales = FP8_E4M3.quantize(torch.tensor([[3.0, -4.5]]), 3.0)
    assert scales is None and data.tolist() == [[0x38, 0xBC]]
    assert FP8_E4M3.dequantize(data, None, 3.0).tolist() == [[3.0, -4.5]]
    assert FP8_E4M3.bytes_per_row(128) == 128 and FP8_E4M3.uses_global_scale


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rejected(bad):
    x = torch.ones(3, 4)
    x[2, 1] = bad
    with pytest.raises(NonFiniteInputError):
        quantize_fp8(x, 1.0)


@pytest.mark.parametrize("scale", [0.0, -2.0, float("nan"), float("inf"), torch.ones(2)])
def test_bad_scale_rejected(scale):
    with pytest.raises(KernelInputError):
        quantize_fp8(torch.ones(4), scale)
    with pytest.raises(KernelInputError):
        dequantize_fp8(torch.zeros(4, dtype=torch.uint8), scale)


def test_bad_dtypes_rejected():
    with pytest.raises(KernelInputError):
        quantize_fp8(torch.ones(4, dtype=torch.int64), 1.0)
    with pytest.raises(KernelInputError):
        dequantize_fp8(torch.zeros(4, dtype=torch.int8), 1.0)


@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0, 1 / 448, 7.25e-3, 1e3])
def test_every_byte_is_a_fixed_point(scale):
    data = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    assert torch.equal(quantize_fp8(dequantize_fp8(data, scale), scale), data)


def _e4m3_value(byte: int) -> float:
    e, m = byte >> 3, byte & 7
    return m * U if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


E4M3_POS = [_e4m3_value(b) for b in range(127)]


def _reference_byte(x: float, scale: float) -> int:
    """Independent E4M3 encoder: nearest value, ties to even byte, saturating at 448."""
    y = float(np.float32(x) / np.float32(scale))
    a = abs(y)
    if a >= 448:
        byte = 0x7E
    else:
        i = bisect.bisect_right(E4M3_POS, a) - 1
        mid = (E4M3_POS[i] + E4M3_POS[i + 1]) / 2
        byte = i if a < mid or (a == mid and i % 2 == 0) else i + 1
    return byte | (0x80 if math.copysign(1, y) < 0 else 0)


values = st.builds(lambda m, e: m * 2.0 ** e, st.floats(-2, 2, width=32), st.integers(-14, 10))
scales = st.one_of(st.sampled_from([1.0, 0.5, 3.0]), st.floats(2.0 ** -8, 2.0 ** 8, width=32))


@settings(max_examples=200, deadline=None)
@given(st.lists(values, min_size=1, max_size=32), scales)
def test_matches_reference_and_error_bound(xs, scale):
    x = torch.tensor(xs, dtype=torch.float32)
    data = quantize_fp8(x, scale)
    y = dequantize_fp8(data, scale).tolist()
    s = float(np.float32(scale))
    for xv, byte, yv in zip(x.tolist(), data.tolist(), y):
        assert byte == _reference_byte(xv, s), (xv, s)
        a = abs(xv) / s
        if a > 448:
            assert abs(yv) == float(np.float32(448) * np.float32(s))
            continue
        # half an ulp: 2**(e - 4) for normals (|err| <= |x| / 16), 2**-10 * s for subnormals
        bound = a / 16 if a >= 2.0 ** -6 else 2.0 ** -10
        assert abs(xv - yv) <= bound * s * (1 + 1e-5) + 1e-7 * abs(xv)
