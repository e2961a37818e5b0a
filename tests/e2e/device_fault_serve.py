"""``nibble serve`` with a device fault on demand: once the file named by
``$NIBBLE_TEST_FAULT_TRIGGER`` exists, every model step raises the RuntimeError a
corrupt CUDA context raises. Test-only: run as ``python device_fault_serve.py <serve flags>``."""

from __future__ import annotations

import os
import sys

from nibble.services.engine import model_runner

TRIGGER = os.environ["NIBBLE_TEST_FAULT_TRIGGER"]
_execute = model_runner.ModelRunner.execute


def execute(self, batch, page_size):
    if os.path.exists(TRIGGER):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    return _execute(self, batch, page_size)


if __name__ == "__main__":
    model_runner.ModelRunner.execute = execute
    from nibble.services.cli import main
    sys.exit(main(["serve", *sys.argv[1:]]))
