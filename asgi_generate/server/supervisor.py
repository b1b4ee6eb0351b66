"""``asgi-generate serve --workers N``: N frontend processes on one port.

The supervisor binds the listening socket once, starts the embedded
simulators once (when no worker is configured), then starts N children that
each serve a listening socket of their own on the port
(:func:`asgi_generate.server.serving.port_group`: Linux's ``SO_REUSEPORT``,
which spreads connections over the processes evenly; one shared socket
elsewhere, or when an inherited ``--fd`` socket does not allow it; with
sockets of their own, the children also even out their keep-alive
connections through a table they share, :mod:`asgi_generate.server.spread`), with
settings passed through ``ASGI_GENERATE_*``
variables (the simulators' specs and tokenizer among them; their process
ids and roles on the child's command line, for ``/stats``). Children and
simulators run in sessions of their own, so a terminal's Ctrl-C reaches only
the supervisor, which forwards every SIGINT and SIGTERM to every child;
each child runs its own graceful shutdown (and gets SIGTERM from the kernel
should the supervisor die). The supervisor closes its copies of the
sockets once the children hold them (a child that dies takes its socket out
of the port's group). It exits when all children have,
then stops the simulators. Each child keeps its own counters: ``/stats``
answers for the process that took the connection (its ``pid`` says which).
``/metrics`` answers for all of them: the supervisor gives the children a
fresh ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode,
see :mod:`asgi_generate.ops.metrics`), tells the library when each child is
gone, and removes the folder at exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from contextlib import AsyncExitStack

import anyio
import orjson
from prometheus_client import multiprocess

from ..config import Settings
from . import detach, embedded, spread
from ..ops.metrics import MULTIPROC_ENV
from .serving import LOG_FORMAT, ServerTLS, held_signal, hold_signals, port_group


def supervise(
    settings: Settings,
    sock: socket.socket,
    processes: int,
    worker_class: str,
    shutdown_grace: float,
    protocols: set[str],
    *,
    log_level: str = "info",
    access_log: bool = True,
    tls: ServerTLS | None = None,
    ready_fd: int | None = None,
) -> int:
    """Run ``processes`` frontend children on ``sock``'s port until they exit
    (embedded simulators for ``protocols`` when no worker is configured);
    returns the first non-zero exit code, else 0. ``log_level`` and
    ``access_log`` are the children's (see :func:`serving.hypercorn_config`),
    as is ``tls`` (HTTPS). With ``ready_fd`` (``serve --detach``'s pipe,
    :mod:`asgi_generate.server.detach`) each child announces on it once it
    serves, and this process closes its own copy.

    Raises:
        OSError: the children's sockets cannot be bound to ``sock``'s address.
    """

    async def main() -> int:
        async with AsyncExitStack() as stack:
            fleet, simulators = settings, []
            if embedded.wanted(settings):
                specs, prefill, decode, simulators = await stack.enter_async_context(
                    embedded.embedded_fleet(protocols, settings.embedded_workers, settings.embedded_ttft_ms,
                                            settings.embedded_itl_ms, settings.embedded_pd)
                )
                fleet = dataclasses.replace(settings, workers=specs, prefill=prefill, decode=decode,
                                            tokenizer=embedded.tokenizer(settings))
            metrics_dir = tempfile.mkdtemp(prefix="asgi-generate-metrics-")
            stack.callback(shutil.rmtree, metrics_dir, ignore_errors=True)
            env = {**os.environ, **fleet.to_env(), MULTIPROC_ENV: metrics_dir}
            socks = port_group(sock, processes)
            table = spread.Table.create(processes) if socks[0] is not socks[-1] else None
            cmd = [sys.executable, "-m", "asgi_generate.server.supervisor",
                   "--worker-class", worker_class, "--shutdown-grace", str(shutdown_grace),
                   "--parent-pid", str(os.getpid()), "--log-level", log_level,
                   "--access-log" if access_log else "--no-access-log",
                   "--simulators", orjson.dumps([tuple(sim) for sim in simulators]).decode(),
                   *(tls.argv() if tls is not None else []),
                   *(["--ready-fd", str(ready_fd)] if ready_fd is not None else [])]
            shared = [*([ready_fd] if ready_fd is not None else []), *([table.fd] if table is not None else [])]
            try:
                children = [
                    await anyio.open_process([*cmd, "--fd", str(own.fileno()),
                                              *(table.argv(slot) if table is not None else [])],
                                             pass_fds=[own.fileno(), *shared], env=env, start_new_session=True,
                                             stdin=subprocess.DEVNULL, stdout=None, stderr=None)
                    for slot, own in enumerate(socks)
                ]
            finally:
                for own in socks:
                    own.close()  # the children's now
            if ready_fd is not None:
                os.close(ready_fd)  # the children announce
            forwarded: set[int] = set()

            async def reap(slot: int, child) -> None:
                await child.wait()
                # Its in-flight and per-worker gauges, and its connections, no longer count.
                multiprocess.mark_process_dead(child.pid, metrics_dir)
                if table is not None:
                    table.clear(slot)

            async with anyio.create_task_group() as tg:
                tg.start_soon(_forward_signals, children, forwarded)
                async with anyio.create_task_group() as reapers:
                    for slot, child in enumerate(children):
                        reapers.start_soon(reap, slot, child)
                tg.cancel_scope.cancel()
            codes = [child.returncode for child in children]
        # A child that a forwarded stop reached before it could handle it
        # (still importing) died of that very signal: a clean stop too.
        return next((c for c in codes if c and -c not in forwarded), 0)

    return anyio.run(main)


async def _forward_signals(children: list, forwarded: set[int]) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        signum = held_signal()  # one that came while the fleet was starting
        if signum is not None:
            _send(children, signum, forwarded)
        async for signum in signals:
            _send(children, signum, forwarded)


def _send(children: list, signum: int, forwarded: set[int]) -> None:
    forwarded.add(signum)
    for child in children:
        if child.returncode is None:
            child.send_signal(signum)


def _die_with_parent() -> None:
    """Linux: have the kernel send this process SIGTERM (a graceful stop)
    when its parent dies, since a child in its own session gets no signal
    from the parent's terminal. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _child() -> int:
    from .app import App
    from .serving import hypercorn_config, run

    parser = argparse.ArgumentParser(prog="asgi_generate.server.supervisor")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--worker-class", required=True)
    parser.add_argument("--shutdown-grace", type=float, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", required=True)
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, required=True)
    parser.add_argument("--simulators", type=orjson.loads, required=True)
    parser.add_argument("--ready-fd", type=int, default=None)
    parser.add_argument("--connections", type=spread.from_flag, default=None)
    for flag in ("--certfile", "--keyfile", "--ca-certs", "--ciphers"):
        parser.add_argument(flag, default=None)
    hold_signals()  # a stop forwarded while this child still imports is kept, not fatal
    args = parser.parse_args()
    _die_with_parent()
    if os.getppid() != args.parent_pid:  # it died before the line above took effect
        return 0
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    settings = Settings.from_env()
    app = App(settings, simulators=[embedded.Simulator(*sim) for sim in args.simulators])
    spread.current = args.connections
    if args.ready_fd is not None:
        app.on_started = detach.announcer(args.ready_fd)
    tls = ServerTLS(args.certfile, args.keyfile, args.ca_certs, args.ciphers) if args.certfile else None
    config = hypercorn_config(fd=args.fd, graceful_timeout=args.shutdown_grace + 15.0,
                              log_level=args.log_level, access_log=args.access_log, tls=tls)
    run(app, config, args.worker_class, settings.header_read_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
