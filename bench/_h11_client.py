"""The worker client as it was before httptools: h11's parse of the
worker's answers (asgi_generate/workers/http.py at the commit before
httptools came in, imports made absolute), kept only for
bench_worker_parse.py's side-by-side. Not part of the package.

The original's docstring follows.

HTTP/1.1 client for engine workers: h11 over anyio streams, pooled.

One :class:`ConnectionPool` per worker keeps idle keep-alive connections
(bare sockets for ``http://`` workers, :mod:`asgi_generate.workers.sockets`).
A connection goes back to the pool only when both sides finished their
message cleanly (h11 ``DONE``/``DONE``); any response not read to its end,
any error and any cancellation retires the connection instead, so a later
request never reads a stale tail. Wire format: RFC 9112 (via h11).

A request whose bytes may have reached the worker is never sent again by
the pool: a connection that closes before the response head is
:class:`Unanswered`, and the caller decides (a generate leg fails over
under a new engine id). Only a request the caller marks ``idempotent`` (a
health probe, a server-info read) gets one fresh try when a reused
connection closes so (RFC 9110 section 9.2.2). What makes such a close
likely, reusing a connection the worker is closing, is kept rare: an idle
connection is trusted for :data:`IDLE_TIMEOUT` seconds, less than the
engines' own keep-alive timeout, and is checked for the worker's close
without waiting (:meth:`~asgi_generate.workers.sockets.TCPConnection.stale`:
on asyncio the loop's selector keeps watching a pooled connection, so the
check is free; elsewhere one ``poll(2)``) before it carries a request.

A pool for an ``https://`` worker speaks TLS over anyio's TLS stream
(:class:`~asgi_generate.workers.sockets.TLSConnection` around
:func:`anyio.connect_tcp` with an :class:`ssl.SSLContext`, from
:func:`tls_context`: certificate and host name verified unless told
otherwise); a failed handshake is a failed connect.

Waits for the worker take absolute deadlines on anyio's clock
(``anyio.current_time()``) chosen by the caller, who knows the phase
(headers, first token, between tokens); a passed deadline is
:class:`TimedOut`, which says nothing about the worker's health.
"""

from __future__ import annotations

import logging
import math
import os
import ssl
import time
from collections import deque
from typing import Iterable

import anyio
import h11

from asgi_generate.exceptions import ConnectFailed, TimedOut, Unanswered, WorkerDisconnected
from asgi_generate.workers.sockets import TCPConnection, TLSConnection, connect

log = logging.getLogger("asgi_generate.workers")
RECEIVE_SIZE = 65536
#: Seconds an idle pooled connection is trusted: under the 5 s after which
#: both engines' uvicorn closes an idle keep-alive (SGLang:
#: ``srt/environ.py`` ``SGLANG_TIMEOUT_KEEP_ALIVE``, passed as
#: ``timeout_keep_alive`` by ``srt/entrypoints/http_server.py``
#: ``launch_server``; vLLM: ``envs.py`` ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``,
#: passed by ``entrypoints/launchers/api_server/entry.py``
#: ``build_and_serve`` to ``serve_http``), with a second to spare for the
#: response's own transit (uvicorn's timer starts once it has sent it).
IDLE_TIMEOUT = 4.0


def tls_context(ca_file: str | None = None, insecure: bool = False) -> ssl.SSLContext:
    """The client TLS context for ``https://`` workers: certificates and
    host names verified against ``ca_file`` (a PEM bundle; only it is
    trusted when given), else the system's CAs; ``insecure`` verifies
    nothing (for testing; logged as a WARNING). ALPN offers HTTP/1.1 only.

    Raises:
        OSError: ``ca_file`` cannot be read.
        ssl.SSLError: ``ca_file`` holds no usable certificate.
    """
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["http/1.1"])
    if insecure:
        log.warning("--worker-insecure: TLS certificates of https:// workers are NOT verified")
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class _Connection:
    __slots__ = ("stream", "h11", "idle_since")

    def __init__(self, stream: TCPConnection | TLSConnection) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    async def aclose(self) -> None:
        stream = self.stream
        if type(stream) is TCPConnection:
            stream.close()
        else:
            await stream.aclose()


