"""CPU emulation of store variant 1 (``csrc/store8.cuh``) against the reference quantizer.

The CUDA kernel rounds FP8 E4M3 input to E2M1 codes without floating point per value: a
per-CTA table maps a block's amax byte to its scale byte and seven threshold bytes, and
32-bit adds, XORs, shifts and byte permutes do the rest. This module re-does each device
function step for step in torch (fp32 arithmetic is IEEE round-to-nearest on the CPU, as
``__fdiv_rn`` / ``__fmul_rn``; ``cvt.rn.satfinite.e4m3x2.f32`` is clamp-and-cast, as the
reference's ``e4m3_round``) and checks that:

* every table entry (every amax byte, many global scales) puts each threshold exactly where
  the reference's code of ``fl(value * inv)`` steps up;
* whole blocks (every E4M3 value, and random blocks) give the reference's code and scale bytes.

Nothing here needs a GPU; the GPU tests in ``test_cuda_store.py`` run the kernel itself.
"""

from __future__ import annotations

import pytest
import torch

from nibble.kernels.nvfp4 import block_reciprocal, e2m1_encode, quantize_nvfp4

M32 = 0xFFFFFFFF
POINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)          # e2m1_point(j); '>=' for odd j
GLOBAL_SCALES = (1.0, 0.37, 2.0, 1e-3, 3e3, 2.0 ** -20, 2.0 ** -125, 1 / 448, 1 / 6,
                 0.1, 7.0, 1e30, 1.5e-38, 0.999999, 1.0000001, 2.0 ** 100)


def e4m3_value(byte: torch.Tensor) -> torch.Tensor:
    """e4m3_value: float32 of E4M3 bytes (any integer tensor, values 0..255)."""
    return byte.to(torch.uint8).view(torch.float8_e4m3fn).float()


def e4m3_satfinite(x: torch.Tensor) -> torch.Tensor:
    """e4m3_satfinite: the byte of cvt.rn.satfinite.e4m3x2.f32 (int64)."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).long()


def build_table(gs: float) -> torch.Tensor:
    """build_entry for m = 0..127: int64 [128, 8] (scale byte, then 127 - th_j in 4 bytes)."""
    g = torch.tensor(gs, dtype=torch.float32)
    m = torch.arange(128)
    t = (e4m3_value(m) / torch.tensor(6.0)) / g
    sbyte = e4m3_satfinite(t)
    denom = e4m3_value(sbyte) * g
    ok = denom > 0
    safe = torch.where(ok, denom, torch.ones_like(denom))
    inv = torch.where(ok, (torch.ones_like(safe) / safe).clamp(max=torch.finfo(torch.float32).max),
                      torch.zeros_like(safe))
    words = [sbyte]
    for j, point in enumerate(POINTS):                    # threshold_byte
        p = torch.tensor(point, dtype=torch.float32)
        c = e4m3_satfinite(p * denom)
        q = e4m3_value(c) * inv
        passed = q >= p if j & 1 else q > p
        th = torch.where(ok, torch.where(passed, c - 1, c), torch.full_like(c, 127))
        words.append((127 - th) * 0x01010101)
    return torch.stack(words, dim=1)


def vimax3_u16x2(a, b, c):
    lo = torch.maximum(torch.maximum(a & 0xFFFF, b & 0xFFFF), c & 0xFFFF)
    hi = torch.maximum(torch.maximum(a >> 16, b >> 16), c >> 16)
    return (hi << 16) | lo


def byte_perm(x, y, sel: int):
    """__byte_perm(x, y, sel) without the sign-replicate mode (bytes 0..3 of x, 4..7 of y)."""
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * n)) & 7] << (8 * n) for n in range(4))


def bitsel(x, y, mask: int):
    return (x & mask) | (y & (~mask & M32))


def max_byte(a: list) -> torch.Tensor:
    e = [(x << 8) & M32 for x in a]
    m = vimax3_u16x2(vimax3_u16x2(a[0], a[1], a[2]), vimax3_u16x2(a[3], e[0], e[1]),
                     vimax3_u16x2(e[2], e[3], e[3]))
    return torch.maximum((m << 16) & M32, m) >> 24


def code_nibbles(w, a, c: list):
    s = [(a + cj) & M32 for cj in c]
    b1 = s[1] ^ s[3] ^ s[5]
    b0 = s[0] ^ s[2] ^ s[4] ^ s[6] ^ b1
    top = bitsel(w, s[3] >> 1, 0x80808080)
    low = bitsel(b1 >> 2, b0 >> 3, 0x20202020)
    return bitsel(top, low, 0xC0C0C0C0)


def pack_pairs(h0, h1):
    return bitsel(byte_perm(h0, h1, 0x6420) >> 4, byte_perm(h0, h1, 0x7531), 0x0F0F0F0F)


def quantize8(blocks: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize8 on uint8 [N, 16] E4M3 bytes -> (codes uint8 [N, 8], scale bytes uint8 [N])."""
    b = blocks.long()
    w = [b[:, 4 * i] | b[:, 4 * i + 1] << 8 | b[:, 4 * i + 2] << 16 | b[:, 4 * i + 3] << 24
         for i in range(4)]
    a = [x & 0x7F7F7F7F for x in w]
    entry = table[max_byte(a)]
    c = [entry[:, j + 1] for j in range(7)]
    h = [code_nibbles(w[i], a[i], c) for i in range(4)]
    out = [pack_pairs(h[0], h[1]), pack_pairs(h[2], h[3])]
    codes = torch.stack([(o >> (8 * k)) & 0xFF for o in out for k in range(4)], dim=1)
    return codes.to(torch.uint8), entry[:, 0].to(torch.uint8)


