"""Per-request fault isolation for one engine step.

A step runs many requests' tokens through the model at once, so one bad
request (a prompt that drives the model to NaN, cached pages planted with
garbage codes) must not fail the others. Two signals point at a culprit:

* **non-finite logits**: ``ModelRunner`` checks every sampled row and reports
  the rows that hold NaN or inf in ``WorkerOutput.failed``; rows of a batch
  are independent, so those requests are the culprits, with no re-run;
* **an exception** out of ``ModelRunner.execute`` (for instance the NVFP4
  quantizer refusing NaN K/V, which names no row): :class:`StepIsolator`
  re-runs the step's entries in halves, bisecting down to the entries that
  fail alone. Every entry is independent (its own pages and positions), so
  any subset of a step is itself a valid step, and re-running an entry only
  rewrites the KV slots it owns past its ``num_computed``: nothing of a failed
  attempt is ever read or kept. A step of ``n`` entries with ``k`` culprits
  costs at most ``2n - 1`` executions (``O(k log n)`` in practice).

A device fault is different: after a CUDA error (illegal address, device-side
assert) the context is unusable and every later call fails, so nothing is
re-run; :func:`is_device_fault` recognises it and the engine stops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..errors import DeviceFaultError
from .types import ScheduledBatch, ScheduledSeq

log = logging.getLogger(__name__)

# Substrings of the RuntimeError messages that CUDA / cuBLAS / the driver raise once the
# context is corrupt; a CUDA out-of-memory error is none of these (re-running in smaller
# groups may well succeed).
_DEVICE_FAULT_MARKERS = (
    "CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
    "illegal instruction", "misaligned address", "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUBLAS_STATUS_INTERNAL_ERROR", "uncorrectable ECC error", "CUDA driver error",
)


def is_device_fault(exc: BaseException) -> bool:
    """True when ``exc`` means the device (not one request) is broken."""
    if isinstance(exc, DeviceFaultError):
        return True
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_FAULT_MARKERS)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class IsolatedStep:
    """What re-running a failed step in smaller groups found."""

    sampled: dict[str, int] = field(default_factory=dict)   # request id -> token (good entries)
    logprobs: dict = field(default_factory=dict)   # request id -> TokenLogprob (asked for)
    failed: dict[str, str] = field(default_factory=dict)    # request id -> why it failed
    executions: int = 0                                     # model runs spent isolating
    any_ok: bool = False                                    # some entry ran cleanly


class StepIsolator:
    """Finds the entries of a failed step that fail on their own.

    Args:
        runner: ``execute(ScheduledBatch, page_size) -> WorkerOutput``.
        page_size: tokens per KV page.
    """

    def __init__(self, runner, page_size: int):
        self.runner = runner
        self.page_size = page_size

    def isolate(self, entries: list[ScheduledSeq], first_error: BaseException) -> IsolatedStep:
        """Re-run ``entries`` (whose joint execution raised ``first_error``) by bisection.

        Raises DeviceFaultError as soon as any re-run hits a device fault.
        """
        out = IsolatedStep()
        stack = [entries[len(entries) // 2:], entries[:len(entries) // 2]] \
            if len(entries) > 1 else []
        if len(entries) == 1:
            out.failed[entries[0].request_id] = describe(first_error)
        while stack:
            group = stack.pop()
            if not group:
                continue
            out.executions += 1
            try:
                result = self.runner.execute(ScheduledBatch(group), self.page_size)
            except Exception as exc:  # noqa: BLE001 - classified below
                if is_device_fault(exc):
                    raise DeviceFaultError(f"device fault while isolating a failed step: "
                                           f"{describe(exc)}") from exc
                if len(group) == 1:
                    out.failed[group[0].request_id] = describe(exc)
                else:
                    half = len(group) // 2
                    stack += [group[half:], group[:half]]
                continue
            out.failed.update(result.failed)
            out.sampled.update(result.sampled)
            out.logprobs.update(result.logprobs)
            out.any_ok = out.any_ok or len(result.failed) < len(group)
        if out.failed:
            log.warning("isolated a failed step of %d requests in %d runs: %s", len(entries),
                        out.executions, out.failed)
        return out
