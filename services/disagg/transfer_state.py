"""The explicit state machine of one KV transfer (prefill worker -> decode worker).

    BOOTSTRAPPING --(pages reserved)--> TRANSFERRING --(pages installed)--> SUCCESS
          \\                                  \\
           `--------------------------------- `--> FAILED   (error, deadline, peer death, abort)

Terminal states are final. Every transfer is its own record: a failed one
cannot affect a later request (no sticky failure, cf. sgl-project/sglang#13054).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from nibble.kernels.errors import FatalError, RetryableError


class TransferState(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"   # choosing workers, reserving decode pages
    TRANSFERRING = "transferring"     # prefill running and writing pages
    SUCCESS = "success"               # pages verified and installed; decode continues
    FAILED = "failed"                 # reservation released; request recomputed or failed


_NEXT = {TransferState.BOOTSTRAPPING: {TransferState.TRANSFERRING, TransferState.FAILED},
         TransferState.TRANSFERRING: {TransferState.SUCCESS, TransferState.FAILED},
         TransferState.SUCCESS: set(), TransferState.FAILED: set()}


class TransferError(RetryableError):
    """A KV transfer failed (peer died, deadline passed, checksum mismatch)."""


class IllegalTransition(FatalError):
    """A bug: the transfer state machine was driven out of order."""


@dataclass
class Transfer:
    request_id: str
    prefill_worker: str | None
    decode_worker: str
    deadline: float                                  # monotonic
    state: TransferState = TransferState.BOOTSTRAPPING
    error: str | None = None
    nbytes: int = 0                                  # page bytes moved
    pages: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    def advance(self, new: TransferState, error: str | None = None) -> None:
        if new not in _NEXT[self.state]:
            raise IllegalTransition(f"transfer {self.request_id}: {self.state.value} -> {new.value}")
        self.state = new
        if new in (TransferState.SUCCESS, TransferState.FAILED):
            self.finished = time.monotonic()
            self.error = error

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())
