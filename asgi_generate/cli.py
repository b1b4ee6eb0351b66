"""The ``asgi-generate`` command: ``serve``, ``sim`` and ``codecs``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import Settings
from .serving import WORKER_CLASSES, hypercorn_config, run
from .workers.router import parse_worker_spec


def _worker_spec(value: str) -> tuple[str, str]:
    try:
        return parse_worker_spec(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="asgi-generate",
        description="A protocol-level ASGI frontend for LLM engines' native generate APIs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    d = Settings()

    serve = sub.add_parser("serve", help="serve the frontend under hypercorn")
    serve.add_argument("--worker", action="append", type=_worker_spec, default=[], metavar="PROTOCOL=URL",
                       help="an engine worker, e.g. sglang=http://127.0.0.1:30000 (repeat for more); "
                            "with none, simulated workers are started")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    serve.add_argument("--fd", type=int, default=None,
                       help="serve an inherited listening socket instead of --host/--port")
    serve.add_argument("--worker-class", choices=WORKER_CLASSES, default="trio",
                       help="hypercorn worker class (default %(default)s)")
    serve.add_argument("--workers", type=int, default=1,
                       help="hypercorn worker processes sharing the port (default %(default)s)")
    serve.add_argument("--graceful-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish on SIGTERM/SIGINT (default %(default)s)")
    serve.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                       help="request body cap in bytes; larger bodies get 413 (default %(default)s)")
    serve.add_argument("--connect-timeout", type=float, default=d.connect_timeout,
                       help="seconds to connect to a worker (default %(default)s)")
    serve.add_argument("--read-timeout", type=float, default=d.read_timeout,
                       help="seconds a worker may stay silent mid-response (default %(default)s)")
    serve.add_argument("--health-interval", type=float, default=d.health_interval,
                       help="seconds between health probes of a down worker (default %(default)s)")
    serve.add_argument("--sse-keepalive", type=float, default=d.sse_keepalive,
                       help="seconds of stream silence before a keep-alive comment; 0 = never (default %(default)s)")
    serve.add_argument("--abort-timeout", type=float, default=d.abort_timeout,
                       help="seconds to wait for an engine's abort acknowledgement, per try (default %(default)s)")
    serve.add_argument("--embedded-workers", type=int, default=d.embedded_workers,
                       help="simulated workers started when no --worker is given (default %(default)s)")
    serve.add_argument("--embedded-ttft-ms", type=float, default=d.embedded_ttft_ms,
                       help="simulated workers' time to first token in ms (default %(default)s)")
    serve.add_argument("--embedded-itl-ms", type=float, default=d.embedded_itl_ms,
                       help="simulated workers' inter-token latency in ms (default %(default)s)")
    serve.add_argument("--skip-broken-codecs", action="store_true",
                       help="start even if an installed codec fails to load (it is logged and skipped)")
    serve.add_argument("--log-level", default="info", help="logging level (default %(default)s)")

    sim = sub.add_parser("sim", help="run a simulated engine worker")
    sim.add_argument("--protocol", choices=("sglang",), default="sglang", help="native protocol to speak")
    sim.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    sim.add_argument("--port", type=int, default=30000, help="port to listen on (default %(default)s)")
    sim.add_argument("--fd", type=int, default=None, help="serve an inherited listening socket instead")
    sim.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token in ms")
    sim.add_argument("--itl-ms", type=float, default=0.0, help="inter-token latency in ms")
    sim.add_argument("--incremental-streaming-output", action="store_true",
                     help="SGLang: stream deltas instead of cumulative chunks")
    sim.add_argument("--model-name", default="sim", help="served model name (default %(default)s)")
    sim.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
    sim.add_argument("--worker-class", choices=WORKER_CLASSES, default="asyncio",
                     help="hypercorn worker class (default %(default)s)")
    sim.add_argument("--log-level", default="warning", help="logging level (default %(default)s)")

    sub.add_parser("codecs", help="list the installed codecs")
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    return Settings(
        workers=args.worker,
        max_body_bytes=args.max_body_bytes,
        connect_timeout=args.connect_timeout,
        read_timeout=args.read_timeout,
        health_interval=args.health_interval,
        sse_keepalive=args.sse_keepalive,
        abort_timeout=args.abort_timeout,
        embedded_workers=args.embedded_workers,
        embedded_ttft_ms=args.embedded_ttft_ms,
        embedded_itl_ms=args.embedded_itl_ms,
        skip_broken_codecs=args.skip_broken_codecs,
    )


def _serve(args: argparse.Namespace) -> int:
    from .app import App
    from .registry import CodecLoadError

    settings = _settings(args)
    config = hypercorn_config(
        host=args.host, port=args.port, fd=args.fd, graceful_timeout=args.graceful_timeout
    )
    if args.workers > 1:
        # Separate processes rebuild the app from the environment.
        from hypercorn.run import run as hypercorn_run

        os.environ.update(settings.to_env())
        config.application_path = "asgi_generate.asgi:app"
        config.workers = args.workers
        config.worker_class = args.worker_class
        return hypercorn_run(config)
    try:
        app = App(settings)
    except CodecLoadError as exc:
        print(f"asgi-generate: {exc}", file=sys.stderr)
        return 2
    run(app, config, args.worker_class)
    return 0


def _sim(args: argparse.Namespace) -> int:
    from .sim.app import SimApp

    app = SimApp(
        protocol=args.protocol,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        incremental_streaming_output=args.incremental_streaming_output,
        model_name=args.model_name,
        parent_pid=args.parent_pid,
    )
    config = hypercorn_config(host=args.host, port=args.port, fd=args.fd, graceful_timeout=1.0)
    config.loglevel = args.log_level.upper()
    run(app, config, args.worker_class)
    return 0


def _codecs() -> int:
    from .registry import CodecLoadError, load_codecs

    try:
        loaded = load_codecs()
    except CodecLoadError as exc:
        print(f"asgi-generate: {exc}", file=sys.stderr)
        return 2
    rows = [("NAME", "ROUTES", "WORKER PROTOCOL", "DISTRIBUTION", "VERSION")]
    for item in loaded:
        routes = ", ".join(f"{r.method} {r.path}" for r in item.codec.routes)
        rows.append((item.codec.name, routes, item.codec.worker_protocol, item.distribution, item.version))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``asgi-generate`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "codecs":
        return _codecs()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        return _serve(args)
    return _sim(args)
