"""The asyncio client connection as a protocol (asgi_generate.server.hypercorn.asyncio_serve):
hypercorn's ``handle()`` run in the transport's callbacks, and what happens
when it suspends. The end-to-end behaviour (keep-alive, close, pipelining,
half-close, TLS, shutdown) is tested through real servers elsewhere
(test_http_edge.py, test_tls.py, test_cli.py) on every worker class."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config
from hypercorn.events import Closed, RawData, Updated

from asgi_generate.server.hypercorn.asyncio_serve import Connection, _Worker


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.written: list[bytes] = []
        self.closing = False
        sock = SimpleNamespace(family=socket.AF_INET, getpeername=lambda: ("127.0.0.1", 40000),
                               getsockname=lambda: ("127.0.0.1", 8000))
        self.extra = {"socket": sock, "ssl_object": None}

    def get_extra_info(self, name, default=None):
        return self.extra.get(name, default)

    def pause_reading(self) -> None:
        self.calls.append("pause_reading")

    def resume_reading(self) -> None:
        self.calls.append("resume_reading")

    def write(self, data) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.calls.append("write_eof")

    def close(self) -> None:
        self.calls.append("close")
        self.closing = True


def name(event) -> str:
    if isinstance(event, RawData):
        return event.data.decode() or "EOF"
    return type(event).__name__


class GatedProtocol:
    """hypercorn's protocol: logs each event's start and end; an event whose
    data is in ``gates`` waits on that future (and logs what it got)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.gates: dict[str, asyncio.Future] = {}

    async def handle(self, event) -> None:
        label = name(event)
        self.log.append(f"start {label}")
        gate = self.gates.get(label)
        if gate is not None:
            try:
                got = await gate
            except asyncio.CancelledError:
                self.log.append(f"cancelled {label}")
                raise
            self.log.append(f"got {got!r}")
            if got == "fail":
                raise ValueError("handle failed")
        self.log.append(f"end {label}")


def connect(keep_alive: float = 5.0) -> tuple[Connection, FakeTransport, GatedProtocol, _Worker]:
    config = Config()
    config.keep_alive_timeout = keep_alive
    worker = _Worker(None, config, WorkerContext(None), {}, asyncio.get_running_loop())
    conn, transport = Connection(worker), FakeTransport()
    conn.connection_made(transport)
    conn.protocol = GatedProtocol()
    return conn, transport, conn.protocol, worker


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_suspended_handle_keeps_order_and_pauses_reading():
    async def main() -> None:
        conn, transport, proto, worker = connect()
        assert (worker.open, worker.idle) == (1, {conn})  # idle until its first request
        conn.data_received(b"a")  # finishes in the callback: no task
        assert proto.log == ["start a", "end a"]
        assert (conn._tasks, transport.calls) == (None, [])

        proto.gates["b"] = gate = asyncio.get_running_loop().create_future()
        conn.data_received(b"b")
        assert proto.log[2:] == ["start b"]
        assert transport.calls == ["pause_reading"]
        assert isinstance(conn._tasks, asyncio.Task)  # one task: the rest of b's handle()
        conn.data_received(b"c")  # arrived before the pause took: queued behind b
        conn.data_received(b"d")
        await settle()
        assert proto.log[2:] == ["start b"]

        gate.set_result("go")
        await settle()
        assert proto.log[2:] == ["start b", "got 'go'", "end b", "start c", "end c", "start d", "end d"]
        assert transport.calls == ["pause_reading", "resume_reading"]
        assert conn._tasks is None and conn._queued is None

        conn.data_received(b"e")  # back to running in the callback
        assert proto.log[-2:] == ["start e", "end e"]
        assert conn._tasks is None

        conn.eof_received()  # end of stream, no app running: the socket closes
        assert proto.log[-4:] == ["start EOF", "end EOF", "start Closed", "end Closed"]
        assert transport.calls == ["pause_reading", "resume_reading", "write_eof", "close"]
        conn.connection_lost(None)
        assert (worker.open, worker.idle) == (0, set())
        assert proto.log.count("start Closed") == 1

    asyncio.run(main())


