"""Workarounds for connection-level bugs in hypercorn's HTTP/1.1
server (hypercorn 0.18.0 on h11; every worker class), installed by
:func:`asgi_generate.server.hypercorn.patches.install`; each bug's report for
hypercorn's tracker and the test that shows it are in ``UPSTREAM.md``,
numbered as there (5 and 6 are the half-close policy at the end).

1. **Closed connections linger in CLOSE-WAIT.** ``TCPServer.run`` (in
   ``hypercorn/trio/tcp_server.py`` and ``hypercorn/asyncio/tcp_server.py``)
   only closes the socket once its task group is empty, and the keep-alive
   idle task (``_idle_timeout``) sits in that group for
   ``keep_alive_timeout`` seconds. A client that closes an idle keep-alive
   connection ends ``_read_data``, but the socket stays open until the idle
   task times out. Our connections (:mod:`asgi_generate.server.hypercorn.trio_serve`,
   :mod:`asgi_generate.server.hypercorn.asyncio_serve`) stop the keep-alive wait once
   the read loop has ended (and never restart it), so the socket is closed
   as soon as the app's task, if any, is done.

2. **``Connection: close`` followed by more bytes.** Once a request that
   carries ``Connection: close`` is read, h11 puts the client in
   ``MUST_CLOSE`` and treats any further byte (a pipelined request, a stray
   CRLF) as a protocol error; ``H11Protocol._handle_events`` then answers an
   empty 400 and closes the connection while the app is still serving the
   first request, whose answer is lost. RFC 9112 section 9.6 says the server
   answers that request, then closes, and does not process further requests:
   :class:`_EdgeConnection` discards what follows instead.

3. **Writes to a client that is gone vanish.** ``HTTPStream.app_send`` hands
   every response message on, and ``TCPServer.protocol_send`` swallows the
   error of a socket that is closed or broken, so the app cannot tell sent
   bytes from dropped ones. :class:`_HTTPStream` raises :class:`ClientGone`
   instead, as the ASGI HTTP spec asks of a ``send()`` on a closed connection
   ("a server-specific subclass of OSError"), for a message sent once the
   connection is closed. (A write that is under way when the client leaves
   went out as far as the server can tell: it counts as sent.) Only apps
   that handle it get this (``install(send_errors=True)``); the simulator
   keeps generating for a vanished client, as engines do until aborted.

4. **``100 Continue`` goes out before the app can refuse.** ``H11Protocol.
   _handle_events`` sends it as soon as the request head is parsed, so an
   app that refuses on the headers alone (413 for an over-cap
   ``Content-Length``) cannot stop the client's upload. RFC 9110 section
   10.1.1 lets a server answer the final status instead: the 100 is sent on
   the app's first ``receive()`` (as uvicorn does) by :class:`_LazyContinue`,
   and never if the app answers without reading.

7. **Ambiguous framing is served, and the connection kept.** h11 frames a
   request that carries both ``Transfer-Encoding: chunked`` and
   ``Content-Length`` by the former and keeps the connection open, so what
   a proxy framing by ``Content-Length`` took for the body is served as the
   next request (request smuggling); it also unfolds obsolete line folding
   and serves a ``Transfer-Encoding`` in an HTTP/1.0 request. RFC 9112
   sections 6.1 and 6.3 ask the server to refuse or close. Before h11
   parses a head, :class:`_EdgeConnection` refuses one whose framing could
   be read two ways (:func:`framing_problem`): 400 (501 for a coding before
   ``chunked``), ``connection: close``, nothing after it read, the app
   never called.

8. **A request head has no deadline of its own.** hypercorn's keep-alive
   timer runs until a head is complete, so a client that sends a header
   line now and then holds its connection for ``keep_alive_timeout``
   seconds, every connection it opens. With
   :data:`header_read_timeout` set, a head is due that many seconds after
   accept (a connection's first request) or after its first byte (a later
   one; an idle keep-alive connection keeps the keep-alive timeout until
   then): :class:`HeadDeadline` arms the connection's timer in place of
   the keep-alive one, and at the deadline :class:`_H11Protocol` answers
   408 with ``connection: close`` and closes (a connection that sent no
   byte is closed without an answer, as at a keep-alive timeout).

Both closes are counted (:mod:`.edge_counts`).

One addition: hypercorn tells an app of a closed connection only through
``receive()``, so an app must keep a task waiting on it per request just to
notice a disconnect. The scope's extension ``asgi_generate.disconnect_watch``
(:data:`asgi_generate.request.watchdog.DISCONNECT_WATCH`, on HTTP/1.1 and h2
streams alike) takes a callback instead,
called once when the connection closes (at once if it is closed already;
``None`` stops the watch); ``http.disconnect`` still reaches ``receive()``.

Another: hypercorn can only close a connection gracefully, and on trio not
while a write is stuck on a client that stopped reading (``TCPServer.
protocol_send`` shields it), so a client the app cuts off keeps its socket,
the bytes queued for it, and the app's task. The scope's extension
``asgi_generate.connection_reset``
(:data:`asgi_generate.request.watchdog.CONNECTION_RESET`, on HTTP/1.1: an
h2 connection carries other streams) closes the connection at once with a
TCP reset (:func:`reset_on_close`): the kernel drops what it buffers for
the client and a stuck write ends.

One more for ``serve --workers N``: a process holding more than its share
of its siblings' keep-alive connections asks the client of its next answer
to close the connection after it, by hypercorn's own ``connection: close``
at ``keep_alive_max_requests`` (:mod:`asgi_generate.server.spread`).

One saving: hypercorn writes a response's head as soon as the app sends
``http.response.start``, then its body in a second write: two ``send``
syscalls and two loopback segments per unary answer. For a response with a
``content-length`` (whose body the app sends right behind its start) the head
waits for the body's bytes and both go out in one write (:class:`_H11Protocol`);
a streamed head still goes out at once.

And one policy: a client that closes its sending side (``shutdown(SHUT_WR)``)
has disconnected, as nginx treats it. hypercorn already hands the app
``http.disconnect`` on end of stream, with two exceptions that
:class:`_EdgeConnection` removes:

- Mid-body, h11 reports an incomplete message and hypercorn answers an empty
  400 the app never sees (its record would say ``client_disconnect``): it is
  reported as a plain end of stream instead, and nothing is sent.
- After a stray CRLF behind a complete request, h11 pauses and hypercorn stops
  reading the socket until the answer is complete, so a half-close arriving
  meanwhile goes unseen and the stream runs to its end. RFC 9112 section 2.2
  lets a server ignore empty lines before a request-line: up to
  ``STRAY_CRLF_BYTES`` of them do not pause reading. (A pipelined request
  still does: hypercorn reads the connection again after the current answer.)
"""

