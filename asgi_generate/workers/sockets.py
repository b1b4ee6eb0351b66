"""A TCP connection to a worker as a bare non-blocking socket, awaited
through the event loop's own readiness calls.

An open SSE stream holds one engine connection for its whole life. anyio's
own socket stream wraps it in more objects than the connection itself: on
asyncio a transport plus a protocol holding a read queue and two events
(three deques, about 3 KB per connection), on trio the socket wrappers of
both libraries. :class:`TCPConnection` keeps the socket alone. Even
``anyio.wait_readable`` costs an open stream 1.7 KB on asyncio (its
coroutine, a closure, a per-task dict entry) and the caller's deadline
another anyio cancel scope (0.9 KB); a read here waits with what the loop
itself needs (asyncio: one future, the reader callback and, with a
deadline, one timer, awaited in :meth:`TCPConnection.receive`'s own frame;
trio: the socket in :mod:`asgi_generate.workers.trio_poller`'s epoll set,
its deadline in that poller's heap). On asyncio the socket stays in the
loop's selector between reads, so a request on a kept connection costs no
``epoll_ctl(2)``; the first read of an answer waits before it reads
(``wait_first``). Writes and connects are short and
still go through ``anyio.wait_writable``.
:class:`TLSConnection` gives an ``https://`` worker's anyio TLS stream the
same interface.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import ipaddress
import math
import os
import select
import socket

import anyio
import sniffio
import trio
from anyio.lowlevel import checkpoint

from . import trio_poller

#: The (empty) context a read's deadline timer runs its callback in:
#: without it, asyncio copies the task's context for each timer.
_NO_CONTEXT = contextvars.Context()


def _wake(waiter: asyncio.Future, readable: bool) -> None:
    if not waiter.done():
        waiter.set_result(readable)


def _readable(
    loop: asyncio.AbstractEventLoop, fd: int, deadline: float
) -> tuple[asyncio.Future, asyncio.TimerHandle | None]:
    """asyncio: a future set to ``True`` once ``fd`` is readable, ``False``
    at ``deadline`` (the loop's clock, ``anyio.current_time()``), and the
    deadline's timer; the caller awaits it, then parks the socket's reader
    (:func:`_parked`) and cancels the timer however the wait ended."""
    waiter = loop.create_future()
    loop.add_reader(fd, _wake, waiter, True)
    timer = None if deadline == math.inf else loop.call_at(deadline, _wake, waiter, False, context=_NO_CONTEXT)
    return waiter, timer


def _parked(conn: TCPConnection) -> None:
    """asyncio: the reader of a connection no read waits on: it turned
    readable (the next bytes came before the next read, or the worker
    closed the idle connection), so it leaves the loop's selector (the next
    read registers it again). Being the callback, it holds ``conn``: a
    registered socket is never closed behind the selector's back."""
    conn.loop.remove_reader(conn.sock.fileno())
    conn.watched = False


def recv_nowait(sock: socket.socket, max_bytes: int) -> bytes | None:
    """What the non-blocking ``sock`` has, up to ``max_bytes`` (``b""``: the
    peer closed), ``None`` if nothing yet; other errors are the socket's
    :class:`OSError`. A function of its own: an exception raised in a
    coroutine's frame gives it a frame object (about 200 bytes) that lives
    as long as the coroutine, the open stream's whole life (here an engine
    read's, and :mod:`asgi_generate.server.hypercorn.trio_serve`'s client connection's)."""
    try:
        return sock.recv(max_bytes)
    except BlockingIOError:
        return None


