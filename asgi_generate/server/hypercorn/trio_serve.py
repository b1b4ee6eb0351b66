"""hypercorn's trio connection (hypercorn 0.18.0, ``TCPServer`` in
``hypercorn/trio/tcp_server.py``) in one task with no nursery of its own,
installed by :func:`asgi_generate.server.hypercorn.patches.install`.

hypercorn runs each connection's task under a nursery of its own (its trio
``TaskGroup``) for the app call and the keep-alive task: a nursery, its
cancel scope and a cancel status holding two sets, about 1.5 KB of every
open SSE stream, and three coroutine frames deep in reading (``run``,
``_read_data``, a subclass's). :class:`TCPServer` starts those tasks in the
nursery that runs the connection itself (trio's ``serve_listeners`` handler
nursery, which hypercorn's graceful shutdown already waits on, with its
deadline), counts them, and waits for them before it closes the socket, as
hypercorn's nursery did; it reads in ``run``'s own frame, on plain TCP with
``wait_readable`` and the socket's ``recv`` rather than
``SocketStream.receive_some`` (about 1.7 KB of frames and context managers
per parked read): about 3.7 KB less per open SSE stream (UPSTREAM.md,
"Per-connection memory").

Kept from hypercorn: the TLS handshake and its timeout, ALPN and the h2
protocols (hypercorn's ``ProtocolWrapper``), ``read_timeout`` when set (reads
through ``SocketStream.receive_some`` then, and over TLS), the
keep-alive task, the send lock, ``Closed`` for writes that fail, and (bug 1
of :mod:`asgi_generate.server.hypercorn.fixes`) no keep-alive wait once the client's
end of stream is read. Changed: a connection whose reading fails with an
``OSError`` tells its protocol it is ``Closed`` (the app sees the
disconnect) instead of cancelling the app's task; one closed while idle
reads nothing more, and in a graceful shutdown one on which a request has
begun is not taken for an idle one (:mod:`.graceful`). Added: the request
head's deadline (:class:`asgi_generate.server.hypercorn.fixes.HeadDeadline`:
the keep-alive task waits for it instead while a head is due).
"""

from __future__ import annotations

import select
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.trio import tcp_server as trio_tcp_server
from hypercorn.utils import parse_socket_addr

from . import fixes, graceful, lean
from .. import spread
from ...workers.sockets import recv_nowait

#: Bytes asked of one socket read (hypercorn's ``MAX_RECV``).
MAX_RECV = 2**16