from __future__ import annotations

import re
import socket
import struct
from dataclasses import dataclass

import h11
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.events import Body, EndBody, Response, StreamClosed
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream

from ...exceptions import ClientGone
from . import edge_counts
from .. import spread
from .lean import AppQueue, TrioAppQueue
from ...request.watchdog import CONNECTION_RESET, DISCONNECT_WATCH, RECEIVE_NOWAIT

#: Bytes of empty lines behind a request that do not stop hypercorn reading.
STRAY_CRLF_BYTES = 4
#: ``SO_LINGER`` on with a timeout of 0 s (``struct linger``): close() resets.
_LINGER_0 = struct.pack("ii", 1, 0)
#: The end of a request head, as h11 finds it (``blank_line_regex`` in
#: ``h11/_receivebuffer.py``: lines may end in LF alone).
_HEAD_END = re.compile(rb"\n\r?\n")
#: The lines of a request head :func:`framing_problem` reads: a folded
#: line, a line that starts with a framing header's name.
_FRAMING_LINE = re.compile(rb"\n(?:[ \t]|transfer-encoding|content-length)[^\n]*", re.IGNORECASE)
#: A plain ``Content-Length`` line: one number.
_PLAIN_LENGTH = re.compile(rb"\ncontent-length:[ \t]*[0-9]+[ \t]*\r?", re.IGNORECASE)
#: Seconds a client has to send a request head (:class:`HeadDeadline`);
#: ``None``: no deadline of its own, as in hypercorn. Set by
#: :func:`asgi_generate.server.hypercorn.patches.install`.
header_read_timeout: float | None = None


