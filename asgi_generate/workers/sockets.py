"""A TCP connection to a worker as a bare non-blocking socket, awaited
through anyio (``anyio.wait_readable`` / ``wait_writable``).

An open SSE stream holds one engine connection for its whole life. anyio's
own socket stream wraps it in more objects than the connection itself: on
asyncio a transport plus a protocol holding a read queue and two events
(three deques, about 3 KB per connection), on trio the socket wrappers of
both libraries. :class:`TCPConnection` keeps the socket alone; while it
waits, the backend holds one registration (asyncio: a future and a reader
callback).
:class:`TLSConnection` gives an ``https://`` worker's anyio TLS stream the
same interface.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

import anyio
from anyio.lowlevel import checkpoint


class TCPConnection:
    """One connected, non-blocking TCP socket.

    Errors are the socket's own :class:`OSError` (``ConnectionResetError``,
    ``BrokenPipeError``, ...), also for a connection closed here.
    """

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def receive(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` bytes, waiting for at least one; ``b""`` once
        the peer closed its side. Always a checkpoint (cancellable), as
        anyio's streams are, so a fast worker cannot starve other tasks."""
        try:
            data = self.sock.recv(max_bytes)
        except BlockingIOError:
            pass
        else:
            await checkpoint()
            return data
        while True:
            await anyio.wait_readable(self.sock)
            try:
                return self.sock.recv(max_bytes)
            except BlockingIOError:  # woken without data: wait again
                continue

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
        """Close the socket (idempotent)."""
        self.sock.close()


class TLSConnection:
    """A TLS connection (anyio's TLS stream, for ``https://`` workers) with
    :class:`TCPConnection`'s interface: errors are :class:`OSError`, the
    peer's close is ``b""``. (TLS keeps its buffers in ``ssl``'s objects
    anyway; no bare-socket saving to be had.)"""

    __slots__ = ("stream",)

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream

    async def receive(self, max_bytes: int) -> bytes:
        """As :meth:`TCPConnection.receive`."""
        try:
            return await self.stream.receive(max_bytes)
        except anyio.EndOfStream:
            return b""
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise ConnectionResetError(f"TLS connection broken: {exc!r}") from None

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
        return TCPConnection(sock)
    raise error
