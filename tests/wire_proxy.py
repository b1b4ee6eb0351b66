"""A recording HTTP/1.1 proxy for wire audits: it sits on 127.0.0.1 between
the frontend and one worker and keeps every request the worker was sent.

Each accepted connection gets its own upstream connection; requests and
responses are parsed with h11 on both sides (keep-alive included) and
relayed event by event, so the frontend sees the worker's own answer. Hooks:

- ``hold``: a request whose body makes ``hold(body)`` true is recorded but
  not forwarded until :meth:`WireProxy.release` (the worker has not seen it);
  a connection the frontend closes meanwhile is dropped unforwarded;
- ``rewrite``: ``(path, status, body) -> (status, body)``, applied to each
  whole unary (``Content-Length``) response, e.g. to make a worker answer
  something it would not;
- ``drop``: a request for which ``drop(seen)`` is true is recorded, then its
  connection is closed unanswered and the request never forwarded (a
  worker that read it and went away);
- ``answer``: ``seen -> (status, headers, body) | None``; a response is
  sent in the worker's place (with ``content-length``), the request never
  forwarded, e.g. a full engine's 429 with ``Retry-After``.

The proxy runs an asyncio event loop in a daemon thread; :meth:`stop` ends it
(bounded).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import anyio
import anyio.abc
import h11
import orjson


@dataclass
class Seen:
    """One request the worker was sent (or held): ``path``, lower-case
    ``headers`` and the parsed JSON ``body`` (``None`` if not JSON)."""

    path: str
    headers: dict[str, str]
    raw: bytes

    @property
    def body(self):
        try:
            return orjson.loads(self.raw)
        except orjson.JSONDecodeError:
            return None


class WireProxy:
    """A proxy to ``upstream`` (``http://127.0.0.1:PORT``) on a free loopback port."""

    def __init__(self, upstream: str, *, hold=None, rewrite=None, drop=None, answer=None) -> None:
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.hold, self.rewrite, self.drop, self.answer = hold, rewrite, drop, answer
        self.seen: list[Seen] = []
        self.forwarded = 0
        self._released: anyio.Event | None = None
        self._ready = threading.Event()
        self._stop: anyio.Event | None = None
        self._thread = threading.Thread(target=lambda: anyio.run(self._main), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")

    def release(self) -> None:
        """Forward the held requests (and later ones) from now on."""
        self._portal_call(lambda: self._released.set())

    def stop(self) -> None:
        self._portal_call(lambda: self._stop.set())
        self._thread.join(10)

    def requests(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]

    def _portal_call(self, fn) -> None:
        self._loop.call_soon_threadsafe(fn)

    async def _main(self) -> None:
        import asyncio

        self._loop = asyncio.get_running_loop()
        self._released, self._stop = anyio.Event(), anyio.Event()
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.url = f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        self._ready.set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, self._connection)
            await self._stop.wait()
            tg.cancel_scope.cancel()

    async def _connection(self, down: anyio.abc.SocketStream) -> None:
        server = h11.Connection(h11.SERVER)
        up: anyio.abc.SocketStream | None = None
        client = h11.Connection(h11.CLIENT)
        try:
            async with down:
                while True:
                    request, body = await self._read_request(down, server)
                    if request is None:
                        return
                    seen = Seen(request.target.decode(), {k.decode(): v.decode() for k, v in request.headers}, body)
                    self.seen.append(seen)
                    if self.drop is not None and self.drop(seen):
                        return
                    made = self.answer(seen) if self.answer is not None else None
                    if made is not None:
                        status, headers, body = made
                        head = h11.Response(status_code=status,
                                            headers=[*headers, (b"content-length", b"%d" % len(body))])
                        await down.send(server.send(head) + server.send(h11.Data(data=body))
                                        + server.send(h11.EndOfMessage()))
                        server.start_next_cycle()
                        continue
                    if self.hold is not None and not self._released.is_set() and self.hold(seen):
                        gone = anyio.Event()
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self._cancel_on_close, down, gone, tg.cancel_scope)
                            await self._released.wait()
                            tg.cancel_scope.cancel()
                        if gone.is_set():
                            return  # the frontend left: never forwarded
                    if up is None:
                        up = await anyio.connect_tcp(*self.upstream)
                    out = client.send(h11.Request(method=request.method, target=request.target,
                                                  headers=request.headers))
                    out += client.send(h11.Data(data=body)) + client.send(h11.EndOfMessage())
                    await up.send(out)
                    self.forwarded += 1
                    gone = anyio.Event()
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._cancel_on_close, down, gone, tg.cancel_scope)
                        await self._relay_response(up, client, down, server, seen.path)
                        tg.cancel_scope.cancel()
                    if gone.is_set():
                        return
                    if server.their_state is not h11.DONE or client.our_state is not h11.DONE:
                        return
                    if client.their_state is not h11.DONE or server.our_state is not h11.DONE:
                        return
                    server.start_next_cycle()
                    client.start_next_cycle()
        except (anyio.BrokenResourceError, anyio.EndOfStream, OSError, h11.ProtocolError):
            pass
        finally:
            if up is not None:
                await up.aclose()

    @staticmethod
    async def _read_request(down, server: h11.Connection):
        request, body = None, b""
        while True:
            event = server.next_event()
            if event is h11.NEED_DATA:
                try:
                    server.receive_data(await down.receive())
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return None, b""
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None, b""
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return request, body

    @staticmethod
    async def _cancel_on_close(down, gone: anyio.Event, scope: anyio.CancelScope) -> None:
        """The frontend closed its end (it sends nothing else while it waits
        for an answer): stop relaying, which closes the upstream connection,
        as a client that vanished does."""
        try:
            await down.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
        gone.set()
        scope.cancel()

    async def _relay_response(self, up, client: h11.Connection, down, server: h11.Connection, path: str) -> None:
        head, body, unary = None, b"", False
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(await up.receive())
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                head = event
                names = {k.lower() for k, _ in event.headers}
                unary = self.rewrite is not None and b"content-length" in names
                if not unary:
                    await down.send(server.send(event))
            elif isinstance(event, h11.Data):
                if unary:
                    body += bytes(event.data)
                else:
                    await down.send(server.send(h11.Data(data=event.data)))
            elif isinstance(event, h11.EndOfMessage):
                if unary:
                    status, body = self.rewrite(path, head.status_code, body)
                    headers = [(k, str(len(body)).encode() if k.lower() == b"content-length" else v)
                               for k, v in head.headers]
                    out = server.send(h11.Response(status_code=status, headers=headers))
                    await down.send(out + server.send(h11.Data(data=body)))
                await down.send(server.send(h11.EndOfMessage()))
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise anyio.EndOfStream