def framing_problem(head: bytes) -> tuple[int, str] | None:
    """Why a request head must be refused for its framing, as ``(status,
    reason)``, or ``None``. ``head`` is a request head up to and including
    its blank line, its lines ended by CRLF or LF alone, as h11 reads them.

    400 (RFC 9112) for: obsolete line folding, a header line that starts
    with SP or HTAB (section 5.2 lets a server refuse it rather than unfold
    it; a proxy may read the folded line otherwise); whitespace between
    ``Transfer-Encoding`` or ``Content-Length`` and its colon (section 5.1);
    a ``Transfer-Encoding`` in an HTTP/1.0 request (section 6.1: its framing
    is faulty); ``Transfer-Encoding`` beside ``Content-Length`` (sections
    6.1 and 6.3: the server must close the connection after it); a
    transfer coding list (every ``Transfer-Encoding`` line, joined) whose
    last coding is not ``chunked``, that names ``chunked`` twice or has an
    empty element (section 6.3: the length cannot be determined); a
    ``Content-Length`` element that is not decimal digits, or several that
    differ (section 6.3; the same value repeated is read as one, as RFC 9110
    section 8.6 and h11 allow). 501 for a coding before a final ``chunked``
    (section 6.1: a coding the server does not implement; ``chunked`` is
    the only one). h11 (``normalize_and_validate`` in ``h11/_headers.py``)
    refuses most of these too, with 400 or 501, after this check: what it
    alone refuses (a header line it cannot read, a length of more than 20
    digits) is not framing this function reads two ways."""
    lines = _FRAMING_LINE.findall(head)
    if not lines or (len(lines) == 1 and _PLAIN_LENGTH.fullmatch(lines[0])):
        return None  # the common head, read by one regular expression: no loop per line
    lines = head.split(b"\n")
    version = lines[0].rstrip(b"\r").rpartition(b" ")[2]
    codings: list[bytes] = []
    values: list[bytes] = []
    for line in lines[1:]:
        line = line.rstrip(b"\r")
        if not line:
            break
        if line[:1] in (b" ", b"\t"):
            return 400, "obsolete line folding in the request head"
        name, _, value = line.partition(b":")
        name = name.lower()
        if name != name.rstrip(b" \t") and name.rstrip(b" \t") in (b"transfer-encoding", b"content-length"):
            return 400, "whitespace before the colon of a framing header"
        if name == b"transfer-encoding":
            codings += (c.strip(b" \t").lower() for c in value.split(b","))
        elif name == b"content-length":
            values += (v.strip(b" \t") for v in value.split(b","))
    if codings:
        if version[:5] == b"HTTP/" and version[5:] < b"1.1":
            return 400, "Transfer-Encoding in an HTTP/1.0 request"
        if values:
            return 400, "both Transfer-Encoding and Content-Length"
        if codings[-1] != b"chunked" or b"chunked" in codings[:-1] or b"" in codings:
            return 400, "Transfer-Encoding whose last coding is not chunked, once"
        if len(codings) > 1:
            return 501, "a transfer coding other than chunked"
    elif values:
        if not all(v.isdigit() for v in values):
            return 400, "a Content-Length that is not a number"
        if len(set(values)) > 1:
            return 400, "differing Content-Length values"
    return None


@dataclass(frozen=True)
class HeadDeadline(Event):
    """From the HTTP/1.1 protocol to its connection: a request head is due
    within :data:`header_read_timeout` seconds from now (from accept for a
    connection's first request, else from the head's first byte); the
    connection arms its timer (once per head) in place of the keep-alive
    one, which ``Updated(idle=False)`` (the head is complete) stops as
    before, and feeds :class:`HeadTimedOut` to the protocol at the deadline."""


