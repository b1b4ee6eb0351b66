"""HTTP/1.1 client for engine workers: requests written directly, answers
parsed by httptools (llhttp, the parser uvicorn uses) over anyio streams,
pooled.

One :class:`ConnectionPool` per worker keeps idle keep-alive connections
(bare sockets for ``http://`` workers, :mod:`asgi_generate.workers.sockets`).
A connection goes back to the pool only when both sides finished their
message cleanly: the request sent whole, the response read to its end,
neither side asking to close, and nothing after the response's last byte.
Any response not read to its end, any error and any cancellation retires
the connection instead, so a later request never reads a stale tail. Wire
format: RFC 9112 (status line, headers, ``Content-Length``, chunked and
close-delimited bodies, 1xx interim responses skipped, no body for HEAD,
204 and 304; parsed by llhttp, bounded here by :data:`MAX_HEAD_BYTES`).

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
import re
import ssl
import time
from collections import deque
from typing import Iterable

import anyio
import httptools

from ..exceptions import ConnectFailed, Overrun, TimedOut, Unanswered, WorkerDisconnected
from .sockets import TCPConnection, TLSConnection, connect

log = logging.getLogger("asgi_generate.workers")
RECEIVE_SIZE = 65536
#: Bytes a response may send without completing its head (status line and
#: header lines, interim 1xx heads included), and bytes in a row that bring
#: no body byte (a chunk-size line, trailers): past either, the worker broke
#: HTTP/1.1. llhttp itself keeps no such limit; this is the figure h11's
#: ``max_incomplete_event_size`` (16 KiB) kept before, with its message.
MAX_HEAD_BYTES = 16 * 1024
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


_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
#: RFC 9112 section 3 (method SP request-target) and section 5 (field-name
#: ":" SP field-value): no byte that could end a line or a field early.
_REQUEST_LINE = re.compile(_TOKEN + rb" [\x21-\x7e]+")
_FIELD_LINE = re.compile(_TOKEN + rb": [\t\x20-\x7e\x80-\xff]*")


def _request_head(method: bytes, path: bytes, host: bytes, length: int,
                  headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The request line and header lines (``host`` first, then
    ``content-length`` and ``headers``), ending with the empty line: the
    bytes h11 wrote for the same request.

    Raises:
        ValueError: a method, target, header name or value that would not
            read back as itself (a CR or LF in a percent-decoded path, say).
    """
    line = method + b" " + path
    if _REQUEST_LINE.fullmatch(line) is None:
        raise ValueError(f"not an HTTP/1.1 request line: {line!r}")
    lines = [b"%s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d" % (line, host, length)]
    for name, value in headers:
        field = name + b": " + value
        if _FIELD_LINE.fullmatch(field) is None:
            raise ValueError(f"not an HTTP/1.1 header field: {field!r}")
        lines.append(field)
    lines.append(b"\r\n")
    return b"\r\n".join(lines)


class _Reader:
    """One response's parse: the callbacks httptools' parser calls from
    ``feed_data`` (llhttp checks the framing), keeping what the
    :class:`Response` hands on. A new one per response; the parser is
    dropped when the exchange ends (:meth:`drop`), which breaks the
    parser-callbacks cycle.

    Attributes:
        body: body bytes parsed and not yet read (reused, cleared by reads).
        head: the final (non-1xx) response head is in.
        end: the response ended.
        excess: bytes followed the end (the connection must not carry more).
        keep_alive: the worker keeps the connection (HTTP/1.1, no
            ``Connection: close``, the body's end known without a close).
        fed: bytes fed in a row that completed no head and brought no body
            byte (bounded by :data:`MAX_HEAD_BYTES`).
        received: body bytes handed on (for a short body's message).
    """

    __slots__ = ("parser", "body", "head", "end", "excess", "keep_alive", "status", "content_type",
                 "retry_after", "length", "chunked", "fed", "received")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.head = self.end = self.excess = self.keep_alive = False
        self.status = 0
        self.content_type = self.retry_after = self.length = None
        #: ``None``: no Transfer-Encoding; False: one other than chunked.
        self.chunked: bool | None = None
        self.fed = self.received = 0

    def drop(self) -> None:
        self.parser = None

    def on_message_begin(self) -> None:
        if self.end:  # bytes after ours: llhttp stops here, feed() marks them
            raise Overrun

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head:  # trailers: nothing a caller reads
            return
        name = name.lower()
        if name == b"content-type":
            self.content_type = value
        elif name == b"retry-after":
            self.retry_after = value
        elif name == b"content-length":
            self.length = value
        elif name == b"transfer-encoding":
            self.chunked = value.lower() == b"chunked"

    def on_headers_complete(self) -> None:
        parser = self.parser
        status = parser.get_status_code()
        if status < 200:  # interim (RFC 9110 section 15.2): the final head follows
            self.content_type = self.retry_after = self.length = self.chunked = None
            return
        self.status = status
        self.head = True
        # As h11: an HTTP/1.0 answer is never kept, whatever it says.
        self.keep_alive = parser.should_keep_alive() and parser.get_http_version() == "1.1"

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        if self.head:
            self.end = True

    def feed(self, data: bytes) -> None:
        """Parse ``data``, the callbacks keeping what it brought.

        Raises:
            WorkerDisconnected: the worker broke HTTP/1.1 before the end
                (after it: :attr:`excess`).
        """
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.end:
                self.excess = True
                return
            if isinstance(exc, httptools.HttpParserUpgrade):
                raise WorkerDisconnected("worker broke HTTP/1.1: switched protocols unasked") from None
            raise WorkerDisconnected(f"worker broke HTTP/1.1: {exc}") from None

    def stalled(self, size: int) -> None:
        """Count ``size`` bytes fed that completed no head and brought no body.

        Raises:
            WorkerDisconnected: more than :data:`MAX_HEAD_BYTES` in a row.
        """
        self.fed += size
        if self.fed > MAX_HEAD_BYTES:
            raise WorkerDisconnected("worker broke HTTP/1.1: Receive buffer too long")

    def closed(self) -> None:
        """The worker closed the connection before :attr:`end`: a body
        delimited by the close ends (RFC 9112 section 6.3, item 8).

        Raises:
            WorkerDisconnected: a chunked or ``Content-Length`` body short
                (h11's words, which the logs and records keep).
        """
        if self.chunked:
            raise WorkerDisconnected("worker broke HTTP/1.1: peer closed connection without sending complete "
                                     "message body (incomplete chunked read)")
        if self.length is not None:
            raise WorkerDisconnected("worker broke HTTP/1.1: peer closed connection without sending complete "
                                     f"message body (received {self.received} bytes, expected {int(self.length)})")
        self.end = True
        self.keep_alive = False