class Response:
    """A worker's response head plus reads of its body.

    Attributes:
        status: HTTP status code.
        content_type: the ``content-type`` header's value, ``None`` if absent
            (the other headers are not kept: an open stream holds its
            response for its whole life).
        retry_after: the ``retry-after`` header's value as sent (RFC 9110
            section 10.2.3: seconds or an HTTP date), ``None`` if absent; a
            worker's 429 or 503 may carry it.
        complete: the body was read to its end.
    """

    __slots__ = ("status", "content_type", "retry_after", "_conn", "complete")

    def __init__(self, conn: _Connection, head: h11.Response) -> None:
        self.status = head.status_code
        self.content_type = self.retry_after = None
        for k, v in head.headers:  # h11 gives lower-case names
            if k == b"content-type":
                self.content_type = v
            elif k == b"retry-after":
                self.retry_after = v
        self._conn = conn
        self.complete = False

    async def read_some(self, deadline: float = math.inf) -> bytes | None:
        """Every body byte that has arrived, waiting for at least one; ``None``
        once the body has ended.

        Returning all that one socket read brought (not one h11 event at a
        time) lets the caller handle a burst of events with one client write.

        Args:
            deadline: when to give up waiting, on ``anyio.current_time()``'s clock.

        Raises:
            WorkerDisconnected: the connection broke or the worker broke HTTP.
            TimedOut: ``deadline`` passed before a byte arrived.
        """
        if self.complete:
            return None
        conn = self._conn
        parts: list[bytes] | None = None  # made once there is data: none is kept while waiting
        while True:
            event = _next_event(conn)
            kind = type(event)
            if kind is h11.Data:
                if parts is None:
                    parts = [event.data]
                else:
                    parts.append(event.data)
            elif kind is h11.EndOfMessage:
                self.complete = True
                return b"".join(parts) if parts else None
            elif event is h11.NEED_DATA:
                if parts:
                    return b"".join(parts)
                # _receive's work, inline: one coroutine frame fewer per
                # open stream while it waits for the worker.
                try:
                    data = await conn.stream.receive(RECEIVE_SIZE, deadline)
                except OSError as exc:
                    raise _lost(exc) from None
                _take(conn, data)
            elif kind is h11.ConnectionClosed:
                raise WorkerDisconnected("worker closed the connection mid-response")

    async def read(self, deadline: float = math.inf) -> bytes:
        """The whole body, by ``deadline`` (as for :meth:`read_some`)."""
        parts = []
        while (data := await self.read_some(deadline)) is not None:
            parts.append(data)
        return b"".join(parts)


async def _receive(conn: _Connection, deadline: float, wait_first: bool = False) -> None:
    try:
        data = await conn.stream.receive(RECEIVE_SIZE, deadline, wait_first)
    except OSError as exc:
        raise _lost(exc) from None
    _take(conn, data)


def _lost(exc: OSError) -> WorkerDisconnected:
    return WorkerDisconnected(f"connection to worker lost: {exc!r}")


def _take(conn: _Connection, data: bytes | None) -> None:
    """Feed what a read brought to h11 (``None``: the read's deadline passed)."""
    if data is None:
        raise TimedOut("deadline passed waiting for the worker")
    conn.h11.receive_data(data)


def _next_event(conn: _Connection) -> h11.Event:
    try:
        return conn.h11.next_event()
    except h11.RemoteProtocolError as exc:
        raise WorkerDisconnected(f"worker broke HTTP/1.1: {exc}") from None


