"""Workarounds for four connection-level bugs in hypercorn's HTTP/1.1
server (hypercorn 0.18.0; every worker class), installed by
:func:`asgi_generate.server.hypercorn.patches.install`; each bug's report for
hypercorn's tracker and the test that shows it are in ``UPSTREAM.md``.

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

import socket
import struct
from dataclasses import dataclass

import h11
from hypercorn.events import RawData
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream

from .. import spread
from .lean import AppQueue, TrioAppQueue
from ...request.watchdog import CONNECTION_RESET, DISCONNECT_WATCH, RECEIVE_NOWAIT

#: Bytes of empty lines behind a request that do not stop hypercorn reading.
STRAY_CRLF_BYTES = 4
#: ``SO_LINGER`` on with a timeout of 0 s (``struct linger``): close() resets.
_LINGER_0 = struct.pack("ii", 1, 0)


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
    of a client it is answering (the half-close policy above)."""

    @property
    def they_are_waiting_for_100_continue(self) -> bool:
        # hypercorn sends the 100 eagerly whenever this is true; the app's
        # first receive() sends it instead (bug 4 above).
        return False

    def receive_data(self, data: bytes) -> None:
        if data and self.their_state is h11.MUST_CLOSE:
            return
        super().receive_data(data)

    def next_event(self):
        if self.their_state is h11.MUST_CLOSE:
            return h11.NEED_DATA
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


class ClientGone(ConnectionError):
    """``send()`` of a response message on a connection the client closed;
    nothing of the message reached the socket (bug 3 above)."""


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