def test_the_end_of_stream_waits_behind_a_suspended_handle():
    async def main() -> None:
        conn, transport, proto, worker = connect()
        proto.gates["b"] = gate = asyncio.get_running_loop().create_future()
        conn.data_received(b"b")
        conn.connection_lost(ConnectionResetError())
        assert proto.log == ["start b"]
        assert worker.open == 1  # its task still runs
        gate.set_result(1)
        await settle()
        assert proto.log == ["start b", "got 1", "end b", "start EOF", "end EOF", "start Closed", "end Closed"]
        assert transport.calls == ["pause_reading"]  # no resume once the stream ended
        assert (conn._tasks, worker.open) == (None, 0)

    asyncio.run(main())


def test_a_suspended_handle_that_fails_closes_the_connection():
    async def main() -> None:
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        conn, transport, proto, _worker = connect()
        proto.gates["b"] = gate = asyncio.get_running_loop().create_future()
        conn.data_received(b"b")
        conn.data_received(b"c")
        gate.set_result("fail")
        await settle()
        assert proto.log == ["start b", "got 'fail'"]  # c is never handled
        assert [(e["message"], repr(e["exception"])) for e in errors] == [
            ("hypercorn connection failed", "ValueError('handle failed')")]
        assert transport.calls == ["pause_reading", "write_eof", "close"]
        assert conn._tasks is None

    asyncio.run(main())


def test_a_suspended_handle_is_cancelled_with_its_connection():
    async def main() -> None:
        conn, transport, proto, _worker = connect()
        proto.gates["b"] = asyncio.get_running_loop().create_future()
        conn.data_received(b"b")
        task = conn._tasks
        task.cancel()
        await settle()
        assert proto.log == ["start b", "cancelled b"]
        assert task.cancelled()
        assert conn._tasks is None and conn._queued is None

    asyncio.run(main())


def test_writes_wait_while_the_transport_is_paused_and_a_lost_one_is_closed():
    async def main() -> None:
        conn, transport, proto, _worker = connect()
        await conn.send(RawData(b"1"))  # no wait while writing is on
        conn.pause_writing()
        sent = asyncio.ensure_future(conn.send(RawData(b"2")))
        await settle()
        assert transport.written == [b"1", b"2"] and not sent.done()
        conn.resume_writing()
        await settle()
        assert sent.done() and sent.result() is None

        conn.pause_writing()
        sent = asyncio.ensure_future(conn.send(RawData(b"3")))
        await settle()
        conn.connection_lost(ConnectionResetError())  # the client left while a write waits
        await settle()
        assert sent.result() is None
        # Closed twice: once for the failed write (as hypercorn's protocol_send), once for the lost connection.
        assert proto.log == ["start EOF", "end EOF", "start Closed", "end Closed", "start Closed", "end Closed"]
        await conn.send(RawData(b"4"))  # written to a gone client: reported, not written
        assert transport.written == [b"1", b"2", b"3"]
        assert proto.log[-2:] == ["start Closed", "end Closed"]

    asyncio.run(main())


def test_keep_alive_timer_only_while_idle():
    async def main() -> None:
        conn, transport, proto, worker = connect(keep_alive=0.05)
        assert worker.idle == {conn}  # a new connection waits for its first request
        await conn.send(Updated(idle=False))  # a request is being served
        assert (conn._idle, worker.idle) == (None, set())
        await asyncio.sleep(0.1)
        assert transport.calls == []
        await conn.send(Updated(idle=True))
        assert worker.idle == {conn}
        await asyncio.sleep(0.1)
        assert (transport.calls, worker.idle) == (["close"], set())
        await conn.send(Closed())  # closing twice is closing once
        assert transport.calls == ["close"]

    asyncio.run(main())
