"""Which paged-decode kernel the Triton attention backend launches.

Two kernels read the same NVFP4 (or FP8 E4M3) pages with the same call convention
(``fn(layout, pages, q, block_tables, seq_lens, sm_scale, k_scale, v_scale, *,
out, num_splits)``, no host sync, grid from host-known shapes):

* ``"cuda-sm90"``: :func:`~nibble.kernels.cuda.decode_attention_cuda`, the
  register-level Hopper kernel (NVFP4 or FP8 E4M3 K and V, head_dim 128, page size 16 * 2^k,
  at most 8 query heads per KV head, compute capability 9.0 exactly);
* ``"triton"``: the portable :func:`~nibble.kernels.triton.decode_attention`.

The choice is made once, from the layout and the device, where the fast kernel
applies. ``NIBBLE_DECODE_KERNEL=triton|cuda`` forces one (for A/B runs); a
forced ``cuda`` that cannot run is a :class:`ConfigError` naming the reason.
Nothing here compiles the CUDA extension.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from nibble.kernels import PageLayout
from nibble.kernels.cuda import decode as cuda_decode
from nibble.kernels.errors import KernelInputError

from ..errors import ConfigError

ENV_VAR = "NIBBLE_DECODE_KERNEL"
STORE_ENV_VAR = "NIBBLE_STORE_KERNEL"
CUDA_SM90 = "cuda-sm90"
TRITON = "triton"
_CHOICES = ("auto", "triton", "cuda")


class DecodeChoice(NamedTuple):
    """impl: "cuda-sm90" or "triton"; why: a line for the log; forced: by the environment."""

    impl: str
    why: str
    forced: bool


def requested_impl() -> str:
    """``NIBBLE_DECODE_KERNEL`` normalized to auto|triton|cuda (unset or empty: auto)."""
    value = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ConfigError(f"{ENV_VAR} must be one of {_CHOICES}, got {value!r}")
    return value


def group_reason(num_q_heads: int, num_kv_heads: int) -> str | None:
    """Why the CUDA kernel cannot serve ``num_q_heads / num_kv_heads`` query heads per KV head."""
    group = num_q_heads // max(num_kv_heads, 1)
    if num_q_heads % max(num_kv_heads, 1) or not 1 <= group <= cuda_decode.MAX_GROUP:
        return (f"the CUDA decode kernel takes 1 to {cuda_decode.MAX_GROUP} query heads per KV "
                f"head, the model has {num_q_heads} query and {num_kv_heads} KV heads")
    return None


def cuda_unsupported_reason(layout: PageLayout, device: torch.device,
                            num_q_heads: int | None = None) -> str | None:
    """Why :func:`decode_attention_cuda` cannot serve ``layout`` on ``device``, or None.

    Uses the wrapper's own layout checks; the capability is asked last, so a
    non-CUDA device or an unfit layout never touches the CUDA runtime.
    """
    if device.type != "cuda":
        return f"the CUDA decode kernel needs a CUDA device, got {device.type!r}"
    try:
        cuda_decode._check_layout(layout)
    except KernelInputError as exc:
        return str(exc)
    if num_q_heads is not None:
        reason = group_reason(num_q_heads, layout.num_kv_heads)
        if reason is not None:
            return reason
    cap = tuple(torch.cuda.get_device_capability(device))
    if cap != (9, 0):
        return (f"the CUDA decode kernel is built for sm_90a (compute capability 9.0), the "
                f"device has {cap[0]}.{cap[1]}")
    return None


def select_decode_impl(layout: PageLayout, device: torch.device,
                       num_q_heads: int | None = None) -> DecodeChoice:
    """The decode kernel for ``layout`` on ``device`` (read ``NIBBLE_DECODE_KERNEL`` once).

    ``num_q_heads`` None leaves the GQA group to :func:`confirm_group` at the
    first decode (the backend's constructor does not see the model).

    Raises:
        ConfigError: ``NIBBLE_DECODE_KERNEL`` is not auto|triton|cuda, or it is
            ``cuda`` and the kernel does not apply (the message says why).
    """
    want = requested_impl()
    if want == "triton":
        return DecodeChoice(TRITON, f"{ENV_VAR}=triton", True)
    reason = cuda_unsupported_reason(layout, device, num_q_heads)
    if reason is None:
        why = (f"{ENV_VAR}=cuda" if want == "cuda"
               else f"{layout.fmt.k.name} KV, head_dim 128, Hopper")
        return DecodeChoice(CUDA_SM90, why, want == "cuda")
    if want == "cuda":
        raise ConfigError(f"{ENV_VAR}=cuda: {reason}")
    return DecodeChoice(TRITON, reason, False)


def confirm_group(choice: DecodeChoice, num_q_heads: int, num_kv_heads: int) -> DecodeChoice:
    """``choice``, or the Triton fallback when the CUDA kernel cannot take this GQA group.

    Raises:
        ConfigError: the CUDA kernel was forced but cannot take this group.
    """
    if choice.impl != CUDA_SM90:
        return choice
    reason = group_reason(num_q_heads, num_kv_heads)
    if reason is None:
        return choice
    if choice.forced:
        raise ConfigError(f"{ENV_VAR}=cuda: {reason}")
    return DecodeChoice(TRITON, reason, False)


def select_store_impl(layout: PageLayout, device: torch.device) -> str:
    """The NVFP4 quantize-and-store kernel: "triton" unless ``NIBBLE_STORE_KERNEL=cuda``.

    The CUDA C++ kernel (:func:`~nibble.kernels.cuda.store_kv_nvfp4_cuda`) writes the same
    bytes as the Triton one but measured slower on an H200 (docs/benchmarks.md), so it is
    opt-in: forced, it runs for NVFP4 K and V on a compute capability 9.0 device, and each
    call still falls back to Triton for inputs it does not take (fp16/fp32, unaligned rows).

    Raises:
        ConfigError: ``NIBBLE_STORE_KERNEL`` is not auto|triton|cuda, or it is ``cuda``
            where the kernel cannot run.
    """
    want = os.environ.get(STORE_ENV_VAR, "").strip().lower() or "auto"
    if want not in _CHOICES:
        raise ConfigError(f"{STORE_ENV_VAR} must be one of {_CHOICES}, got {want!r}")
    if want != "cuda":
        return TRITON
    fmt = layout.fmt
    if fmt.k.name != "nvfp4" or fmt.v.name != "nvfp4":
        raise ConfigError(f"{STORE_ENV_VAR}=cuda: the CUDA store writes NVFP4 pages, not "
                          f"{layout.kv_format!r}")
    if device.type != "cuda" or tuple(torch.cuda.get_device_capability(device)) != (9, 0):
        raise ConfigError(f"{STORE_ENV_VAR}=cuda: the CUDA store needs a compute capability "
                          f"9.0 device, got {device}")
    return CUDA_SM90