def _reference(blocks: torch.Tensor, gs: float) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = quantize_nvfp4(blocks.view(torch.float8_e4m3fn), gs)
    return codes, scales[:, 0]


def _finite_bytes() -> torch.Tensor:
    b = torch.arange(256, dtype=torch.uint8)
    return b[torch.isfinite(b.view(torch.float8_e4m3fn).float())]


@pytest.mark.parametrize("gs", GLOBAL_SCALES)
def test_table_thresholds_match_reference_steps(gs):
    """Bit 7 of (m + 127 - th_j) is set exactly where the reference's code reaches j + 1."""
    table = build_table(gs)
    g = torch.tensor(gs, dtype=torch.float32)
    mags = torch.arange(127)                                  # every finite magnitude byte
    for amax in range(127):
        scale = e4m3_satfinite((e4m3_value(torch.tensor(amax)) / torch.tensor(6.0)) / g)
        assert int(table[amax, 0]) == int(scale)
        inv = block_reciprocal(scale.to(torch.uint8).view(torch.float8_e4m3fn), g)
        code = e2m1_encode(e4m3_value(mags) * inv).long()
        for j in range(7):
            passes = ((mags + (table[amax, j + 1] & 0xFF)) >> 7) & 1
            assert torch.equal(passes, (code >= j + 1).long()), (gs, amax, j)


@pytest.mark.parametrize("gs", GLOBAL_SCALES)
def test_every_e4m3_value_in_blocks_led_by_every_amax(gs):
    """Each finite E4M3 byte, in blocks whose amax byte is each of 0..126."""
    values = _finite_bytes()
    rows = []
    for lead in range(127):
        small = values[(values.long() & 0x7F) <= lead]
        pad = -small.numel() % 15
        small = torch.cat([small, torch.zeros(pad, dtype=torch.uint8)]).view(-1, 15)
        rows.append(torch.cat([torch.full((small.shape[0], 1), lead, dtype=torch.uint8), small], 1))
    blocks = torch.cat(rows)
    blocks = torch.cat([blocks, blocks.roll(5, dims=1), blocks.flip(1)])   # amax at any lane
    codes, scales = quantize8(blocks, build_table(gs))
    ref_codes, ref_scales = _reference(blocks, gs)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes, ref_codes)


@pytest.mark.parametrize("gs", GLOBAL_SCALES[:6])
def test_random_blocks(gs):
    gen = torch.Generator().manual_seed(17)
    blocks = torch.randint(0, 256, (20000, 16), dtype=torch.uint8, generator=gen)
    blocks[(blocks & 0x7F) == 0x7F] ^= 1                       # no NaN (the reference rejects it)
    blocks[:100] = 0x80                                      # -0.0 blocks: code 8, scale 0
    blocks[100:200] &= 0x87                                  # subnormal-only blocks
    codes, scales = quantize8(blocks, build_table(gs))
    ref_codes, ref_scales = _reference(blocks, gs)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes, ref_codes)