def readable_now(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read right now: bytes, the peer's
    close (FIN) or an error (a reset), or it is closed here; one ``poll(2)``
    that neither waits nor reads. An idle keep-alive connection should have
    nothing, so anything means it must not carry another request."""
    fd = sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


class TCPConnection:
    """One connected, non-blocking TCP socket.

    Errors are the socket's own :class:`OSError` (``ConnectionResetError``,
    ``BrokenPipeError``, ...), also for a connection closed here.

    Args:
        sock: the connected socket.
        loop: the asyncio event loop it is read in (:func:`connect` passes
            the running one; looking it up at each wait,
            ``asyncio.get_running_loop()``, is a ``getpid(2)`` on CPython
            3.11), ``None`` on trio. The socket stays in the loop's selector
            between reads (re-pointing its reader is no system call, where
            adding and removing it is an ``epoll_ctl(2)`` each) until it
            turns readable with no read waiting (:func:`_parked`) or is
            closed (:meth:`close`, which only its reader calls); meanwhile
            :meth:`stale` needs no system call.

    Attributes:
        watched: the socket is in ``loop``'s selector, with a read's waiter
            or the parked reader.
    """

    __slots__ = ("sock", "loop", "watched")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.sock = sock
        self.loop = loop
        self.watched = False

    async def receive(self, max_bytes: int, deadline: float = math.inf, wait_first: bool = False) -> bytes | None:
        """Up to ``max_bytes`` bytes, waiting for at least one until
        ``deadline`` (``anyio.current_time()``'s clock); ``b""`` once the
        peer closed its side, ``None`` when ``deadline`` passed first (also
        when it had passed already, whatever has arrived). Always a
        checkpoint (cancellable), as anyio's streams are, so a fast worker
        cannot starve other tasks. ``wait_first``: wait for readiness
        before the first read, which would find nothing (the first read of
        an answer to a request just sent: a ``recvfrom(2)`` failing with
        ``EAGAIN`` saved); on asyncio only (on trio a
        wait parks through :mod:`~asgi_generate.workers.trio_poller`'s
        task, dearer than the read it would save when the answer is
        there already)."""
        loop = self.loop
        if deadline != math.inf and (anyio.current_time() if loop is None else loop.time()) >= deadline:
            await checkpoint()
            return None
        sock = self.sock
        if not wait_first or loop is None:
            data = recv_nowait(sock, max_bytes)
            if data is not None:
                await checkpoint()
                return data
        # The wait inline, not a coroutine of its own (about 250 bytes per
        # open stream).
        if loop is None:  # trio
            if trio_poller.AVAILABLE:
                poller = trio_poller.current()
                fd = sock.fileno()
                while True:
                    await trio.lowlevel.wait_task_rescheduled(poller.park(fd, deadline).abort)
                    if (data := recv_nowait(sock, max_bytes)) is not None:
                        return data
                    if trio.current_time() >= deadline:
                        return None
            while True:  # no epoll: trio's own wait
                if deadline == math.inf:
                    await trio.lowlevel.wait_readable(sock)
                else:
                    with trio.move_on_at(deadline) as scope:
                        await trio.lowlevel.wait_readable(sock)
                    if scope.cancelled_caught:
                        return None
                if (data := recv_nowait(sock, max_bytes)) is not None:
                    return data
        # asyncio, the socket kept in the selector: cancellable, and the
        # timer gone and the reader parked however the wait ends.
        fd = sock.fileno()
        while True:
            waiter, timer = _readable(loop, fd, deadline)
            self.watched = True
            try:
                if not await waiter:
                    return None
            finally:
                loop.add_reader(fd, _parked, self)
                if timer is not None:
                    timer.cancel()
            if (data := recv_nowait(sock, max_bytes)) is not None:
                return data

    def stale(self) -> bool:
        """The idle connection is no use for another request: the peer
        closed or reset it, or sent bytes nobody asked for
        (:func:`readable_now`). While the loop's selector watches it
        (:attr:`watched`) the answer is known without a system call: it
        would have turned readable at the loop's last turn, and its parked
        reader dropped it (bytes that came since then are as a close racing
        the request: the pool's :class:`~asgi_generate.exceptions.Unanswered`)."""
        return not self.watched and readable_now(self.sock)

    async def send(self, data: bytes) -> None:
        """All of ``data``, waiting while the socket's buffer is full.

        Not a checkpoint when the socket takes it all at once: the worker
        client sends a request and then waits for its answer, which is one
        (:meth:`receive`); a yield here would cost a turn of the event loop
        per request for nothing."""
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        while view:
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                await anyio.wait_writable(self.sock)
                continue
            view = view[sent:]

    def close(self) -> None:
        """Close the socket (idempotent), out of its loop's selector first.
        Only its reader closes it, never while a read of another task is
        parked on it (see :mod:`asgi_generate.workers.trio_poller`)."""
        if self.watched:
            self.watched = False
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()


class TLSConnection:
    """A TLS connection (anyio's TLS stream, for ``https://`` workers) with
    :class:`TCPConnection`'s interface: errors are :class:`OSError`, the
    peer's close is ``b""``. (TLS keeps its buffers in ``ssl``'s objects
    anyway; no bare-socket saving to be had.)"""

    __slots__ = ("stream",)

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream

    async def receive(self, max_bytes: int, deadline: float = math.inf, wait_first: bool = False) -> bytes | None:
        """As :meth:`TCPConnection.receive` (``wait_first`` changes nothing:
        the TLS stream reads when it must)."""
        with anyio.CancelScope(deadline=deadline):
            try:
                return await self.stream.receive(max_bytes)
            except anyio.EndOfStream:
                return b""
            except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                raise ConnectionResetError(f"TLS connection broken: {exc!r}") from None
        return None

    def stale(self) -> bool:
        """As :meth:`TCPConnection.stale`, on the TCP socket under TLS
        (between reads anyio reads nothing from it on either backend, so a
        peer's close waits there; a TLS alert counts as bytes)."""
        return readable_now(self.stream.extra(anyio.abc.SocketAttribute.raw_socket))

    async def send(self, data: bytes) -> None:
        """As :meth:`TCPConnection.send`."""
        try:
            await self.stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise ConnectionResetError(f"TLS connection broken: {exc!r}") from None

    async def aclose(self) -> None:
        """Close the connection at once (no TLS close_notify wait; idempotent,
        also when cancelled)."""
        await anyio.aclose_forcefully(self.stream)


async def connect(host: str, port: int) -> TCPConnection:
    """Open a TCP connection to ``host:port`` (an IP address, or a name
    resolved by ``anyio.getaddrinfo``, its addresses tried in order), with
    ``TCP_NODELAY`` set: a request goes out in one write and must not wait
    for an ACK.

    Always a checkpoint, as ``anyio.connect_tcp`` is: a loopback connect
    may succeed or be refused at once, and callers rely on other tasks
    getting a turn before its outcome (a P/D pair's prefill leg starts
    while its decode leg connects).

    Raises:
        OSError: no address could be connected (the last address's error,
            with its ``errno``), or the name did not resolve.
    """
    await checkpoint()
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        targets = [(family, addr) for family, _type, _proto, _name, addr in infos]
    else:
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        targets = [(family, (host, port))]
    error: OSError = OSError(errno.EADDRNOTAVAIL, f"no address for {host}")
    for family, addr in targets:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = sock.connect_ex(addr)
            if code == errno.EINPROGRESS:
                await anyio.wait_writable(sock)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, os.strerror(code))
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:  # cancelled (the connect timeout)
            sock.close()
            raise
        asyncio_loop = asyncio.get_running_loop() if sniffio.current_async_library() == "asyncio" else None
        return TCPConnection(sock, asyncio_loop)
    raise error