@dataclass(frozen=True)
class HeadTimedOut(Event):
    """From a connection to its HTTP/1.1 protocol: the request head's
    deadline passed (:class:`HeadDeadline`). ``writable``: a 408 can be
    written without waiting (the client has left room for it); if not, the
    connection resets and closes unanswered rather than wait for a client
    that does not read."""

    writable: bool = True


def reset_on_close(sock: socket.socket) -> None:
    """Make closing ``sock`` a TCP reset (``SO_LINGER`` on, 0 s): the kernel
    drops at once what it still holds for the peer, instead of keeping an
    orphaned socket with its queue for as long as the peer does not read."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
    except OSError:  # closed already
        pass


class _EdgeConnection(h11.Connection):
    """An h11 server connection that ignores what a client sends after the
    request that ended its keep-alive (bug 2 above; the bytes already
    buffered stay there, at most one socket read, until the connection
    closes, later ones are dropped on arrival), and sees every end of stream
    of a client it is answering (the half-close policy above).

    It also reads each request head before h11 parses it and refuses one
    whose framing is ambiguous (bug 7 above, :func:`framing_problem`): ``next_event``
    raises ``RemoteProtocolError`` with the status to answer, on which
    hypercorn answers it with ``connection: close`` and closes; nothing the
    client sent after it is read (:meth:`stop_reading`)."""

    #: The bytes of the request head being received while it is incomplete
    #: (``b""``: none yet), ``None`` once it is complete (or between heads).
    _head: bytes | bytearray | None = b""
    #: What :func:`framing_problem` found wrong with the head, to raise.
    _refusal: tuple[int, str] | None = None
    #: Nothing more is read (:meth:`stop_reading`).
    _stopped = False

    @property
    def they_are_waiting_for_100_continue(self) -> bool:
        # hypercorn sends the 100 eagerly whenever this is true; the app's
        # first receive() sends it instead (bug 4 above).
        return False

    @property
    def head_started(self) -> bool:
        """Some bytes of a request head arrived, not all of it."""
        return bool(self._head)

    def stop_reading(self) -> None:
        """Read nothing more: the connection is closing (a refused head, a
        head past its deadline)."""
        self._stopped = True
        self._head = None

    def receive_data(self, data: bytes) -> None:
        if data and (self._stopped or self.their_state is h11.MUST_CLOSE):
            return
        if data and self._head is not None:
            self._read_head(data)
        super().receive_data(data)

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self._head = b""
        pipelined = self.trailing_data[0]
        if pipelined:
            self._read_head(pipelined)

    def _read_head(self, data: bytes) -> None:
        # A blank line may straddle two reads ("\r\n" then "\r\n").
        head = self._head
        start = max(len(head) - 2, 0)
        if head:
            head += data
        else:
            head = data  # the common case: a whole head in one read, not copied
        end = _HEAD_END.search(head, start)
        if end is None:
            self._head = head if isinstance(head, bytearray) else bytearray(head)
            return
        self._head = None
        self._refusal = framing_problem(bytes(head[:end.end()]))

    def next_event(self):
        if self._stopped or self.their_state is h11.MUST_CLOSE:
            return h11.NEED_DATA
        if self._refusal is not None:
            (status, reason), self._refusal = self._refusal, None
            self.stop_reading()
            edge_counts.closed["ambiguous_framing"] += 1
            raise h11.RemoteProtocolError(reason, error_status_hint=status)
        mid_body = self.their_state is h11.SEND_BODY
        try:
            event = super().next_event()
        except h11.RemoteProtocolError:
            if mid_body and self.trailing_data[1]:  # end of stream: the client left mid-body
                return h11.ConnectionClosed()
            raise
        if event is h11.PAUSED and self.their_state is h11.DONE:
            data, closed = self.trailing_data
            if len(data) <= STRAY_CRLF_BYTES and not data.strip(b"\r\n"):
                # Empty lines only: keep reading, so an end of stream is seen.
                return h11.ConnectionClosed() if closed else h11.NEED_DATA
        return event


@dataclass(frozen=True)
class _Continue(StreamEvent):
    """The app asked for the request body: time for a pending 100."""


#: The extensions a stream gives its app, dropped once the app returned.
_STREAM_EXTENSIONS = (DISCONNECT_WATCH, CONNECTION_RESET, RECEIVE_NOWAIT)


class _LazyContinue:
    """Wraps hypercorn's app wrapper so the app's first ``receive()`` asks
    the protocol for the ``100 Continue`` (bug 4 above). A plain call that
    returns the app's coroutine: no frame of its own stays alive for as
    long as the request does, nor one of hypercorn's ``ASGIWrapper`` (its
    ``__call__`` only awaits the app), nor (through its ``dispatch``) one of
    :class:`asgi_generate.server.app.App`'s."""

    __slots__ = ("app", "stream")

    def __init__(self, app, stream: HTTPStream) -> None:
        self.app = app
        self.stream = stream

    def __call__(self, scope, receive, send, sync_spawn, call_soon):
        # Called once per stream: the stream is not kept (it holds this
        # wrapper; a reference cycle left for the cycle collector).
        stream, self.stream = self.stream, None
        extensions = scope.setdefault("extensions", {})
        extensions[DISCONNECT_WATCH] = stream.watch_disconnect
        if scope["http_version"] != "2":  # an h2 connection carries other streams
            extensions[CONNECTION_RESET] = stream.reset_connection
        receive = _FirstReceive(stream, receive)
        if isinstance(getattr(receive.receive, "__self__", None), (AppQueue, TrioAppQueue)):
            extensions[RECEIVE_NOWAIT] = receive.nowait
        if type(self.app) is ASGIWrapper:
            app = self.app.app
            # App's dispatch: the handler's coroutine itself, no frame of App's.
            dispatch = getattr(app, "dispatch", app)
            return dispatch(scope, receive, send)
        return self.app(scope, receive, send, sync_spawn, call_soon)


