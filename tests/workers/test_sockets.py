"""The worker connection is a bare socket (bench/bench_streams.py measures
what an open stream holds): round trips, waits, read deadlines and
cancellation leave no read waiting and no timer, on both backends; on
asyncio the connection stays in the loop's selector between reads (its
reader parked) until it turns readable unread or is closed."""

from __future__ import annotations

import asyncio
import math
import socket

import anyio
import pytest
import sniffio
import uvloop

from asgi_generate.workers import sockets, trio_poller
from asgi_generate.workers.sockets import TCPConnection, connect


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_bare_socket_round_trip(host):
    big = bytes(range(256)) * 8192  # 2 MiB: more than a socket buffer takes at once

    async def serve(stream) -> None:
        async with stream:
            got = b""
            while len(got) < len(big):
                got += await stream.receive()
            await stream.send(b"ok:%d" % (got == big))

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        conn = await connect(host, port)
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        await conn.send(big)
        assert await conn.receive(100) == b"ok:1"
        assert await conn.receive(100) == b""  # the server closed its side
        conn.close()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_bare_socket_receive_waits_and_is_cancellable():
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = _connection(a)
    with anyio.move_on_after(0.1) as scope:
        await conn.receive(10)
    assert scope.cancelled_caught
    b.send(b"late")
    assert await conn.receive(10) == b"late"
    conn.close()
    b.close()


def _connection(sock: socket.socket) -> TCPConnection:
    """``sock`` as :func:`connect` makes it: with the running asyncio loop, none on trio."""
    return TCPConnection(sock, asyncio.get_running_loop() if sniffio.current_async_library() == "asyncio" else None)


def _registrations(fd: int) -> tuple[bool, int]:
    """(whether a read waits on ``fd``, live timers of the lean wait): on
    asyncio, whether the loop's reader for ``fd`` is a waiting read's (not
    the parked one); on trio, whether the poller has a read parked on
    ``fd`` (its deadline entries are lazy: none counted)."""
    if sniffio.current_async_library() != "asyncio":
        return fd in trio_poller.current()._parked, 0
    loop = asyncio.get_running_loop()
    try:
        key = loop._selector.get_key(fd)
    except KeyError:
        reading = False
    else:
        reading = key.data[0] is not None and key.data[0]._callback is sockets._wake
    timers = sum(1 for h in loop._scheduled if not h.cancelled() and h._callback is sockets._wake)
    return reading, timers


@pytest.mark.anyio
async def test_bare_socket_read_deadline_is_none_and_leaves_no_read_waiting():
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = _connection(a)
    start = anyio.current_time()
    with anyio.fail_after(30):  # the deadline ends the read
        assert await conn.receive(10, start + 0.1) is None
    assert anyio.current_time() - start >= 0.1
    assert _registrations(a.fileno()) == (False, 0)
    # Data before the deadline: returned, its timer gone.
    b.send(b"x")
    assert await conn.receive(10, anyio.current_time() + 5) == b"x"

    async def later() -> None:
        await anyio.sleep(0.05)
        b.send(b"late")

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        assert await conn.receive(10, anyio.current_time() + 5) == b"late"
    assert _registrations(a.fileno()) == (False, 0)
    # A deadline already passed is None even with data waiting, which stays
    # unread (as a cancel scope past its deadline cut the read before).
    b.send(b"waiting")
    await anyio.sleep(0.01)
    assert await conn.receive(10, anyio.current_time() - 1) is None
    assert await conn.receive(10) == b"waiting"
    conn.close()
    b.close()


