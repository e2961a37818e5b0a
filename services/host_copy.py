"""Host -> device copies that never wait for the device (the step path's only way to move
host-built inputs to a GPU).

In torch a blocking host -> CUDA copy (``t.to("cuda")``, ``torch.tensor(data,
device="cuda")``) is ``cudaMemcpyAsync`` followed by ``cudaStreamSynchronize``: the host
waits for every kernel already queued on the stream. Under overlap scheduling the host
builds step N+1 while the device runs step N, so one such copy in the step path makes the
host wait for step N to finish and leaves the device idle while the rest of N+1 is
prepared. A non-blocking copy from *pageable* memory is not safe either: the driver stages
it through its own pinned buffer and may wait on the stream for a large one. So inputs go
through pinned memory (torch's caching host allocator, which keeps a block until the copy
that reads it has run) and a non-blocking copy, which only queues the transfer.

On a CPU device these are plain copies (or none).
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``, queued without waiting for the device.

    CUDA: ``t`` is pinned first unless it already is (one host copy), then copied
    non-blocking; the caller may drop or reuse its own ``t`` at once. Other devices: ``t``
    itself when it is already there, else a plain copy.
    """
    if device.type != "cuda":
        return t if t.device == device else t.to(device)
    if t.device.type != "cpu":
        raise ValueError(f"to_device copies host tensors, got one on {t.device}")
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def ints_to_device(values: Sequence[int], device: torch.device,
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list of integers -> 1-D ``dtype`` tensor on ``device`` (see :func:`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def floats_to_device(values: Sequence[float], device: torch.device,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host list of floats -> 1-D ``dtype`` tensor on ``device`` (see :func:`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def copy_to(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` queued without waiting for the device: a host ``src`` bound for a
    CUDA ``dst`` (a CUDA graph's static input buffer) is pinned first; returns ``dst``."""
    if dst.is_cuda and src.device.type == "cpu" and not src.is_pinned():
        src = src.pin_memory()
    return dst.copy_(src, non_blocking=True)
