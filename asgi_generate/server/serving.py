"""Run an ASGI app under hypercorn, programmatically, on trio or asyncio.

Used by ``asgi-generate serve`` and ``asgi-generate sim``. The first SIGINT or
SIGTERM starts hypercorn's graceful shutdown; the second only says that the
process is stopping already and how to force it; the third forces it: the
app ends its in-flight requests at once (``end_in_flight()``). hypercorn
serves with the patches of :mod:`asgi_generate.server.hypercorn`
(:func:`asgi_generate.server.hypercorn.patches.install`), or as released
when they do not match it.
"""

from __future__ import annotations

import gc
import logging
import resource
import signal
import socket
import ssl
import sys
from dataclasses import dataclass
from typing import Any

import anyio
from hypercorn.config import Config

from .hypercorn import patches

#: hypercorn worker classes; ``uvloop`` is hypercorn's asyncio worker on
#: uvloop's event loop (hypercorn's own ``--worker-class uvloop``).
WORKER_CLASSES = ("trio", "asyncio", "uvloop")
#: The log line of every process ``serve`` and ``sim`` run: time, process
#: id (``serve --workers N`` runs several), level, logger, message.
LOG_FORMAT = "%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s"
log = logging.getLogger("asgi_generate")


def raise_fd_limit() -> int:
    """Raise the soft limit on open files (``RLIMIT_NOFILE``) to the hard
    limit, logged at INFO, and return it. Every open stream costs a client
    socket and an engine socket: the common soft default of 1,024 would cap
    a frontend near 500 streams."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # the kernel still caps it at fs.nr_open
        with open("/proc/sys/fs/nr_open") as f:
            target = int(f.read())
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("open-file limit stays %d: cannot raise it to %d: %s", soft, target, exc)
            return soft
        log.info("open-file limit raised from %d to %d (the hard limit)", soft, target)
        return target
    log.info("open-file limit is %d (the hard limit is %s)", soft, hard)
    return soft


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """HTTPS for a served port (hypercorn's own TLS options).

    Attributes:
        certfile: PEM certificate chain.
        keyfile: PEM private key (unencrypted).
        ca_certs: PEM CAs of client certificates; given, every client must
            present one they signed (mutual TLS).
        ciphers: OpenSSL cipher list (TLS 1.2; hypercorn's default
            ``ECDHE+AESGCM``).
    """

    certfile: str
    keyfile: str
    ca_certs: str | None = None
    ciphers: str | None = None

    @classmethod
    def from_flags(cls, certfile: str | None, keyfile: str | None, ca_certs: str | None = None,
                   ciphers: str | None = None) -> "ServerTLS | None":
        """The TLS the flags describe (``None``: plain HTTP), checked by
        building the context hypercorn will build.

        Raises:
            ValueError: one line: half a pair, options without a
                certificate, or files that do not load.
        """
        if certfile is None and keyfile is None:
            if ca_certs is not None or ciphers is not None:
                raise ValueError("--ca-certs and --ciphers need --certfile and --keyfile")
            return None
        if certfile is None or keyfile is None:
            raise ValueError("--certfile and --keyfile go together")
        tls = cls(certfile, keyfile, ca_certs, ciphers)
        try:
            tls.apply(Config()).create_ssl_context()
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot serve HTTPS with --certfile {certfile!r} --keyfile {keyfile!r}"
                             f"{f' --ca-certs {ca_certs!r}' if ca_certs else ''}: "
                             f"{getattr(exc, 'reason', None) or exc.strerror or exc}") from None
        return tls

    def apply(self, config: Config) -> Config:
        """Set these options on a hypercorn ``config``; returns it."""
        config.certfile, config.keyfile = self.certfile, self.keyfile
        if self.ca_certs is not None:
            config.ca_certs = self.ca_certs
            config.verify_mode = ssl.CERT_REQUIRED
        if self.ciphers is not None:
            config.ciphers = self.ciphers
        return config

    def argv(self) -> list[str]:
        """The flags that give these options again (for child processes)."""
        out = ["--certfile", self.certfile, "--keyfile", self.keyfile]
        out += ["--ca-certs", self.ca_certs] if self.ca_certs is not None else []
        return out + (["--ciphers", self.ciphers] if self.ciphers is not None else [])


#: Connections the kernel queues for accept() on the listening socket (the
#: kernel caps it at ``net.core.somaxconn``, 4096 on current Linux).
LISTEN_BACKLOG = 2048


#: Whether this platform spreads connections over sockets sharing a port
#: (Linux's ``SO_REUSEPORT``: by a hash of each connection's addresses and
#: ports; the BSDs' option of that name does not balance).
REUSE_PORT = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def listening_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``0``: any free port) that
    child processes can inherit, with a queue of :data:`LISTEN_BACKLOG`.
    With ``reuse_port`` (and :data:`REUSE_PORT`) it lets
    :func:`port_group` add sockets on its address; the address must still
    be free of any other socket (checked by binding it first without the
    option), so a second server on the port fails as it would without.

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reuse_port = reuse_port and REUSE_PORT
    if reuse_port:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
            port = probe.getsockname()[1]
    return _listen(family, (host, port), reuse_port)


def _listen(family: int, address: tuple, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def port_group(sock: socket.socket, n: int) -> list[socket.socket]:
    """``n`` listening sockets for ``n`` processes, ``sock`` first. When
    ``sock`` lets its port be reused (``SO_REUSEPORT`` set, on Linux: see
    :func:`listening_socket`), the others are new sockets on its address and
    each process accepts from its own: the kernel spreads connections over
    them evenly, by hash. Otherwise ``sock`` ``n`` times: the processes share
    one queue and take connections as the kernel wakes them, which favours
    a few.

    Raises:
        OSError: a socket cannot be bound to the address.
    """
    if not (REUSE_PORT and sock.family in (socket.AF_INET, socket.AF_INET6)
            and sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)):
        return [sock] * n
    group = [sock]
    try:
        for _ in range(n - 1):
            group.append(_listen(sock.family, sock.getsockname(), True))
    except OSError:
        for other in group[1:]:
            other.close()
        raise
    return group


def hypercorn_config(
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    fd: int | None = None,
    graceful_timeout: float = 30.0,
    log_level: str = "info",
    access_log: bool = False,
    tls: ServerTLS | None = None,
) -> Config:
    """A hypercorn config bound to ``host:port``, or to an inherited listening
    socket ``fd``; hypercorn logs through the process's logging configuration
(``hypercorn.error``, ``hypercorn.access``). With ``access_log``, hypercorn's access lines (its default
    format: client, request line, status, bytes, referer, user agent) go to
    ``hypercorn.access`` at INFO; off when ``log_level`` hides INFO anyway, so
    nothing is formatted for nobody. With ``tls`` it serves HTTPS. The
    listen queue is :data:`LISTEN_BACKLOG` connections."""
    config = Config()
    config.bind = [f"fd://{fd}"] if fd is not None else [f"{host}:{port}"]
    config.graceful_timeout = graceful_timeout
    config.loglevel = log_level.upper()
    shown = logging.getLevelName(log_level.upper()) <= logging.INFO
    config.accesslog = logging.getLogger("hypercorn.access") if access_log and shown else None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = 75
    # hypercorn calls listen(config.backlog) again on every socket it serves,
    # inherited ones too: its default of 100 shrank our queue, and trio's
    # listener, which accepts once per scheduler pass, overflowed it when
    # hundreds of clients connected at once (their connections reset).
    config.backlog = LISTEN_BACKLOG
    return tls.apply(config) if tls is not None else config


#: SIGINT/SIGTERM that arrived between :func:`hold_signals` and a signal
#: receiver taking over (a process still starting up).
_held: list[int] = []


def hold_signals() -> None:
    """Keep a SIGINT or SIGTERM that arrives before :func:`run` (or another
    signal receiver) is listening, instead of dying of KeyboardInterrupt
    half-started: :func:`run` then shuts down at once, cleanly. Call it
    first thing in a process that will serve."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _frame: _held.append(signum))


