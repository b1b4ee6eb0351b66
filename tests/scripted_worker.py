"""A loopback HTTP/1.1 worker answering from a script, for the worker
client's tests (tests/workers/test_worker_http.py and the tests that drive
:class:`~asgi_generate.workers.http.ConnectionPool` against exact bytes)."""

from __future__ import annotations

import anyio
import anyio.abc

from asgi_generate.workers.http import ConnectionPool

#: A :class:`Server` script entry: answer with the next, then half-close.
EOF = object()


async def _read_to_end(stream) -> bytes:
    data = b""
    while True:
        try:
            data += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return data


def _response(body: bytes, chunked: bool = False) -> bytes:
    if chunked:
        return (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in body.split(b"|")) + b"0\r\n\r\n")
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


class Server:
    """A loopback server answering each request with the next scripted reply;
    ``None`` in the script closes the connection instead (the request read,
    never answered), a float sleeps instead of answering, ``(bytes, float)``
    answers then sleeps, ``EOF`` answers the request as the next reply says
    and then closes its side of the connection (FIN) while reading on.
    ``requests`` lists ``(connection number, request line, body)`` as read;
    ``after_eof`` what each half-closed connection read after its FIN."""

    def __init__(self, script: list) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[tuple[int, bytes, bytes]] = []
        self.after_eof: list[bytes] = []

    async def handle(self, stream) -> None:
        self.connections += 1
        number = self.connections
        async with stream:
            buf = b""
            while self.script:
                while b"\r\n\r\n" not in buf:
                    try:
                        buf += await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        return
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buf) < length:
                    buf += await stream.receive()
                self.requests.append((number, head.split(b"\r\n")[0], buf[:length]))
                buf = buf[length:]
                reply = self.script.pop(0)
                if reply is None:
                    return
                if reply is EOF:
                    await stream.send(self.script.pop(0))
                    await stream.send_eof()
                    self.after_eof.append(await _read_to_end(stream))
                    return
                if isinstance(reply, float):
                    await anyio.sleep(reply)
                    continue
                if isinstance(reply, tuple):
                    await stream.send(reply[0])
                    await anyio.sleep(reply[1])
                    continue
                await stream.send(reply)


async def _serve(tg, script):
    server = Server(script)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    tg.start_soon(listener.serve, server.handle)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    return server, ConnectionPool("127.0.0.1", port)