class TCPServer(trio_tcp_server.TCPServer):
    """One client connection on trio, and the task group its protocol
    starts the app calls in (module docstring)."""

    def __init__(self, app: Any, config: Any, context: Any, state: Any, stream: Any) -> None:
        # What hypercorn's __init__ sets (patches.REPLACED_INITS checks it sets
        # no other), with lean's lock and keep-alive task holder.
        self.app = app
        self.config = config
        self.context = context
        self.state = state
        self.stream = stream
        self.protocol: ProtocolWrapper | None = None
        self.send_lock = lean.TrioLock()
        self.idle_task = lean.TrioSingleTask()
        self._task_group = self
        self._nursery: trio.Nursery | None = None
        self._running = 0
        self._waiters: list | None = None
        self._reading_done = False
        #: The keep-alive task waits for a request head's deadline instead.
        self._heading = False
        #: Closed while idle: nothing it reads is handed on.
        self._closing = False

    async def run(self) -> None:
        stream = self.stream
        if isinstance(stream, trio.SSLStream):
            try:
                with trio.fail_after(self.config.ssl_handshake_timeout):
                    await stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                return  # handshake failed (hypercorn's own handling)
            alpn, sock, ssl = stream.selected_alpn_protocol(), stream.transport_stream.socket, True
        else:
            alpn, sock, ssl = "http/1.1", stream.socket, False
        self._nursery = trio.lowlevel.current_task().parent_nursery
        table = spread.current
        if table is not None:
            table.opened()
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
            self.protocol = ProtocolWrapper(self.app, self.config, self.context, self, self.state, ssl,
                                            client, server, self.protocol_send, alpn)
            await self.protocol.initiate()  # HTTP/1.1: the first head's deadline (fixes.HeadDeadline)
            if not self._heading:
                await self.idle_task.restart(self, self._idle_timeout)
            timeout = self.config.read_timeout
            # Plain TCP with no read_timeout: the socket read and
            # wait_readable themselves, not SocketStream.receive_some's
            # wrappers (its frames and context managers, ~1.7 KB per
            # parked connection).
            raw = None if ssl or timeout is not None else getattr(stream.socket, "_sock", None)
            while True:
                try:
                    if raw is not None:
                        # The checkpoint before the read: no other task
                        # (the idle one closing) runs while bytes it read
                        # wait to reach the protocol.
                        await trio.lowlevel.checkpoint()
                        data = recv_nowait(raw, MAX_RECV)
                        while data is None:
                            await trio.lowlevel.wait_readable(raw)
                            data = recv_nowait(raw, MAX_RECV)
                    elif timeout is None:
                        data = await stream.receive_some(MAX_RECV)
                    else:
                        with trio.fail_after(timeout):
                            data = await stream.receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError, OSError):
                    break
                if self._closing:  # read as it closed (TLS, read_timeout): never half read
                    break
                await self.protocol.handle(RawData(bytes(data)))
                if not data:
                    break
            await self.protocol.handle(Closed())
            self._reading_done = True
            await self.idle_task.stop()
            await self._tasks_done()
        except OSError:
            if self.protocol is not None:
                await self.protocol.handle(Closed())
        finally:
            if table is not None:
                table.closed()
            await self._close()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated):
            if self._reading_done and event.idle:
                return  # nobody left to keep alive for (bug 1)
            self._heading = False
        elif isinstance(event, fixes.HeadDeadline):
            if not (self._heading or self._reading_done):
                self._heading = True
                await self.idle_task.restart(self, self._head_timeout)
            return
        await super().protocol_send(event)

    async def _head_timeout(self) -> None:
        # The keep-alive task while a request head is due: at its deadline
        # the protocol answers (or not) and closes; when the server shuts
        # down first, closed as an idle connection (hypercorn's _idle_timeout).
        with trio.move_on_after(fixes.header_read_timeout) as deadline:
            await self.context.terminated.wait()
            # A shutdown: a head begun is read and answered, within its deadline.
            if graceful.request_begun(self.protocol, self._socket().fileno()):
                await trio.sleep_forever()
        with trio.CancelScope(shield=True):
            self._heading = False
            if not deadline.cancelled_caught:
                self._closing = True
                await self._initiate_server_close()
                return
            # A write waits (shielded) for as long as the client leaves the
            # socket's buffer full: answer only if there is room now, else
            # reset (the kernel drops what it holds for the client) unanswered.
            try:
                writable = bool(select.select([], [self._socket()], [], 0)[1])
            except (OSError, ValueError):  # closed meanwhile
                writable = False
            if not writable:
                self.reset()
            await self.protocol.handle(fixes.HeadTimedOut(writable))

    async def _idle_timeout(self) -> None:
        # hypercorn's: idle past keep_alive_timeout, or the server is
        # shutting down. Here, in a shutdown, a request begun on it is read
        # and answered first (graceful.request_begun); else nothing more it
        # reads is handed on (an idle h11 protocol takes Closed without
        # yielding, so a plain socket closes before anything is read).
        with trio.move_on_after(self.config.keep_alive_timeout):
            await self.context.terminated.wait()
        if self.context.terminated.is_set() and graceful.request_begun(self.protocol, self._socket().fileno()):
            return
        self._closing = True
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()

    def reset(self) -> None:
        """Close the connection at once with a TCP reset, dropping what is
        buffered for the client (the app cut it off): a write stuck on it
        (hypercorn shields them) and the read both end, as on a client that
        closed."""
        sock = self._socket()
        fixes.reset_on_close(sock)
        sock.close()  # trio's: wakes every task waiting on it first

    def _socket(self) -> trio.socket.SocketType:
        stream = self.stream
        return stream.transport_stream.socket if isinstance(stream, trio.SSLStream) else stream.socket

    # hypercorn's trio TaskGroup, on the connection's parent nursery

    async def spawn_app(self, app: Any, config: Any, scope: dict,
                        send: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        """hypercorn's ``TaskGroup.spawn_app`` with
        :class:`asgi_generate.server.hypercorn.lean.TrioAppQueue` for its memory
        channel."""
        queue = lean.TrioAppQueue(config.max_app_queue_size)
        call = app(scope, queue.get, send, trio.to_thread.run_sync, trio.from_thread.run)
        self._running += 1
        self._nursery.start_soon(self._call_app, call, send)
        return queue.put

    def spawn(self, func: Callable, *args: Any) -> None:
        """Run ``func(*args)`` in a task the connection waits for before it
        closes."""
        self._running += 1
        self._nursery.start_soon(self._counted, func, args)

    async def _counted(self, func: Callable, args: tuple) -> None:
        try:
            await func(*args)
        finally:
            self._task_ended()

    async def _call_app(self, call: Awaitable[None], send: Callable[[Any], Awaitable[None]]) -> None:
        # hypercorn's trio _handle (hypercorn/trio/task_group.py) with the app
        # called already: one frame fewer for as long as the request lives.
        try:
            try:
                await call
            except trio.Cancelled:
                raise
            except BaseExceptionGroup as error:
                _, other_errors = error.split(trio.Cancelled)
                if other_errors is None:
                    raise
                await self.config.log.exception("Error in ASGI Framework")
            except Exception:
                await self.config.log.exception("Error in ASGI Framework")
            finally:
                await send(None)
        finally:
            self._task_ended()

    def _task_ended(self) -> None:
        self._running -= 1
        if not self._running and self._waiters:
            lean.unpark_one(self._waiters)

    async def _tasks_done(self) -> None:
        while self._running:
            if self._waiters is None:
                self._waiters = []
            await lean.park(self._waiters)