def held_signal() -> int | None:
    """The first signal :func:`hold_signals` kept, if any."""
    return _held[0] if _held else None


def run(app: Any, config: Config, worker_class: str = "asyncio", header_read_timeout: float | None = None) -> None:
    """Raise the open-file limit (:func:`raise_fd_limit`), then serve ``app``
    until SIGINT or SIGTERM, and shut down gracefully: hypercorn stops
    accepting, and ``app.begin_shutdown(config.graceful_timeout)`` (when the
    app has one) lets the app end its in-flight requests itself, within
    hypercorn's graceful timeout. A second signal is logged, a third calls
    ``app.end_in_flight()`` (when the app has one). hypercorn serves
    with our patches if they match it (else as released, with one WARNING:
    :func:`asgi_generate.server.hypercorn.patches.install`); patched, an app
    with a true ``handles_send_errors`` gets an error from a ``send()`` to a
    client that is gone, and a request head is due within
    ``header_read_timeout`` seconds (``None``: hypercorn's keep-alive
    timeout alone bounds it).

    Raises:
        ValueError: ``worker_class`` is not one of :data:`WORKER_CLASSES`.
    """
    if worker_class not in WORKER_CLASSES:
        raise ValueError(f"worker class must be one of {WORKER_CLASSES}, not {worker_class!r}")
    raise_fd_limit()

    patched = patches.install(send_errors=getattr(app, "handles_send_errors", False),
                                        header_read_timeout=header_read_timeout)

    async def main() -> None:
        if worker_class == "trio":
            from hypercorn.trio import serve

            if patched:
                from .hypercorn.graceful import trio_serve as serve
        elif patched:
            from .hypercorn.asyncio_serve import serve
        else:
            from hypercorn.asyncio import serve
        # Held open until hypercorn is done: a signal lands in this
        # receiver's queue, never in the default handler.
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

            async def first_signal() -> None:
                signum = held_signal()
                if signum is None:
                    signum = await signals.__anext__()
                log.info("%s: shutting down gracefully", signal.Signals(signum).name)
                begin = getattr(app, "begin_shutdown", None)
                if begin is not None:
                    begin(config.graceful_timeout)
                tg.start_soon(later_signals)

            async def later_signals() -> None:
                count = 1
                async for signum in signals:
                    count += 1
                    name = signal.Signals(signum).name
                    if count == 2:
                        again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {name} again"
                        log.warning("%s: already stopping; %s to force", name, again)
                        continue
                    log.warning("%s: forcing the shutdown: ending the requests in flight now", name)
                    end = getattr(app, "end_in_flight", None)
                    if end is not None:
                        end()

            async def serving() -> None:
                await serve(app, config, shutdown_trigger=first_signal)
                tg.cancel_scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(serving)

    # What is alive now (modules, codecs, the app) lives as long as the
    # process: out of the collector's sight, it is never traversed again,
    # and the interpreter's exit skips it (0.2-0.6 s of collection otherwise).
    gc.freeze()
    if worker_class == "uvloop":
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    else:
        anyio.run(main, backend=worker_class)
