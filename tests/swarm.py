"""Thousands of SSE streams from one process: a lean asyncio client.

One :class:`asyncio.Protocol` per connection, no HTTP library: it sends one
fixed POST, waits for the ``200`` head and the first ``data:`` event, then
discards whatever else arrives (:class:`H2Swarm`: many streams per HTTP/2
connection, framed by the h2 library). Used by the abort-storm test and
bench/bench_streams.py, where thousands of httpx clients would cost more
than the server under test.
"""

from __future__ import annotations

import asyncio
import resource

import h2.config
import h2.connection
import h2.events
import orjson


def raise_fd_limit() -> int:
    """Raise this process's soft open-file limit to the hard one; return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def post_bytes(path: str, body: dict) -> bytes:
    """A whole HTTP/1.1 POST of ``body`` as JSON (to 127.0.0.1)."""
    data = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def _first_payload(buf: bytes, start: int = 0) -> bytes | None:
    """The payload of the first whole ``data:`` event in ``buf`` at or after
    ``start``, ``None`` until one has arrived."""
    at = buf.find(b"data: ", start)
    end = buf.find(b"\n\n", at) if at >= 0 else -1
    return buf[at + 6 : end] if end >= 0 else None


class _Stream(asyncio.Protocol):
    __slots__ = ("request", "first", "buf", "transport")

    def __init__(self, request: bytes, first: asyncio.Future) -> None:
        self.request = request
        self.first = first
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.first.done():
            return
        self.buf += data
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        if not self.buf.startswith(b"HTTP/1.1 200 "):
            self.first.set_exception(AssertionError(f"not a 200: {self.buf[:200]!r}"))
            return
        payload = _first_payload(self.buf, head_end)
        if payload is not None:
            self.first.set_result(payload)
            self.buf = b""

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.first.done():
            self.first.set_exception(ConnectionError(f"closed before the first event: {exc!r}"))


class Swarm:
    """Open SSE streams to ``port`` on 127.0.0.1, each POSTing ``request``.

    Use inside a running asyncio loop. :meth:`open` adds streams (at most
    ``connect_at_once`` connecting together, so the listen backlog never
    overflows) and returns once each has its first event; :meth:`close_all`
    hangs every one up in one go (FIN, as a client that goes away).
    """

    def __init__(self, port: int, connect_at_once: int = 64) -> None:
        self.port = port
        self.streams: list[_Stream] = []
        self._gate = asyncio.Semaphore(connect_at_once)

    async def _one(self, request: bytes, timeout: float) -> _Stream:
        loop = asyncio.get_running_loop()
        async with self._gate:
            first = loop.create_future()
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: _Stream(request, first), "127.0.0.1", self.port), timeout
            )
            self.streams.append(proto)
            await asyncio.wait_for(first, timeout)
        return proto

    async def open(self, requests: list[bytes], timeout: float = 30.0) -> list[bytes]:
        """Open one stream per request; return each one's first ``data:`` payload."""
        protos = await asyncio.gather(*(self._one(r, timeout) for r in requests))
        return [p.first.result() for p in protos]

    def close_all(self) -> None:
        """Hang up every stream now."""
        for s in self.streams:
            if s.transport is not None:
                s.transport.close()
        self.streams.clear()


class _H2Connection(asyncio.Protocol):
    """One HTTP/2 connection (prior knowledge, h2c) carrying several SSE
    streams, each POSTing the same body."""

    def __init__(self, path: str, body: bytes, firsts: list[asyncio.Future]) -> None:
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.headers = [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", "127.0.0.1"),
                        ("content-type", "application/json"), ("content-length", str(len(body)))]
        self.body = body
        self.firsts = firsts
        self.pending: dict[int, asyncio.Future] = {}
        self.bufs: dict[int, bytes] = {}
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.h2.initiate_connection()
        for first in self.firsts:
            stream_id = self.h2.get_next_available_stream_id()
            self.pending[stream_id] = first
            self.bufs[stream_id] = b""
            self.h2.send_headers(stream_id, self.headers)
            self.h2.send_data(stream_id, self.body, end_stream=True)
        transport.write(self.h2.data_to_send())

    def _fail(self, stream_id: int, exc: Exception) -> None:
        first = self.pending.pop(stream_id, None)
        if first is not None and not first.done():
            first.set_exception(exc)

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            sid = getattr(event, "stream_id", None)
            if isinstance(event, h2.events.ResponseReceived):
                status = dict(event.headers).get(":status")
                if status != "200":
                    self._fail(sid, AssertionError(f"stream {sid}: status {status}"))
            elif isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, sid)
                if sid in self.pending:
                    buf = self.bufs[sid] + event.data
                    payload = _first_payload(buf)
                    if payload is not None:
                        self.pending.pop(sid).set_result(payload)
                        del self.bufs[sid]
                    else:
                        self.bufs[sid] = buf
            elif isinstance(event, (h2.events.StreamReset, h2.events.StreamEnded)) and sid in self.pending:
                self._fail(sid, ConnectionError(f"stream {sid} ended before its first event: {event!r}"))
        out = self.h2.data_to_send()
        if out:
            self.transport.write(out)

    def connection_lost(self, exc: Exception | None) -> None:
        for sid in list(self.pending):
            self._fail(sid, ConnectionError(f"closed before the first event: {exc!r}"))


class H2Swarm:
    """As :class:`Swarm` over HTTP/2 (prior knowledge): ``per_connection``
    streams share one connection (hypercorn's default
    ``h2_max_concurrent_streams`` is 100), so N streams cost the server
    N / ``per_connection`` client sockets instead of N."""

    def __init__(self, port: int, per_connection: int = 100) -> None:
        self.port = port
        self.per_connection = per_connection
        self.connections: list[_H2Connection] = []

    async def open(self, path: str, body: dict, n: int, timeout: float = 30.0) -> list[bytes]:
        """Open ``n`` streams POSTing ``body`` to ``path``; return each one's
        first ``data:`` payload."""
        loop = asyncio.get_running_loop()
        data = orjson.dumps(body)
        firsts = [loop.create_future() for _ in range(n)]
        for at in range(0, n, self.per_connection):
            share = firsts[at : at + self.per_connection]
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: _H2Connection(path, data, share), "127.0.0.1", self.port), timeout
            )
            self.connections.append(proto)
            await asyncio.wait_for(asyncio.gather(*share), timeout)
        return [f.result() for f in firsts]

    def close_all(self) -> None:
        """Hang up every connection (and so every stream) now."""
        for c in self.connections:
            c.transport.close()
        self.connections.clear()


async def http_get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """One GET on a fresh connection; status and body (needs content-length)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def http_post(port: int, path: str, body: dict, timeout: float = 10.0) -> tuple[int, bytes]:
    """One POST on a fresh connection; status and the raw body (the server
    closes after it; chunked bodies are returned as sent)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        req = post_bytes(path, body).replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1)
        writer.write(req)
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest
