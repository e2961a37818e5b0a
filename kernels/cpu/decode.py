"""A whole NVFP4 decode layer on the CPU in one C call, and its torch reference.

:func:`decode_nvfp4_cpu` does what the torch decode path does with dozens of small ops
per layer: RoPE (optional, from the QKV projection's output), the K recipe
(``k' = k @ k_map + k_bias`` or ``k - k_shift``, ``q' = q @ q_map``, ``v - v_shift``), the
NVFP4 quantize-and-store of the step's new K/V rows, GQA attention of each sequence's query
over its pages (dequantized row by row, never into a workspace) and the recipe's V shift
added back. :func:`decode_nvfp4_ref` computes the same from the torch references
(``store_kv_ref``, ``gather_rows_ref``, ``attention_ref``); ``tests/kernels/test_cpu_decode.py``
checks one against the other: the stored bytes are equal (the recipe's matmuls may move a
value across a code boundary in rare elements, so with a recipe they are compared as
dequantized values), the outputs equal within fp32 rounding.

Shapes: ``B`` sequences (one new token each), ``Hq`` query heads, ``H`` KV heads,
``D`` head_dim, ``S`` page_size, ``M`` pages per sequence.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ..errors import KernelInputError, NonFiniteInputError
from ..formats import NVFP4
from ..layout import PageLayout
from ..paged_ref import attention_ref, gather_rows_ref, store_kv_ref
from .build import load

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _P, _I64, _P, _I64, _P, _P,          # q, k, v (+ row strides), cos, sin
             _P, _P, _P, _P, _P,                            # k_map, k_bias, k_shift, q_map, v_shift
             _P, _I64, _P,                                  # pool, page stride, section offsets
             _I, _I, _I, _I, _I,                            # B, H, G, D, S
             _P, _P, _I, _P, _P,                            # slots, page_ids, M, lo, hi
             _F, _F, _F, _P, _I, _I]                        # k_scale, v_scale, sm_scale, out,
#                                                             in and out dtypes (0 fp32, 1 bf16)
IO_DTYPES = {torch.float32: 0, torch.bfloat16: 1}      # layer_qkv's rows and output
RECIPE_KEYS = ("k_map", "k_bias", "k_shift", "q_map", "v_shift")


def _library():
    lib = load("nvfp4_decode")
    if lib is not None and lib.nb_decode_nvfp4.argtypes is None:
        lib.nb_decode_nvfp4.argtypes = _ARGTYPES
        lib.nb_decode_nvfp4.restype = ctypes.c_int
    return lib


def available() -> bool:
    """The C library is built (or can be) on this machine."""
    return _library() is not None


def supports_layout(layout: PageLayout) -> bool:
    """Plain NVFP4 K and V (the recipes store those too), head_dim a multiple of 16."""
    return layout.fmt.k is NVFP4 and layout.fmt.v is NVFP4 and layout.head_dim % 16 == 0


def section_offsets(layout: PageLayout, layer: int) -> torch.Tensor:
    """int64 ``[4]``: byte offsets inside a page of ``layer``'s K data, V data, K scales,
    V scales (see ``kernels/layout.py``)."""
    at, offs = layer * layout.layer_nbytes, {}
    for name, size, _ in layout.sections():
        offs[name] = at
        at += size
    return torch.tensor([offs["k_data"], offs["v_data"], offs["k_scale"], offs["v_scale"]],
                        dtype=torch.int64)


@functools.lru_cache(maxsize=16)
def _all_sections(layout: PageLayout) -> list[torch.Tensor]:
    return [section_offsets(layout, i) for i in range(layout.num_layers)]


def _rows(x: torch.Tensor, shape: tuple[int, int, int], name: str) -> int:
    """Checks ``x`` fp32 CPU ``shape`` with contiguous rows; its row stride."""
    if x.dtype != torch.float32 or x.shape != shape or x.stride()[1:] != (shape[2], 1) or \
            x.device.type != "cpu":
        raise KernelInputError(f"{name} must be float32 CPU {list(shape)} with contiguous "
                               f"rows, got {x.dtype} {x.device} {tuple(x.shape)} {x.stride()}")
    return x.stride(0)


def _ptr(t: torch.Tensor | None, shape: tuple[int, ...], name: str) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" or \
            t.shape != shape:
        raise KernelInputError(f"{name} must be contiguous float32 CPU {shape}, got {t.dtype} "
                               f"{tuple(t.shape)}")
    return t.data_ptr()


def _ints(t: torch.Tensor, shape: tuple[int, ...], name: str) -> int:
    if t.dtype != torch.int64 or not t.is_contiguous() or t.shape != shape or t.device.type != "cpu":
        raise KernelInputError(f"{name} must be contiguous int64 CPU {shape}, got {t.dtype} "
                               f"{tuple(t.shape)}")
    return t.data_ptr()


class DecodeStep:
    """One decode step's arguments of :func:`decode_nvfp4_cpu` that every layer shares,
    checked once (``slots``, ``page_ids``, ``hi`` and each window's ``lo``; see there), so
    that :meth:`layer` costs a few microseconds of Python. Keeps the tensors alive."""

    def __init__(self, layout: PageLayout, pool: torch.Tensor, slots: torch.Tensor,
                 page_ids: torch.Tensor, hi: torch.Tensor, sm_scale: float):
        self.lib = _library()
        if self.lib is None:
            raise KernelInputError("the CPU decode kernel is not available (no C compiler?)")
        if not supports_layout(layout):
            raise KernelInputError(f"decode_nvfp4_cpu needs plain NVFP4 K and V, got "
                                   f"{layout.fmt.name}")
        layout.check_pool(pool)
        if not pool.is_contiguous() or pool.device.type != "cpu":
            raise KernelInputError("pool must be a contiguous CPU tensor")
        b = slots.shape[0] if slots.dim() == 1 else -1
        m = page_ids.shape[1] if page_ids.dim() == 2 else -1
        self._keep = (pool, slots, page_ids, hi)
        self.layout, self.b, self.m, self.sm_scale = layout, b, m, sm_scale
        self.h, self.d, self.s = layout.num_kv_heads, layout.head_dim, layout.page_size
        self.ptrs = (pool.data_ptr(), pool.stride(0), _ints(slots, (b,), "slots"),
                     _ints(page_ids, (b, m), "page_ids"), _ints(hi, (b,), "hi"))
        self._sections = _all_sections(layout)          # kept alive: the pointers below
        self._section_ptrs = [t.data_ptr() for t in self._sections]
        self._lo: dict = {}
        self._rope: tuple | None = None     # (cos, sin, their checked pointers)

    def recipe(self, recipe: dict | None) -> tuple:
        """A layer's recipe tensors (see :func:`decode_nvfp4_cpu`) as checked pointers; keep
        the tensors alive while the result is used."""
        rec, h, d = recipe or {}, self.h, self.d
        return tuple(_ptr(rec.get(n), shp, n) for n, shp in
                     zip(RECIPE_KEYS, ((h, d, d), (h, d), (h, d), (h, d, d), (h, d))))

    def layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              lo: torch.Tensor, k_scale: float, v_scale: float, recipe: tuple = (None,) * 5,
              rope: tuple | None = None) -> torch.Tensor:
        """Layer ``layer``'s step; ``recipe`` from :meth:`recipe`, ``lo`` int64 ``[B]``."""
        b, d, h = self.b, self.d, self.h
        hq = q.shape[1] if q.dim() == 3 else -1
        if hq <= 0 or hq % h:
            raise KernelInputError(f"q must be [{b}, Hq, {d}] with Hq % {h} == 0, got "
                                   f"{tuple(q.shape)}")
        sq, sk, sv = _rows(q, (b, hq, d), "q"), _rows(k, (b, h, d), "k"), _rows(v, (b, h, d), "v")
        return self._run(layer, (q.data_ptr(), sq, k.data_ptr(), sk, v.data_ptr(), sv), hq, lo,
                         k_scale, v_scale, recipe, rope)

    def layer_qkv(self, layer: int, qkv: torch.Tensor, hq: int, lo: torch.Tensor,
                  k_scale: float, v_scale: float, recipe: tuple = (None,) * 5,
                  rope: tuple | None = None, out_dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
        """:meth:`layer` straight from a QKV projection's output: ``qkv`` float32 or bf16
        ``[B, (Hq + 2H) * D]`` (q heads, k heads, v heads) with unit inner stride, widened
        row by row inside the call; the output ``[B, Hq, D]`` in ``out_dtype`` (float32 or
        bf16, rounded once). One tensor checked instead of three views: the per-layer Python
        of a decode step is most of its cost at a small model's few rows."""
        b, d, h = self.b, self.d, self.h
        w = (hq + 2 * h) * d
        if not (hq > 0 and hq % h == 0 and qkv.dtype in IO_DTYPES and qkv.is_cpu
                and qkv.dim() == 2 and qkv.shape == (b, w) and qkv.stride(1) == 1
                and out_dtype in IO_DTYPES):
            raise KernelInputError(f"qkv must be float32 or bfloat16 CPU [{b}, {w}] with unit "
                                   f"inner stride (Hq = {hq}, a multiple of {h}) and out_dtype "
                                   f"float32 or bfloat16, got {qkv.dtype} {tuple(qkv.shape)} "
                                   f"{qkv.stride()} on {qkv.device}, out_dtype {out_dtype}")
        p, rs, es = qkv.data_ptr(), qkv.stride(0), qkv.element_size()
        return self._run(layer, (p, rs, p + es * hq * d, rs, p + es * (hq + h) * d, rs), hq, lo,
                         k_scale, v_scale, recipe, rope, IO_DTYPES[qkv.dtype],
                         IO_DTYPES[out_dtype])

    def _rope_ptrs(self, rope: tuple | None) -> tuple:
        """cos/sin pointers, checked once per pair of tensors (a step shares one pair)."""
        if rope is None:
            return (None, None)
        if self._rope is None or self._rope[0] is not rope[0] or self._rope[1] is not rope[1]:
            d, b = self.d, self.b
            ptrs = tuple(_ptr(t, (b, 1, d) if t.dim() == 3 else (b, d), "cos/sin")
                         for t in rope)
            self._rope = (rope[0], rope[1], ptrs)
        return self._rope[2]

    def _run(self, layer: int, qkv_ptrs: tuple, hq: int, lo: torch.Tensor, k_scale: float,
             v_scale: float, recipe: tuple, rope: tuple | None, in_dtype: int = 0,
             out_dtype: int = 0) -> torch.Tensor:
        b, d, h = self.b, self.d, self.h
        lp = self._lo.get(id(lo))
        if lp is None or lp[0] is not lo:
            lp = self._lo[id(lo)] = (lo, _ints(lo, (b,), "lo"))
        pool, page_stride, slots, page_ids, hi = self.ptrs
        out = torch.empty((b, hq, d), dtype=torch.bfloat16 if out_dtype else torch.float32)
        rc = self.lib.nb_decode_nvfp4(
            *qkv_ptrs, *self._rope_ptrs(rope), *recipe, pool, page_stride,
            self._section_ptrs[layer], b, h, hq // h, d, self.s, slots, page_ids, self.m,
            lp[1], hi, k_scale, v_scale, self.sm_scale, out.data_ptr(), in_dtype, out_dtype)
        if rc == 1:
            raise NonFiniteInputError("NVFP4 quantize got NaN or inf input")
        if rc == 3:
            raise KernelInputError("decode_nvfp4_cpu: bad row or output dtype")
        if rc:
            raise MemoryError("decode_nvfp4_cpu: out of memory")
        return out


def decode_nvfp4_cpu(layout: PageLayout, pool: torch.Tensor, layer: int, q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     page_ids: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                     k_scale: float, v_scale: float, sm_scale: float,
                     recipe: dict | None = None, rope: tuple | None = None) -> torch.Tensor:
    """Store the step's K/V rows of ``layer`` and attend; ``[B, Hq, D]`` float32.

    Args:
        pool: the KV pool, contiguous uint8 ``[P, num_layers, layer_nbytes]`` on the CPU.
        q: ``[B, Hq, D]`` float32, k/v ``[B, H, D]`` (rows contiguous, any row stride: views
            of one QKV output work); RoPE applied unless ``rope`` is given.
        slots: int64 ``[B]``, ``page * S + offset`` of each new row (checked by the caller,
            e.g. ``paged_fast.split_slots``; the C code does not bound-check).
        page_ids: int64 ``[B, M]`` each sequence's pages in token order.
        lo, hi: int64 ``[B]``: the query of sequence ``b`` attends positions
            ``lo[b]..hi[b]`` (``hi`` = its new row's position, ``hi < M * S``).
        recipe: the layer's recipe tensors (:data:`RECIPE_KEYS`: ``k_map``/``q_map``
            ``[H, D, D]``, ``k_bias``/``k_shift``/``v_shift`` ``[H, D]``; absent/None = not
            applied), fp32 contiguous.
        rope: ``(cos, sin)`` fp32 contiguous ``[B, D]`` (or ``[B, 1, D]``) to rotate q and k
            first, as ``apply_rope`` does.
    Raises:
        NonFiniteInputError: a transformed K or V value is NaN or inf (nothing stored).

    A caller running every layer of a step builds one :class:`DecodeStep` instead.
    """
    step = DecodeStep(layout, pool, slots, page_ids, hi, sm_scale)
    return step.layer(layer, q, k, v, lo, k_scale, v_scale, step.recipe(recipe), rope)


def decode_nvfp4_ref(layout: PageLayout, pool: torch.Tensor, layer: int, q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     page_ids: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                     k_scale: float, v_scale: float, sm_scale: float,
                     recipe: dict | None = None, rope: tuple | None = None) -> torch.Tensor:
    """:func:`decode_nvfp4_cpu` from the torch references (same arguments and result)."""
    b, hq, d = q.shape
    h, s = layout.num_kv_heads, layout.page_size
    q, k, v = q.float(), k.float(), v.float()
    if rope is not None:
        cos, sin = (t.reshape(b, 1, d) for t in rope)
        rot = lambda x: x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin  # noqa: E731
        q, k = rot(q), rot(k)
    rec = {n: t for n, t in (recipe or {}).items() if t is not None}
    if "k_map" in rec:
        k = torch.baddbmm(rec["k_bias"].unsqueeze(1), k.transpose(0, 1), rec["k_map"]).transpose(0, 1)
        q = torch.einsum("bhgd,hde->bhge", q.unflatten(1, (h, -1)), rec["q_map"]).flatten(1, 2)
    elif "k_shift" in rec:
        k = k - rec["k_shift"]
    if "v_shift" in rec:
        v = v - rec["v_shift"]
    pages = layout.layer_view(pool, layer)
    store_kv_ref(layout, pages, k, v, slots, k_scale, v_scale)
    out = torch.empty((b, hq, d), dtype=torch.float32)
    for i in range(b):
        pos = torch.arange(int(lo[i]), int(hi[i]) + 1)
        kk, vv = gather_rows_ref(layout, pages, page_ids[i, pos // s], pos % s, k_scale, v_scale,
                                 torch.float32)
        out[i] = attention_ref(q[i:i + 1], kk, vv, sm_scale, None)[0]
    if "v_shift" in rec:
        out = (out.unflatten(1, (h, -1)) + rec["v_shift"][:, None]).flatten(1, 2)
    return out
