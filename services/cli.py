"""The ``nibble`` command: ``nibble serve`` (more subcommands register the same way).

``nibble serve`` builds the engine from the flags, puts the OpenAI gateway in
front of it and runs uvicorn (and, with ``--grpc-port``, the gRPC API beside it
on the same event loop). How it ends is gateway/lifecycle.py's business:
SIGINT/SIGTERM drain (503 for new requests, running ones get
--graceful-shutdown-timeout seconds, then end with an error) and exit 0; a
second signal forces the exit; a dead engine exits 1. Then the engine shuts down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Iterator

from .config import NibbleConfig, add_engine_args, add_server_args, config_from_args
from .errors import ConfigError, FatalError

log = logging.getLogger("nibble.serve")

GRACEFUL_SHUTDOWN_S = 5        # after the drain: uvicorn/gRPC connections get this long to close
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError(f"--log-level must be one of debug|info|warning|error|critical, "
                          f"got {level!r}")
    logging.basicConfig(level=numeric, format=LOG_FORMAT, force=True)


def _url(host: str, port: int, scheme: str = "http") -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"{scheme}://[{shown}]:{port}" if ":" in shown else f"{scheme}://{shown}:{port}"


def _make_server(app, cfg: NibbleConfig):
    import uvicorn

    from .tls import uvicorn_ssl_options

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # serve() installs its own handlers and re-raises the signal when it returns,
            # which would kill the process before the engine shuts down; run_serve owns them.
            yield

    s = cfg.server
    config = uvicorn.Config(app, host=s.host, port=s.port, log_level=s.log_level.lower(),
                            log_config=None, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            **uvicorn_ssl_options(s))
    return _Server(config)


async def _log_when_started(server, cfg: NibbleConfig, model_name: str) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    url = _url(cfg.server.host, cfg.server.port,
               "https" if cfg.server.ssl_certfile is not None else "http")
    log.info("Nibble is serving %r at %s (OpenAI API: %s/v1, health: %s/health)",
             model_name, url, url, url)


async def _start_grpc(engine, cfg: NibbleConfig, app):
    """The gRPC API beside HTTP when --grpc-port is set (sharing the app's metrics and
    in-flight set); None otherwise."""
    if cfg.server.grpc_port is None:
        return None
    from .grpc_api import GrpcServer

    grpc_server = GrpcServer(engine, cfg.server, metrics=app.state.metrics,
                             inflight=app.state.inflight, preparer=app.state.preparer,
                             drain=app.state.drain)
    await grpc_server.start()
    return grpc_server


async def run_serve(cfg: NibbleConfig) -> int:
    """Build the engine, serve until a signal, shut everything down; returns the exit code."""
    from .engine.async_engine import build_engine   # heavy (torch, model code): import late
    from .engine.pauses import thaw_startup_objects
    from .gateway import create_app
    from .gateway.lifecycle import ServeLifecycle

    if cfg.disagg.disaggregate:
        from .disagg.client import DisaggEngine
        engine = await DisaggEngine.start(cfg)
    else:
        engine = build_engine(cfg)
    grpc_server = None
    try:
        app = create_app(engine, cfg.server)
        server = _make_server(app, cfg)
        grpc_server = await _start_grpc(engine, cfg, app)
        life = ServeLifecycle(server, app.state.drain, engine,
                              cfg.server.graceful_shutdown_timeout, grpc_server)
        remove_handlers = life.install_signal_handlers()
        announcer = asyncio.create_task(_log_when_started(server, cfg, engine.model_name))
        supervisor = asyncio.create_task(life.run())
        try:
            await server.serve()
        finally:
            announcer.cancel()
            supervisor.cancel()
            remove_handlers()
        if not server.started:
            log.error("the HTTP server did not start (is port %d free?)", cfg.server.port)
            return 1
        return life.exit_code
    finally:
        if grpc_server is not None:
            await grpc_server.stop(GRACEFUL_SHUTDOWN_S)
        log.info("shutting down the engine")
        await engine.shutdown()
        thaw_startup_objects()
        log.info("bye")


def cmd_serve(args: argparse.Namespace) -> int:
    from .gateway.auth import log_security_posture
    from .tls import check_server_tls

    cfg = config_from_args(args)
    log_security_posture(cfg.server, log)    # before the model loads: bad keys fail fast
    check_server_tls(cfg.server)             # likewise unreadable TLS files
    return asyncio.run(run_serve(cfg))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nibble", description="Nibble LLM inference server")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)
    bench = sub.add_parser("bench", help="run a benchmark (each writes JSON and a plot)",
                           description="Runs nibble.bench.<NAME>; the flags after NAME are "
                                       "that benchmark's own (see `nibble bench NAME --help`).")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return parser


# `nibble bench NAME` -> module under nibble.bench
BENCHMARKS = {"accuracy": "accuracy", "throughput": "throughput", "multiturn": "multiturn",
              "tier-ttft": "tier_ttft", "tiers": "tiers", "transfer": "transfer",
              "disagg-ttft": "disagg_ttft", "serving": "serving", "agentic": "agentic",
              "e2e": "e2e", "soak": "soak"}


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"nibble.bench.{BENCHMARKS[args.name]}")
    module.main(args.args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        setup_logging(getattr(args, "log_level", "info"))
        return args.func(args)
    except ConfigError as exc:
        parser.error(str(exc))           # exits 2 with usage, like any bad flag
    except FatalError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return 1
    except KeyboardInterrupt:            # a signal before the server took over signals
        return 130


if __name__ == "__main__":
    sys.exit(main())
