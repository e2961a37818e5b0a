"""NVFP4 quantize-and-store in CUDA C++ for Hopper (sm_90a), bit-identical to the reference.

The kernel (``csrc/store.cu``) lives in the same extension as the decode kernel and is
built with it on first use. It writes exactly the bytes of
:func:`nibble.kernels.paged_ref.store_kv_ref` (and of the portable Triton
:func:`nibble.kernels.triton.store_kv`) for NVFP4 pages, from bf16 or FP8 E4M3 K/V.
One launch, no host sync: CUDA-graph safe.

Variants (:data:`STORE_VARIANTS`, argument ``variant``, default :data:`DEFAULT_STORE_VARIANT`):

* 0: one thread per 16-value block, fp32 rounding (three candidates at 2^22) per value.
* 1: FP8 E4M3 input only (bf16 input runs variant 0): 4 (or 2, 1) blocks of K and of V per
  thread; each CTA first tabulates, per amax byte, the scale byte and the byte thresholds where
  the reference's E2M1 code steps up, then rounds four values per 32-bit add
  (``csrc/store8.cuh``; about 7 SASS instructions per value against 22).
"""

from __future__ import annotations

import torch

from ..errors import KernelInputError
from ..layout import LayerPages, PageLayout
from ..triton._common import check_int_vector, check_pages, scale_tensor
from .decode import _module

IN_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
STORE_VARIANTS = (0, 1)
DEFAULT_STORE_VARIANT = 1     # 78.9% of copy bandwidth from FP8 input against 43.6% (H200)


def unsupported_reason(layout: PageLayout, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why :func:`store_kv_nvfp4_cuda` cannot take these inputs, or None (no CUDA call)."""
    fmt = layout.fmt
    if fmt.k.name != "nvfp4" or fmt.v.name != "nvfp4":
        return f"the CUDA store writes NVFP4 pages, not {layout.kv_format!r}"
    shape = (layout.num_kv_heads, layout.head_dim)
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or tuple(x.shape[1:]) != shape or x.shape[0] != k.shape[0]:
            return f"{name} must be [T, {shape[0]}, {shape[1]}], got {tuple(x.shape)}"
        if x.dtype != k.dtype or x.dtype not in IN_DTYPES:
            return f"k and v must both be bf16 or float8_e4m3fn, got {k.dtype} and {v.dtype}"
        es = x.element_size()
        if (x.stride(2) != 1 or x.data_ptr() % 16 or (x.stride(0) * es) % 16
                or (x.stride(1) * es) % 16):
            return f"{name} rows must be contiguous and 16-byte aligned, strides {x.stride()}"
    if k.device.type != "cuda" or v.device != k.device:
        return f"k and v must be on one CUDA device, got {k.device} and {v.device}"
    return None


def store_kv_nvfp4_cuda(layout: PageLayout, pages: LayerPages, k: torch.Tensor, v: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: float | torch.Tensor = 1.0,
                        v_scale: float | torch.Tensor = 1.0,
                        variant: int = DEFAULT_STORE_VARIANT) -> None:
    """Quantize ``k``/``v`` to NVFP4 and write each token to its slot.

    Args:
        layout: an NVFP4 :class:`PageLayout`; ``pages`` = ``layout.layer_view(pool, layer)``
            on the same CUDA device (compute capability 9.0).
        k, v: ``[T, H, D]`` bf16 or float8_e4m3fn (both the same), unit inner stride,
            rows 16-byte aligned.
        slot_mapping: int32/int64 ``[T]``, ``page_id * page_size + offset``; negative:
            skip the token. Not range-checked (that would need a host sync).
        k_scale, v_scale: global scales (float, or a one-element fp32 device tensor).
        variant: one of :data:`STORE_VARIANTS` (same bytes; see the module docstring).

    Raises:
        KernelInputError: inputs the kernel does not take (see :func:`unsupported_reason`),
            or a device that is not compute capability 9.0.
    """
    if variant not in STORE_VARIANTS:
        raise KernelInputError(f"store variant must be one of {STORE_VARIANTS}, got {variant!r}")
    reason = unsupported_reason(layout, k, v)
    if reason is not None:
        raise KernelInputError(reason)
    device = k.device
    check_pages(layout, pages, device)
    check_int_vector(slot_mapping, "slot_mapping", k.shape[0], device)
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise KernelInputError("the CUDA store kernel is built for sm_90a (Hopper)")
    if k.shape[0] == 0:
        return
    kgs = scale_tensor(k_scale, device, "k_scale")
    vgs = scale_tensor(v_scale, device, "v_scale")
    _module().store(k, v, slot_mapping, pages.k_data, pages.v_data, pages.k_scale,
                    pages.v_scale, kgs, vgs, layout.page_size, variant)