class _FirstReceive:
    """``receive()`` that sends a pending 100 first, once."""

    __slots__ = ("stream", "receive")

    def __init__(self, stream: HTTPStream, receive) -> None:
        self.stream = stream
        self.receive = receive

    async def __call__(self):
        if self.stream is not None:
            stream, self.stream = self.stream, None
            await stream.send(_Continue(stream_id=stream.stream_id))
        return await self.receive()

    def nowait(self):
        """The :data:`~asgi_generate.request.watchdog.RECEIVE_NOWAIT`
        extension, over :mod:`asgi_generate.server.hypercorn.lean`'s app
        queues: the next message if it is queued, else ``None``. A message
        already there makes a pending 100 moot: none is sent then."""
        message = self.receive.__self__.get_nowait()
        if message is not None:
            self.stream = None
        return message


class _LazyContinueStream(HTTPStream):
    def __init__(self, app, *args, **kwargs) -> None:
        super().__init__(app, *args, **kwargs)
        self.app = _LazyContinue(app, self)
        self.on_disconnect = None

    def watch_disconnect(self, callback) -> None:
        """Call ``callback()`` once the connection closes (the disconnect
        watch above); ``None`` stops watching."""
        if callback is not None and self.closed:
            callback()
        else:
            self.on_disconnect = callback

    def reset_connection(self) -> None:
        """Close the client's connection at once with a TCP reset (the
        extension above): ``reset()`` of the connection serving it
        (:class:`asgi_generate.server.hypercorn.asyncio_serve.Connection`,
        :class:`asgi_generate.server.hypercorn.trio_serve.TCPServer`, the
        task group hypercorn hands its streams)."""
        self.task_group.reset()

    async def app_send(self, message) -> None:
        try:
            await super().app_send(message)
        finally:
            if message is None:
                # The app has returned: nothing calls the extensions it was
                # given again. They are bound methods of this stream (and
                # of its receive), held by its scope: reference cycles that
                # only the cycle collector would free, about 20 objects a
                # request, whose runs cost about 30 µs of CPU a unary
                # request on asyncio (bench/README.md, bench_hop_split.py).
                extensions = self.scope["extensions"]
                for key in _STREAM_EXTENSIONS:
                    extensions.pop(key, None)

    async def handle(self, event: StreamEvent) -> None:
        await super().handle(event)
        if self.closed and self.on_disconnect is not None:
            callback, self.on_disconnect = self.on_disconnect, None
            callback()


