"""Loopback HTTP/1.1 workers answering from a script: :class:`Server`
(exact reply bytes, for the worker client's tests and those that drive
:class:`~asgi_generate.workers.http.ConnectionPool` against them) and
:func:`_scripted_engine` (a status per abort request, for the abort
queue's)."""

from __future__ import annotations

import time

import anyio
import anyio.abc
import h11
from anyio import wait_all_tasks_blocked

from asgi_generate.protocols import PROTOCOLS
from asgi_generate.workers.aborts import AbortQueue
from asgi_generate.workers.http import ConnectionPool
from asgi_generate.workers.router import Worker

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


def _worker(protocol: str, port: int, healthy: bool = True) -> Worker:
    pools = (ConnectionPool("127.0.0.1", port), ConnectionPool("127.0.0.1", port))
    w = Worker("w0", PROTOCOLS[protocol], f"http://127.0.0.1:{port}", *pools)
    w.healthy = healthy
    return w


async def _abort_all(queue: AbortQueue, ids: list[str], start_senders: bool = True) -> list[str]:
    """Queue every abort before any sender runs, then let them drain."""
    results: dict[str, str] = {}

    async def one(engine_id: str) -> None:
        results[engine_id] = await queue.abort(engine_id)

    async with anyio.create_task_group() as tg:
        for i in ids:
            tg.start_soon(one, i)
        await wait_all_tasks_blocked()
        async with anyio.create_task_group() as senders:
            if start_senders:
                senders.start_soon(queue.run)
            while len(results) < len(ids):
                await anyio.sleep(0.01)
            senders.cancel_scope.cancel()
    return [results[i] for i in ids]


async def _scripted_engine(answers: list[int | None], *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """A loopback engine that answers its n-th request with status
    ``answers[n]`` (``None``: never answers); reports ``(port, requests)``,
    ``requests`` the bodies it got, in order."""
    requests: list[bytes] = []

    async def serve(stream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive())
                elif isinstance(event, h11.Data):
                    requests.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    status = answers[len(requests) - 1]
                    if status is None:
                        await anyio.sleep_forever()
                    await stream.send(conn.send(h11.Response(status_code=status, headers=[("content-length", "0")]))
                                      + conn.send(h11.EndOfMessage()))
                    conn.start_next_cycle()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    task_status.started((listener.extra(anyio.abc.SocketAttribute.local_port), requests))
    await listener.serve(serve)


def _against_script(answers: list[int | None], timeout: float) -> tuple[str, list[bytes], AbortQueue, float]:
    async def main():
        async with anyio.create_task_group() as tg:
            port, requests = await tg.start(_scripted_engine, answers)
            queue = AbortQueue(_worker("sglang", port), concurrency=1, timeout=timeout)
            t0 = time.monotonic()
            (result,) = await _abort_all(queue, ["r" * 32])
            took = time.monotonic() - t0
            tg.cancel_scope.cancel()
        return result, requests, queue, took

    return anyio.run(main)