@pytest.mark.anyio
@pytest.mark.parametrize("with_deadline", [False, True])
async def test_bare_socket_wait_cancelled_leaves_no_read_waiting_and_no_timer(with_deadline):
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = _connection(a)
    seen: list = []

    async def look() -> None:
        await anyio.sleep(0.05)
        seen.append(_registrations(a.fileno()))
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(look)
        await conn.receive(10, anyio.current_time() + 30 if with_deadline else math.inf)
    asyncio_loop = sniffio.current_async_library() == "asyncio"
    assert seen == [(True, int(asyncio_loop and with_deadline))]
    assert _registrations(a.fileno()) == (False, 0)
    b.send(b"next")  # the socket is usable again: no stale registration
    assert await conn.receive(10, anyio.current_time() + 5) == b"next"
    conn.close()
    b.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_connection_given_its_loop_stays_in_the_selector_between_reads(anyio_backend, monkeypatch):
    loop = asyncio.get_running_loop()
    registered: list[int] = []
    register = loop._selector.register
    monkeypatch.setattr(loop._selector, "register", lambda fd, *a: registered.append(fd) or register(fd, *a))

    def callback(fd: int):
        try:
            return loop._selector.get_key(fd).data[0]._callback
        except KeyError:
            return None

    a, b = socket.socketpair()
    a.setblocking(False)
    conn = TCPConnection(a, loop)
    for n in range(3):  # each read waits: one registration for the three
        loop.call_later(0.01, b.send, b"%d" % n)
        assert await conn.receive(10, anyio.current_time() + 5) == b"%d" % n
        assert callback(a.fileno()) is sockets._parked
    assert registered == [a.fileno()]
    assert (conn.watched, conn.stale()) == (True, False)  # known with no poll(2)
    # Readable with no read waiting (bytes nobody asked for yet, a close):
    # dropped from the selector at the next turn, the bytes left for the next read.
    b.send(b"early")
    await anyio.sleep(0.05)
    assert (callback(a.fileno()), conn.watched, conn.stale()) == (None, False, True)
    assert await conn.receive(10) == b"early"
    # A deadline, a cancellation: the reader parked, the timer gone.
    assert await conn.receive(10, anyio.current_time() + 0.05) is None
    with anyio.move_on_after(0.05):
        await conn.receive(10)
    assert (callback(a.fileno()), _registrations(a.fileno())[1]) == (sockets._parked, 0)
    # Closing takes it out of the selector before the fd number is free.
    fd = a.fileno()
    conn.close()
    assert callback(fd) is None
    b.close()
    c, d = socket.socketpair()  # likely the same fd number: registers afresh
    c.setblocking(False)
    other = TCPConnection(c, loop)
    loop.call_later(0.01, d.send, b"fresh")
    assert await other.receive(10, anyio.current_time() + 5) == b"fresh"
    other.close()
    d.close()


@pytest.mark.anyio
@pytest.mark.parametrize("wait_first", [False, True])
async def test_wait_first_skips_the_read_that_would_find_nothing_on_asyncio(wait_first, monkeypatch):
    calls: list[int] = []
    recv_nowait = sockets.recv_nowait
    monkeypatch.setattr(sockets, "recv_nowait", lambda sock, n: calls.append(n) or recv_nowait(sock, n))
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = _connection(a)
    loop = conn.loop

    async def later() -> None:
        await anyio.sleep(0.02)
        b.send(b"answer")

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        assert await conn.receive(10, anyio.current_time() + 5, wait_first) == b"answer"
    assert len(calls) == (1 if wait_first and loop is not None else 2)
    b.send(b"there")  # already there: found after the wait, none lost
    await anyio.sleep(0.01)
    assert await conn.receive(10, anyio.current_time() + 5, wait_first) == b"there"
    conn.close()
    b.close()


@pytest.mark.anyio
async def test_connect_is_a_checkpoint_even_when_refused_at_once():
    # A P/D pair starts its prefill leg, then connects its decode leg: a
    # refusal must not come back before the prefill task got its turn.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    ran: list[int] = []

    async def mark() -> None:
        ran.append(1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(mark)
        with pytest.raises(ConnectionRefusedError):
            await connect("127.0.0.1", port)
        assert ran == [1]


@pytest.mark.parametrize("make_loop", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_connection_closed_after_its_loop_closes_closes_quietly(make_loop):
    loop = make_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = TCPConnection(a, loop)

    async def read_once() -> bytes | None:
        loop.call_later(0.01, b.send, b"x")
        return await conn.receive(10, loop.time() + 5)

    assert loop.run_until_complete(read_once()) == b"x"  # its reader parked in the selector
    loop.close()
    conn.close()  # no "Event loop is closed"
    assert a.fileno() == -1
    b.close()
