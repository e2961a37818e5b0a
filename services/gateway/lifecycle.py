"""How ``nibble serve`` ends, and with which exit status.

- The first SIGTERM or SIGINT drains (frontend/drain.py): new requests get 503
  (gRPC UNAVAILABLE), running ones get ``--graceful-shutdown-timeout`` seconds,
  the rest end with an error; then the gRPC and HTTP servers stop and the
  process exits 0. A second signal cuts the running requests at once and forces
  uvicorn's exit.
- A dead engine (``engine.is_healthy()`` false: a device fault, see
  services/engine/faults.py) is fatal: in-flight requests fail (the engine has
  already sent them its error; whatever still runs is cut), the servers stop
  and the process exits 1, so a supervisor (Kubernetes, systemd) restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from ..engine.client import EngineClient
from ..frontend.drain import Drain

log = logging.getLogger("nibble.serve")

ENGINE_POLL_S = 0.5         # how often the watcher asks the engine whether it lives
DEAD_ENGINE_GRACE_S = 2.0   # a dead engine already failed its requests: a short wait suffices
GRPC_STOP_GRACE_S = 2.0     # after the drain nothing runs; open gRPC calls get this long
EXIT_OK, EXIT_ENGINE_DEAD = 0, 1


def engine_healthy(engine: EngineClient) -> bool:
    try:
        return bool(engine.is_healthy())
    except Exception:  # noqa: BLE001 - a failing check means unhealthy
        log.exception("engine health check raised")
        return False


class ServeLifecycle:
    """Waits for a signal or a dead engine, then drains and stops the servers.

    Args:
        server: the uvicorn server (``should_exit`` / ``force_exit`` end its loop).
        drain: the app's Drain (``app.state.drain``).
        engine: has ``is_healthy()``, ``abort(request_id)`` and maybe ``dead_reason``.
        timeout: ``--graceful-shutdown-timeout`` in seconds.
        grpc_server: the gRPC server to stop after the drain, or None.
    """

    def __init__(self, server: Any, drain: Drain, engine: EngineClient, timeout: float,
                 grpc_server: Any = None, poll_s: float = ENGINE_POLL_S):
        self.server, self.drain, self.engine = server, drain, engine
        self.timeout, self.grpc_server, self.poll_s = timeout, grpc_server, poll_s
        self.exit_code = EXIT_OK
        self._stop = asyncio.Event()

    def on_signal(self, sig: signal.Signals) -> None:
        if self._stop.is_set():
            log.warning("second %s: cutting running requests and forcing exit", sig.name)
            self.drain.force()
            self.server.force_exit = True
            self.server.should_exit = True
        else:
            log.info("%s received: draining (graceful shutdown timeout %.1fs)", sig.name,
                     self.timeout)
            self._stop.set()

    def install_signal_handlers(self) -> Callable[[], None]:
        """SIGINT/SIGTERM -> ``on_signal``; returns a function that removes the handlers."""
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self.on_signal, sig)
        return lambda: [loop.remove_signal_handler(sig) for sig in sigs]

    async def _engine_died(self) -> str:
        while engine_healthy(self.engine):
            await self.drain.clock.sleep(self.poll_s)
        return self.engine.dead_reason or "the engine is not healthy"

    async def run(self) -> None:
        """Until a signal or the engine's death; then drain, stop gRPC, end uvicorn."""
        watcher = asyncio.ensure_future(self._engine_died())
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({watcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not watcher.done():
                watcher.cancel()
        timeout = self.timeout
        if watcher.done() and not watcher.cancelled():
            self.exit_code = EXIT_ENGINE_DEAD
            timeout = min(timeout, DEAD_ENGINE_GRACE_S)
            log.critical("the engine died (%s): failing in-flight requests and exiting with "
                         "status %d so a supervisor restarts the server", watcher.result(),
                         EXIT_ENGINE_DEAD)
        await self.drain.run(timeout, self.engine.abort)
        if self.exit_code == EXIT_OK and not engine_healthy(self.engine):
            log.error("the engine died during the drain: exiting with status %d",
                      EXIT_ENGINE_DEAD)
            self.exit_code = EXIT_ENGINE_DEAD
        if self.grpc_server is not None:
            try:
                await self.grpc_server.stop(GRPC_STOP_GRACE_S)
            except Exception:  # noqa: BLE001 - uvicorn must still stop
                log.exception("stopping the gRPC server failed")
        self.server.should_exit = True
