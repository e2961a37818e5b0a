"""Which paged-decode kernel the Triton attention backend launches.

Two kernels read the same NVFP4 (or FP8 E4M3) pages with the same call convention
(``fn(layout, pages, q, block_tables, seq_lens, sm_scale, k_scale, v_scale, *,
out, num_splits)``, no host sync, grid from host-known shapes):

* ``"cuda-sm90"``: :func:`~nibble.kernels.cuda.decode_attention_cuda`, the
  register-level Hopper kernel (NVFP4 or FP8 E4M3 K and V, head_dim 128, page size 16 * 2^k,
  at most 8 query heads per KV head, compute capability 9.0 exactly);
* ``"triton"``: the portable :func:`~nibble.kernels.triton.decode_attention`.

The choice is made once, from the layout and the device, where the fast kernel
applies. ``--decode-kernel triton|cuda`` (``DeviceConfig.decode_kernel``) forces
one (for A/B runs); a forced ``cuda`` that cannot run is a :class:`ConfigError`
naming the reason. ``--store-kernel`` picks the quantize-and-store kernel the
same way. The environment variables ``NIBBLE_DECODE_KERNEL`` /
``NIBBLE_STORE_KERNEL`` still work, deprecated (a warning), and only where the
flag is left at ``auto``. Nothing here compiles the CUDA extension.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

from nibble.kernels import PageLayout
from nibble.kernels.cuda import decode as cuda_decode
from nibble.kernels.errors import KernelInputError

from ..errors import ConfigError

ENV_VAR = "NIBBLE_DECODE_KERNEL"            # deprecated: --decode-kernel
STORE_ENV_VAR = "NIBBLE_STORE_KERNEL"       # deprecated: --store-kernel
DECODE_FLAG, STORE_FLAG = "--decode-kernel", "--store-kernel"
CUDA_SM90 = "cuda-sm90"
TRITON = "triton"
KERNEL_CHOICES = ("auto", "triton", "cuda")
log = logging.getLogger(__name__)
_warned: set[str] = set()


class DecodeChoice(NamedTuple):
    """impl: "cuda-sm90" or "triton"; why: a line for the log; forced: by a setting;
    forced_by: that setting as error messages name it."""

    impl: str
    why: str
    forced: bool
    forced_by: str = f"{ENV_VAR}=cuda"


def requested(setting: str, flag: str, env_var: str) -> tuple[str, str]:
    """``(auto|triton|cuda, the setting that asked for it)``: the flag's value, or, with the
    flag at ``auto``, the deprecated environment variable (unset or empty: auto)."""
    if setting not in KERNEL_CHOICES:
        raise ConfigError(f"{flag} must be one of {KERNEL_CHOICES}, got {setting!r}")
    if setting != "auto":
        return setting, f"{flag} {setting}"
    value = os.environ.get(env_var, "").strip().lower() or "auto"
    if value not in KERNEL_CHOICES:
        raise ConfigError(f"{env_var} must be one of {KERNEL_CHOICES}, got {value!r}")
    if value != "auto" and env_var not in _warned:
        _warned.add(env_var)
        log.warning("$%s is deprecated; use %s %s", env_var, flag, value)
    return value, f"{env_var}={value}"


def requested_impl(setting: str = "auto") -> str:
    """``--decode-kernel`` (else ``NIBBLE_DECODE_KERNEL``) normalized to auto|triton|cuda."""
    return requested(setting, DECODE_FLAG, ENV_VAR)[0]


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
                       num_q_heads: int | None = None, setting: str = "auto") -> DecodeChoice:
    """The decode kernel for ``layout`` on ``device``; ``setting``: ``--decode-kernel``
    (auto|triton|cuda; at auto, ``NIBBLE_DECODE_KERNEL`` is read, deprecated).

    ``num_q_heads`` None leaves the GQA group to :func:`confirm_group` at the
    first decode (the backend's constructor does not see the model).

    Raises:
        ConfigError: the setting is not auto|triton|cuda, or it is ``cuda`` and the
            kernel does not apply (the message names the setting and says why).
    """
    want, by = requested(setting, DECODE_FLAG, ENV_VAR)
    if want == "triton":
        return DecodeChoice(TRITON, by, True, by)
    reason = cuda_unsupported_reason(layout, device, num_q_heads)
    if reason is None:
        why = by if want == "cuda" else f"{layout.fmt.k.name} KV, head_dim 128, Hopper"
        return DecodeChoice(CUDA_SM90, why, want == "cuda", by)
    if want == "cuda":
        raise ConfigError(f"{by}: {reason}")
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
        raise ConfigError(f"{choice.forced_by}: {reason}")
    return DecodeChoice(TRITON, reason, False)


def select_store_impl(layout: PageLayout, device: torch.device, setting: str = "auto") -> str:
    """The NVFP4 quantize-and-store kernel: "triton" unless ``setting`` (``--store-kernel``;
    at auto, the deprecated ``NIBBLE_STORE_KERNEL``) is ``cuda``.

    The CUDA C++ kernel (:func:`~nibble.kernels.cuda.store_kv_nvfp4_cuda`) writes the same
    bytes as the Triton one but measured slower on an H200 (docs/benchmarks.md), so it is
    opt-in: forced, it runs for NVFP4 K and V on a compute capability 9.0 device, and each
    call still falls back to Triton for inputs it does not take (fp16/fp32, unaligned rows).

    Raises:
        ConfigError: the setting is not auto|triton|cuda, or it is ``cuda`` where the
            kernel cannot run.
    """
    want, by = requested(setting, STORE_FLAG, STORE_ENV_VAR)
    if want != "cuda":
        return TRITON
    fmt = layout.fmt
    if fmt.k.name != "nvfp4" or fmt.v.name != "nvfp4":
        raise ConfigError(f"{by}: the CUDA store writes NVFP4 pages, not "
                          f"{layout.kv_format!r}")
    if device.type != "cuda" or tuple(torch.cuda.get_device_capability(device)) != (9, 0):
        raise ConfigError(f"{by}: the CUDA store needs a compute capability "
                          f"9.0 device, got {device}")
    return CUDA_SM90
