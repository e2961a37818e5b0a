"""Device helpers and argument checks shared by the portable Triton paged-KV kernels.

Element formats are passed to kernels as constexpr codes (:data:`FORMAT_CODES`).
Every helper here runs under the CPU interpreter (``TRITON_INTERPRET=1``) as well
as on a GPU; the ``HW_FP8`` switch picks the hardware E4M3 conversions, which
exist only on GPUs of compute capability 8.9 and newer (the interpreter's FP8
cast does not round to nearest even, so CPU runs use the integer versions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError
from ..layout import LayerPages, PageLayout

FMT_BF16, FMT_FP8, FMT_NVFP4 = 0, 1, 2
FORMAT_CODES = {"bf16": FMT_BF16, "fp8_e4m3": FMT_FP8, "nvfp4": FMT_NVFP4}
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------- device helpers

@triton.jit
def e4m3_encode(x, HW: tl.constexpr):
    """fp32 -> raw E4M3 byte (uint8): RNE, saturating at +-448, sign from the IEEE bit."""
    if HW:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        a = tl.minimum(tl.abs(x), 448.0)
        bits = a.to(tl.int32, bitcast=True)
        # Normal range: round the 23-bit mantissa to 3 bits, ties to even.
        rb = bits + 0x7FFFF + ((bits >> 20) & 1)
        normal = (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7)
        # Below 2^-6: a multiple of 2^-9, rounded by fp32 addition (RNE); 8 encodes 2^-6.
        sub = ((a + 16384.0) - 16384.0) * 512.0
        code = tl.where(a < 0.015625, sub.to(tl.int32), normal)
        sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
        return (code | sign).to(tl.uint8)


@triton.jit
def bf16_rne(x, HW: tl.constexpr):
    """fp32 -> bf16, round to nearest even (the interpreter's cast truncates)."""
    if HW:
        return x.to(tl.bfloat16)
    else:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e4m3_to_f16(b, HW: tl.constexpr):
    """Raw E4M3 bytes (uint8) -> their exact values as fp16."""
    if HW:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        w = b.to(tl.uint16)
        bits = (((w & 0x80) << 8) | ((w & 0x7F) << 7)).to(tl.uint16)
        # The bit placement gives value * 2^-8 exactly (subnormals included).
        return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def e4m3_to_f16_raw(b, HW: tl.constexpr):
    """Raw E4M3 -> fp16 equal to value / ``fp8_raw_factor(HW)``, exact.

    Without ``HW`` the bit placement alone gives value * 2^-8; the caller folds
    the 256 into a later scale instead of multiplying every element.
    """
    if HW:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        w = b.to(tl.uint16)
        bits = (((w & 0x80) << 8) | ((w & 0x7F) << 7)).to(tl.uint16)
        return bits.to(tl.float16, bitcast=True)


@triton.jit
def e2m1_lo_f16(b):
    """Low nibbles of code bytes -> fp16 equal to E2M1 value * 2^-14 (exact)."""
    w = b.to(tl.uint16)
    bits = (((w & 0x8) << 12) | ((w & 0x7) << 9)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def e2m1_hi_f16(b):
    """High nibbles of code bytes -> fp16 equal to E2M1 value * 2^-14 (exact)."""
    w = b.to(tl.uint16)
    bits = (((w & 0x80) << 8) | ((w & 0x70) << 5)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def e2m1_nibble_f16(words, R: tl.constexpr):
    """Nibble ``R`` (0 = lowest) of 16-bit code words -> fp16 equal to E2M1 * 2^-14."""
    n = (words.to(tl.uint16, bitcast=True) >> (4 * R)) & 0xF
    bits = (((n & 0x8) << 12) | ((n & 0x7) << 9)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def e2m1_pair_f16_ptx(b):
    """Code bytes -> (low-nibble, high-nibble) fp16 E2M1 * 2^-14 (NVIDIA PTX only).

    Four bytes per register: 7 logic ops build each nibble's fp16 high byte, then
    4 ``prmt`` place them over zero low bytes.
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, l, h, z;
        mov.b32 z, 0;
        shl.b32 a, $4, 1;
        and.b32 a, a, 0x0E0E0E0E;
        shl.b32 l, $4, 4;
        lop3.b32 l, l, a, 0x80808080, 0xEC;
        shr.u32 h, $4, 3;
        and.b32 h, h, 0x0E0E0E0E;
        lop3.b32 h, $4, h, 0x80808080, 0xEC;
        prmt.b32 $0, l, z, 0x1404;
        prmt.b32 $1, l, z, 0x3424;
        prmt.b32 $2, h, z, 0x1404;
        prmt.b32 $3, h, z, 0x3424;
        }""",
        constraints="=r,=r,=r,=r,r", args=[b], dtype=(tl.float16, tl.float16),
        is_pure=True, pack=4)


@triton.jit
def e2m1_quad_f16_ptx(words):
    """16-bit code words -> their 4 nibbles as fp16 E2M1 * 2^-14 (NVIDIA PTX only).

    Two words per register: 7 logic ops build every nibble's fp16 high byte
    (magnitude at bits 1-3, sign at bit 7), then one ``prmt`` per output places
    two of them over zero low bytes.
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, l, h, z;
        mov.b32 z, 0;
        shl.b32 a, $4, 1;
        and.b32 a, a, 0x0E0E0E0E;
        shl.b32 l, $4, 4;
        lop3.b32 l, l, a, 0x80808080, 0xEC;
        shr.u32 h, $4, 3;
        and.b32 h, h, 0x0E0E0E0E;
        lop3.b32 h, $4, h, 0x80808080, 0xEC;
        prmt.b32 $0, l, z, 0x2404;
        prmt.b32 $1, h, z, 0x2404;
        prmt.b32 $2, l, z, 0x3414;
        prmt.b32 $3, h, z, 0x3414;
        }""",
        constraints="=r,=r,=r,=r,r", args=[words],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def e4m3_byte_f16(words, R: tl.constexpr, HW: tl.constexpr):
    """Byte ``R`` of 32-bit E4M3 words -> fp16 equal to value / ``fp8_raw_factor(HW)``."""
    return e4m3_to_f16_raw(((words >> (8 * R)) & 0xFF).to(tl.uint8), HW)


@triton.jit
def e4m3_quad_f16_ptx(words):
    """32-bit E4M3 words -> their 4 bytes as exact fp16 (NVIDIA PTX, sm_89+).

    Two words per call: one ``prmt`` pairs byte ``r`` of both, one ``cvt`` makes fp16x2.
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t;
        .reg .b16 lo, hi;
        prmt.b32 t, $4, $5, 0x0040;
        mov.b32 {lo, hi}, t;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        prmt.b32 t, $4, $5, 0x0051;
        mov.b32 {lo, hi}, t;
        cvt.rn.f16x2.e4m3x2 $1, lo;
        prmt.b32 t, $4, $5, 0x0062;
        mov.b32 {lo, hi}, t;
        cvt.rn.f16x2.e4m3x2 $2, lo;
        prmt.b32 t, $4, $5, 0x0073;
        mov.b32 {lo, hi}, t;
        cvt.rn.f16x2.e4m3x2 $3, lo;
        }""",
        constraints="=r,=r,=r,=r,r,r", args=[words],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)


# ---------------------------------------------------------------- host helpers

def hw_fp8(device: torch.device) -> bool:
    """True where Triton's E4M3 conversions are native (CUDA, sm_89+)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def element_codes(layout: PageLayout) -> tuple[int, int]:
    """Constexpr format codes of K and V for ``layout``."""
    fmt = layout.fmt
    try:
        return FORMAT_CODES[fmt.k.name], FORMAT_CODES[fmt.v.name]
    except KeyError as exc:
        raise KernelInputError(f"no Triton kernel for element format {exc.args[0]!r}") from None


def check_pages(layout: PageLayout, pages: LayerPages, device: torch.device) -> None:
    """Check that ``pages`` are views of ``layout`` on ``device`` that the kernels can index."""
    h, s, d = layout.num_kv_heads, layout.page_size, layout.head_dim
    fmt = layout.fmt
    expect = (("k_data", fmt.k.data_bytes(d)), ("v_data", fmt.v.data_bytes(d)),
              ("k_scale", fmt.k.scale_bytes(d)), ("v_scale", fmt.v.scale_bytes(d)))
    for name, row in expect:
        t = getattr(pages, name)
        if row == 0:
            if t is not None:
                raise KernelInputError(f"pages.{name} must be None for format {layout.kv_format}")
            continue
        if t is None or t.dtype != torch.uint8 or t.dim() != 4 or tuple(t.shape[1:]) != (h, s, row):
            got = None if t is None else (t.dtype, tuple(t.shape))
            raise KernelInputError(f"pages.{name} must be uint8 [P, {h}, {s}, {row}], got {got}")
        if t.stride()[1:] != (s * row, row, 1):
            raise KernelInputError(f"pages.{name} must be contiguous within a page, strides "
                                   f"{t.stride()}; use PageLayout.layer_view")
        if t.device != device:
            raise KernelInputError(f"pages.{name} is on {t.device}, expected {device}")
    if pages.k_data.shape[0] != pages.v_data.shape[0]:
        raise KernelInputError("K and V views have different page counts")


def typed_data(view: torch.Tensor, elem: int, words: bool = False) -> torch.Tensor:
    """The data view as the kernels load it: bf16 elements for BF16; bytes otherwise,
    or with ``words`` 4-element words (int16 of 4 NVFP4 codes, int32 of 4 E4M3)."""
    if elem == FMT_BF16:
        return view.view(torch.bfloat16)
    if words:
        return view.view(torch.int16 if elem == FMT_NVFP4 else torch.int32)
    return view


def scale_tensor(scale: float | torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    """A one-element fp32 device tensor holding a global scale (no host sync for tensors)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise KernelInputError(f"{name} must be one fp32 value, got {scale.dtype} "
                                   f"{tuple(scale.shape)}")
        if scale.device != device:
            raise KernelInputError(f"{name} is on {scale.device}, expected {device}")
        return scale.reshape(1)
    value = float(scale)
    if not value > 0 or value == float("inf"):
        raise KernelInputError(f"{name} must be finite and > 0, got {scale!r}")
    return torch.full((1,), value, dtype=torch.float32, device=device)


def check_int_vector(t: torch.Tensor, name: str, n: int | None, device: torch.device) -> None:
    """``t`` must be an int32/int64 vector of length ``n`` on ``device``."""
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
        raise KernelInputError(f"{name} must be a 1-D int32/int64 tensor, got {t.dtype} "
                               f"{tuple(t.shape)}")
    if n is not None and t.shape[0] != n:
        raise KernelInputError(f"{name} must have {n} entries, got {t.shape[0]}")
    if t.device != device:
        raise KernelInputError(f"{name} is on {t.device}, expected {device}")
    if t.numel() > 1 and t.stride(0) != 1:
        raise KernelInputError(f"{name} must be contiguous")


def check_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       device: torch.device) -> None:
    """``block_tables`` int32 ``[B, M]`` with unit inner stride; ``seq_lens`` ``[B]``."""
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise KernelInputError(f"block_tables must be int32 [B, M], got {block_tables.dtype} "
                               f"{tuple(block_tables.shape)}")
    if block_tables.device != device:
        raise KernelInputError(f"block_tables is on {block_tables.device}, expected {device}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise KernelInputError("block_tables rows must be contiguous")
    check_int_vector(seq_lens, "seq_lens", block_tables.shape[0], device)


def fp8_raw_factor(hw: bool) -> float:
    """What ``e4m3_to_f16_raw`` values must be multiplied by to give E4M3 values."""
    return 1.0 if hw else 256.0
