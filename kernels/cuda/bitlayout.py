"""NVFP4 code bytes in "layout v2" bit order (issue 17), for the CUDA decode variants 10434 / 10444.

Layout v1 (``kernels/layout.py``, ``kernels/nvfp4.py``): a code row holds the E2M1 codes of
dims 0, 1, 2, ... two per byte, the even dim in the low nibble; a code is sign (bit 3) and
magnitude (bits 0-2). Layout v2 keeps every byte of a row inside the same 4-byte word (K) or
word pair (V) and the same page, head and section; only the order inside changes:

* **Byte format.** A v1 byte ``(X = low nibble, Y = high nibble)`` becomes
  ``mX << 1 | sX << 7 | mY << 4 | sY`` (m: magnitude, s: sign): X at bits 1-3 and 7, where an
  fp16 high byte wants it, Y at bits 4-6 and 0. Applied to every code byte, K and V.
* **K** (``[..., D/2]`` rows): in each aligned 4-byte word, bytes 1 and 2 swap:
  v1 ``(b0, b1, b2, b3)`` -> v2 ``(f(b0), f(b2), f(b1), f(b3))``, ``f`` the byte format.
* **V** (``[..., S, D/2]``, rows = token slots of a page): slots ``2i`` (A) and ``2i + 1`` (B)
  exchange 16-bit halves of each aligned 4-byte word ``q``: v2 row ``2i`` word ``q`` =
  ``(f(A[4q]), f(A[4q+1]), f(B[4q]), f(B[4q+1]))``, v2 row ``2i+1`` word ``q`` =
  ``(f(A[4q+2]), f(A[4q+3]), f(B[4q+2]), f(B[4q+3]))``. That is v1's token-pair word
  ``{A.b, B.b, A.b', B.b'}`` (``__byte_perm`` 0x5140 / 0x7362 in ``csrc/tile.cuh``) with K's
  byte swap, stored where the kernel loads it. A store of one token writes 2-byte pieces of
  both rows of its pair (no read-modify-write).

The kernel's expansion of a v2 word (``csrc/tile.cuh``, ``dq8<3>``) gives the same fp16x2
registers as DQ 2 on the v1 word: ``r0 = (w << 8) & M``, ``r1 = w & M`` (``M = 0x8E008E00``;
the X codes), ``h = sel((w & 0x01010101) << 7, w >> 3, 0x0E0E0E0E)`` (the Y codes as byte
images), ``r2, r3 = prmt(h, 0, 0x2404 / 0x3414)``: 4 LOP3 + 3 shifts + 2 PRMT per 8 codes
against 3 + 3 + 4 (and V's pairing PRMT, one per 8 codes, is gone).
:func:`expand_v2` emulates it bit for bit. The page layout version stays 1 until the store,
gathers and tiers write v2; until then the v2 variants are benchmark-only (pages converted with
:func:`to_v2` / :func:`convert_pages_`).
"""

from __future__ import annotations

import torch

from ..errors import KernelInputError

KINDS = ("k", "v")
M_X = 0x8E008E00          # fp16x2 sign + magnitude bits of both halves
_V1_BYTE = torch.arange(256, dtype=torch.int64)
# v1 byte -> v2 byte (the byte format) and back, as uint8 lookup tables
_TO_V2 = (((_V1_BYTE & 7) << 1) | ((_V1_BYTE & 8) << 4) | (_V1_BYTE & 0x70)
          | (_V1_BYTE >> 7)).to(torch.uint8)
_FROM_V2 = torch.empty(256, dtype=torch.uint8)
_FROM_V2[_TO_V2.long()] = torch.arange(256, dtype=torch.uint8)


def _check(codes: torch.Tensor, kind: str) -> None:
    if kind not in KINDS:
        raise KernelInputError(f"kind must be 'k' or 'v', got {kind!r}")
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = getattr(codes, "dtype", type(codes).__name__)
        raise KernelInputError(f"codes must be a uint8 tensor, got {got}")
    need = 1 if kind == "k" else 2
    if codes.dim() < need or codes.shape[-1] % 4:
        raise KernelInputError(f"{kind} codes must be [..., n] with n % 4 == 0"
                               f"{' and [..., S, n] rows' if kind == 'v' else ''}, got "
                               f"{tuple(codes.shape)}")
    if kind == "v" and codes.shape[-2] % 2:
        raise KernelInputError(f"V codes pair token slots 2i, 2i+1: S must be even, got "
                               f"{tuple(codes.shape)}")