async def _next_response(conn: _Connection, deadline: float) -> h11.Response:
    # Called right after the request went out: its first read would find nothing.
    wait_first = True
    while True:
        try:
            event = _next_event(conn)
        except WorkerDisconnected:
            if conn.h11.trailing_data[1]:  # h11 words it "can't handle event type ConnectionClosed"
                raise WorkerDisconnected("worker closed the connection before answering") from None
            raise
        if type(event) is h11.Response:
            return event
        if event is h11.NEED_DATA:
            await _receive(conn, deadline, wait_first)
            wait_first = False
        elif type(event) is h11.ConnectionClosed:
            raise WorkerDisconnected("worker closed the connection before answering")


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections to one worker at ``host:port``.

    Args:
        host, port: the worker's address.
        connect_timeout: seconds to open a TCP connection (and, with TLS,
            to finish the handshake).
        ssl_context: speak TLS with this context (an ``https://`` worker);
            ``None``: plain HTTP.
        tls_hostname: the name the certificate must carry (default ``host``).
        max_idle: idle connections kept; more are closed on release.
        idle_timeout: seconds an idle connection is trusted; older ones are
            closed rather than reused (:data:`IDLE_TIMEOUT`: under the
            engines' own keep-alive timeout).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout: float = 5.0,
        max_idle: int = 256,
        idle_timeout: float = IDLE_TIMEOUT,
        ssl_context: ssl.SSLContext | None = None,
        tls_hostname: str | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self.tls_hostname = tls_hostname
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        #: Oldest first: reuse takes the newest, expiry closes from the oldest.
        self._idle: deque[_Connection] = deque()
        self._host_header = f"{host}:{port}".encode()
        self.opened = 0
        self.retired = 0

    @property
    def idle(self) -> int:
        """Idle connections in the pool."""
        return len(self._idle)

    async def _connect(self) -> _Connection:
        try:
            with anyio.fail_after(self.connect_timeout):
                if self.ssl_context is None:
                    stream = await connect(self.host, self.port)
                else:
                    # Not standard-compatible: HTTP frames its own messages,
                    # and servers often close without a TLS close_notify.
                    stream = TLSConnection(await anyio.connect_tcp(
                        self.host, self.port, ssl_context=self.ssl_context, tls_standard_compatible=False,
                        tls_hostname=self.tls_hostname or self.host))
        except TimeoutError:
            raise ConnectFailed(f"connect to {self.host}:{self.port} timed out") from None
        except ssl.SSLError as exc:
            raise ConnectFailed(f"TLS handshake with {self.host}:{self.port} failed: {_tls_reason(exc)}") from None
        except (anyio.BrokenResourceError, anyio.EndOfStream):
            raise ConnectFailed(f"TLS handshake with {self.host}:{self.port} failed: connection closed") from None
        except OSError as exc:
            raise ConnectFailed(f"connect to {self.host}:{self.port} failed: {_os_reason(exc)}") from None
        self.opened += 1
        return _Connection(stream)

    async def _take_idle(self) -> _Connection | None:
        """The newest idle connection that is neither past ``idle_timeout``
        nor closed by the worker; the others it passes are closed."""
        trusted_since = time.monotonic() - self.idle_timeout
        while self._idle:
            conn = self._idle.pop()
            if conn.idle_since > trusted_since and not conn.stream.stale():
                return conn
            self.retired += 1
            await conn.aclose()
        return None

    async def _expire(self) -> None:
        """Close the idle connections past ``idle_timeout``, before the
        worker closes them (they would wait in CLOSE_WAIT under newer ones)."""
        trusted_since = time.monotonic() - self.idle_timeout
        idle = self._idle
        while idle and idle[0].idle_since <= trusted_since:
            self.retired += 1
            await idle.popleft().aclose()

    async def _send(self, conn: _Connection, method: bytes, path: bytes, headers: list, body: bytes) -> None:
        data = conn.h11.send(h11.Request(method=method, target=path, headers=headers))
        if body:
            data += conn.h11.send(h11.Data(data=body))
        data += conn.h11.send(h11.EndOfMessage())
        try:
            await conn.stream.send(data)
        except OSError as exc:
            raise _lost(exc) from None

    def request(
        self,
        method: bytes,
        path: bytes,
        body: bytes = b"",
        headers: Iterable[tuple[bytes, bytes]] = (),
        head_deadline: float = math.inf,
        idempotent: bool = False,
    ) -> "_Exchange":
        """``async with pool.request(...) as response``: send one request
        and get its :class:`Response` once the head is in.

        The connection returns to the pool only if the caller read the body to
        its end; otherwise (error, cancellation, early exit) it is closed.

        Args:
            head_deadline: when to stop waiting for the response head, on
                ``anyio.current_time()``'s clock (connecting has its own
                ``connect_timeout``).
            idempotent: the request may reach the worker twice (a health
                probe, an info read; never a generate, abort or admin
                request): a reused connection that closes before the head
                gets one fresh try.

        Raises:
            ConnectFailed: the worker could not be reached.
            Unanswered: the connection closed before the response head (not
                sent again).
            WorkerDisconnected: the connection broke before the response ended.
            TimedOut: ``head_deadline`` passed before the head arrived.
        """
        return _Exchange(self, (method, path, body, headers, head_deadline, idempotent))

    async def _release(self, conn: _Connection, ok: bool) -> None:
        if ok and conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            await self._expire()
            if len(self._idle) < self.max_idle:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                await conn.aclose()
        else:
            self.retired += 1
            await conn.aclose()

    async def aclose(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, deque()
        for conn in idle:
            await conn.aclose()


class _Exchange:
    """One request on a pooled connection, as an async context manager
    (:meth:`ConnectionPool.request`). A class rather than a generator: an
    open stream holds it for its whole life, and it keeps neither the
    request body nor its headers once they are sent."""

    __slots__ = ("pool", "args", "conn", "response")

    def __init__(self, pool: ConnectionPool, args: tuple) -> None:
        self.pool = pool
        self.args: tuple | None = args
        self.conn: _Connection | None = None
        self.response: Response | None = None

    async def __aenter__(self) -> Response:
        pool = self.pool
        method, path, body, headers, head_deadline, idempotent = self.args
        self.args = None
        all_headers = [
            (b"host", pool._host_header),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ]
        conn = await pool._take_idle()
        # An idempotent request on a reused connection may be sent once more.
        retry = idempotent and conn is not None
        if conn is None:
            conn = await pool._connect()
        while True:
            try:
                await pool._send(conn, method, path, all_headers, body)
                head = await _next_response(conn, head_deadline)
                break
            except WorkerDisconnected as exc:
                await pool._release(conn, False)
                if not retry:
                    # The worker may have read it: sent once, whatever follows.
                    raise Unanswered(str(exc)) from None
                retry = False
                conn = await pool._connect()
            except BaseException:
                await pool._release(conn, False)
                raise
        self.conn = conn
        self.response = Response(conn, head)
        return self.response

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.pool._release(self.conn, exc_type is None and self.response.complete)


def _tls_reason(exc: ssl.SSLError) -> str:
    # "certificate verify failed: unable to get local issuer certificate"
    # rather than "[SSL: CERTIFICATE_VERIFY_FAILED] ... (_ssl.c:1006)".
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    return exc.reason.lower().replace("_", " ") if exc.reason else str(exc)


def _os_reason(exc: OSError) -> str:
    if exc.errno is not None:
        return os.strerror(exc.errno)
    # anyio (a TLS worker's connect) reports a failed connect as "All
    # connection attempts failed", with the first address's own error (or
    # a group of them) as the cause.
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        cause = cause.exceptions[0]
    if isinstance(cause, OSError) and cause.errno is not None:
        return os.strerror(cause.errno)
    return exc.strerror or str(exc)