class _HTTPStream(_LazyContinueStream):
    async def app_send(self, message) -> None:
        if self.closed and message is not None and self.state is not ASGIHTTPState.CLOSED:
            raise ClientGone("the client closed the connection")
        await super().app_send(message)


class _H11Protocol(H11Protocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.connection = _EdgeConnection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )

    #: A fixed-length response's head, held for its body's write.
    _head: bytes | None = None

    async def initiate(self) -> None:
        # The first request's head is due from accept.
        if header_read_timeout is not None:
            await self.send(HeadDeadline())

    async def handle(self, event: Event) -> None:
        if type(event) is HeadTimedOut:
            await self._head_timed_out(event.writable)
            return
        await super().handle(event)
        if type(event) is RawData and event.data and header_read_timeout is not None:
            await self._head_due()

    async def _head_due(self) -> None:
        # A head begun and not complete (the connection arms its deadline
        # once per head; a whole head in one read needs none).
        connection = self.connection
        if isinstance(connection, _EdgeConnection) and connection.head_started:
            await self.send(HeadDeadline())

    async def _head_timed_out(self, writable: bool) -> None:
        connection = self.connection
        if (not isinstance(connection, _EdgeConnection) or connection.their_state is not h11.IDLE
                or connection.our_state is not h11.IDLE):
            return  # the head came meanwhile: a request is being served
        started = connection.head_started
        if not started and self.keep_alive_requests:
            # An idle keep-alive connection (a deadline armed as its last
            # request's head completed): the keep-alive timeout is its own.
            await self.send(Updated(idle=True))
            return
        connection.stop_reading()
        edge_counts.closed["header_timeout"] += 1
        if started and writable:
            # RFC 9110 section 15.5.9; a client that sent nothing gets no
            # answer it could take for its next request's, as at a
            # keep-alive timeout.
            await self._send_error_response(408)
        await self.send(Closed())

    async def stream_send(self, event: StreamEvent) -> None:
        if isinstance(event, _Continue):
            # Still owed only if the client sent no body byte and no final
            # answer went out meanwhile (h11 clears the flag on either).
            if self.connection.client_is_waiting_for_100_continue:
                await self._send_h11_event(
                    h11.InformationalResponse(status_code=100, headers=self.config.response_headers("h11"))
                )
            return
        if self._head is not None and not isinstance(event, (Body, EndBody)):
            head, self._head = self._head, None  # no body came: the head alone
            await self.send(RawData(data=head))
        elif (type(event) is Response and event.status_code >= 200 and spread.current is not None
              and spread.current.ask_to_close()):
            # hypercorn answers "connection: close" at its keep-alive limit
            self.keep_alive_requests = self.config.keep_alive_max_requests
        await super().stream_send(event)
        if type(event) is StreamClosed and header_read_timeout is not None:
            await self._head_due()  # part of a pipelined head came with the last request

    async def _send_h11_event(self, event) -> None:
        if type(event) is h11.Response and any(name == b"content-length" for name, _ in event.headers):
            try:
                self._head = self.connection.send(event)
            except h11.LocalProtocolError:
                if self.connection.their_state != h11.ERROR:
                    raise
            return
        if self._head is None:
            await super()._send_h11_event(event)
            return
        head, self._head = self._head, None
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            await self.send(RawData(data=head))
            if self.connection.their_state != h11.ERROR:
                raise
        else:
            await self.send(RawData(data=head + data))