def _reorder(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """The byte moves of v1 <-> v2 (each is its own inverse); returns a contiguous tensor."""
    n = codes.shape[-1]
    if kind == "k":
        return codes.unflatten(-1, (n // 4, 4))[..., [0, 2, 1, 3]].flatten(-2)
    s = codes.shape[-2]
    x = codes.unflatten(-1, (n // 4, 2, 2)).unflatten(-4, (s // 2, 2))
    # [..., S/2, row r, word q, half e, byte] -> row e, half r
    return x.transpose(-4, -2).contiguous().flatten(-5, -4).flatten(-3)


def to_v2(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """v1 code bytes -> v2 (see the module docstring); a new contiguous tensor.

    Args:
        codes: uint8 ``[..., n]`` (K: any rows, n % 4 == 0) or ``[..., S, n]`` (V: S even, the
            token slots of a page, n % 4 == 0), e.g. ``LayerPages.k_data`` / ``v_data``
            ``[P, H, S, D/2]`` (strided views are fine). Any device.
        kind: ``"k"`` or ``"v"``.
    Returns:
        uint8 tensor of the same shape and device.
    Raises:
        KernelInputError: wrong dtype, shape or kind.
    """
    _check(codes, kind)
    return _TO_V2.to(codes.device)[_reorder(codes, kind).long()]


def from_v2(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """v2 code bytes -> v1: the inverse of :func:`to_v2` (same arguments and result)."""
    _check(codes, kind)
    return _reorder(_FROM_V2.to(codes.device)[codes.long()], kind)


def convert_pages_(pages, to: int):
    """Convert one layer's K and V code sections in place to layout ``to`` (2: v1 -> v2, 1: back).

    ``pages``: anything with uint8 ``k_data`` / ``v_data`` ``[P, H, S, D/2]`` views (e.g.
    ``LayerPages``); scale sections are not touched. Returns ``pages``.
    """
    if to not in (1, 2):
        raise KernelInputError(f"to must be 1 or 2, got {to!r}")
    fn = to_v2 if to == 2 else from_v2
    pages.k_data.copy_(fn(pages.k_data, "k"))
    pages.v_data.copy_(fn(pages.v_data, "v"))
    return pages


def words_of(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 4n]`` -> int64 ``[..., n]``: little-endian 32-bit words (as a lane loads)."""
    if codes.dtype != torch.uint8 or codes.dim() < 1 or codes.shape[-1] % 4:
        raise KernelInputError(f"codes must be uint8 [..., 4n], got {codes.dtype} "
                               f"{tuple(codes.shape)}")
    b = codes.unflatten(-1, (-1, 4)).to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _prmt0(x: torch.Tensor, sel: int) -> torch.Tensor:
    """``__byte_perm(x, 0, sel)`` for selectors without sign replication (nibbles 0-7)."""
    out = torch.zeros_like(x)
    for i in range(4):
        src = (sel >> (4 * i)) & 7
        if src < 4:
            out |= ((x >> (8 * src)) & 0xFF) << (8 * i)
    return out


def expand_v2_regs(words: torch.Tensor) -> torch.Tensor:
    """The kernel's ``dq8<3>``: v2 words -> int64 ``[..., 4]`` fp16x2 registers r0..r3.

    Args:
        words: int32 / int64 ``[...]`` 32-bit words (int32 as two's complement).
    Returns:
        int64 ``[..., 4]`` (each < 2^32): for the word of v1 nibbles c0..c7, r0 = {c0, c2},
        r1 = {c4, c6}, r2 = {c1, c3}, r3 = {c5, c7} (low half first), each half the fp16 bits
        of value * 2^-14 (the operand before the block scale), as DQ 0 / 2 give on v1.
    """
    if words.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"words must be int32 or int64, got {words.dtype}")
    w = words.to(torch.int64) & 0xFFFFFFFF
    h = (((w & 0x01010101) << 7) & ~0x0E0E0E0E) | ((w >> 3) & 0x0E0E0E0E)   # lop3_sel
    r = ((w << 8) & M_X, w & M_X, _prmt0(h, 0x2404), _prmt0(h, 0x3414))
    return torch.stack(r, dim=-1)


def expand_v2(words: torch.Tensor) -> torch.Tensor:
    """v2 words -> float16 ``[..., 8]``: E2M1 value * 2^-14 of v1 nibbles c0..c7, in that order.

    ``words`` as in :func:`expand_v2_regs`. For a V word the nibbles are those of the kernel's
    token-pair word ``{A.b, B.b, A.b', B.b'}`` (c0, c1 token A, c2, c3 token B, ...).
    """
    r = expand_v2_regs(words)
    halves = torch.stack((r & 0xFFFF, r >> 16), dim=-1)                # [..., reg, half]
    order = [(0, 0), (2, 0), (0, 1), (2, 1), (1, 0), (3, 0), (1, 1), (3, 1)]
    bits = torch.stack([halves[..., i, j] for i, j in order], dim=-1)
    return ((bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16)