class _HeadReader(_Reader):
    """A HEAD request's response: its head is all of it (RFC 9110 section
    9.3.2), whatever its Content-Length says; llhttp, which does not know
    the request, would wait for a body."""

    __slots__ = ()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self.end = self.head

    def on_body(self, data: bytes) -> None:
        self.excess = True


class _Connection:
    __slots__ = ("stream", "reader", "idle_since")

    def __init__(self, stream: TCPConnection | TLSConnection) -> None:
        self.stream = stream
        self.reader: _Reader | None = None
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

    def __init__(self, conn: _Connection) -> None:
        reader = conn.reader
        self.status = reader.status
        self.content_type = reader.content_type
        self.retry_after = reader.retry_after
        self._conn = conn
        self.complete = False

    async def read_some(self, deadline: float = math.inf) -> bytes | None:
        """Every body byte that has arrived, waiting for at least one; ``None``
        once the body has ended.

        Returning all that one socket read brought (not one chunk at a
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
        reader = conn.reader
        body = reader.body
        while True:
            if body:
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                reader.received += len(data)
                self.complete = reader.end
                return data
            if reader.end:
                self.complete = True
                return None
            try:
                data = await conn.stream.receive(RECEIVE_SIZE, deadline)
            except OSError as exc:
                raise _lost(exc) from None
            if not data:
                if data is None:
                    raise TimedOut("deadline passed waiting for the worker")
                reader.closed()
                continue
            reader.feed(data)
            if body or reader.end:
                reader.fed = 0
            else:
                reader.stalled(len(data))

    async def read(self, deadline: float = math.inf) -> bytes:
        """The whole body, by ``deadline`` (as for :meth:`read_some`)."""
        parts = []
        while (data := await self.read_some(deadline)) is not None:
            parts.append(data)
        return b"".join(parts)


def _lost(exc: OSError) -> WorkerDisconnected:
    return WorkerDisconnected(f"connection to worker lost: {exc!r}")


async def _next_response(conn: _Connection, deadline: float) -> None:
    """Read until ``conn.reader`` has the final response head."""
    reader = conn.reader
    # Called right after the request went out: its first read would find nothing.
    wait_first = True
    while not reader.head:
        try:
            data = await conn.stream.receive(RECEIVE_SIZE, deadline, wait_first)
        except OSError as exc:
            raise _lost(exc) from None
        wait_first = False
        if not data:
            if data is None:
                raise TimedOut("deadline passed waiting for the worker")
            raise WorkerDisconnected("worker closed the connection before answering")
        reader.feed(data)
        if not reader.head:
            reader.stalled(len(data))
    if reader.chunked is False:  # llhttp would read it to the close
        raise WorkerDisconnected("worker broke HTTP/1.1: Only Transfer-Encoding: chunked is supported")
    reader.fed = 0


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

    async def _send(self, conn: _Connection, data: bytes) -> None:
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
            ValueError: the method, ``path`` or a header cannot be written
                as HTTP/1.1 (nothing is sent).
        """
        return _Exchange(self, (method, path, body, headers, head_deadline, idempotent))

    async def _release(self, conn: _Connection, ok: bool) -> None:
        reader = conn.reader
        conn.reader = None
        reader.drop()
        if ok and reader.end and reader.keep_alive and not reader.excess:
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
        # Built (and checked) before a connection is taken: a request that
        # cannot be written costs no connection.
        data = _request_head(method, path, pool._host_header, len(body), headers) + body
        reader_class = _HeadReader if method == b"HEAD" else _Reader
        conn = await pool._take_idle()
        # An idempotent request on a reused connection may be sent once more.
        retry = idempotent and conn is not None
        if conn is None:
            conn = await pool._connect()
        while True:
            conn.reader = reader_class()
            try:
                await pool._send(conn, data)
                await _next_response(conn, head_deadline)
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
        self.response = Response(conn)
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
