"""The worker client (httptools): keep-alive reuse, retirement of half-read
connections, idle connections the worker closed or that outlived the idle
timeout never reused, a dropped request never sent twice (an idempotent one
retried once), timeouts; on trio and asyncio."""

from __future__ import annotations

import socket

import anyio
import pytest

from asgi_generate.workers import sockets
from asgi_generate.exceptions import ConnectFailed, TimedOut, Unanswered
from asgi_generate.workers.http import ConnectionPool
from scripted_worker import EOF, _response, _serve

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    return request.param


async def test_keep_alive_connection_is_reused():
    async with anyio.create_task_group() as tg:
        server, pool = await _serve(tg, [_response(b"one"), _response(b"t|w|o", chunked=True)])
        for expected in (b"one", b"two"):
            async with pool.request(b"POST", b"/x", b"{}") as resp:
                assert (resp.status, await resp.read()) == (200, expected)
        assert (pool.opened, pool.retired, pool.idle, server.connections) == (1, 0, 1, 1)
        await pool.aclose()
        tg.cancel_scope.cancel()


async def test_body_and_end_in_one_read_then_end():
    async with anyio.create_task_group() as tg:
        _, pool = await _serve(tg, [_response(b"abc")])
        async with pool.request(b"GET", b"/") as resp:
            assert await resp.read_some() == b"abc"
            assert await resp.read_some() is None
            assert await resp.read_some() is None
        assert pool.idle == 1
        await pool.aclose()
        tg.cancel_scope.cancel()


async def test_half_read_response_retires_the_connection():
    async with anyio.create_task_group() as tg:
        server, pool = await _serve(tg, [_response(b"a|b|c", chunked=True), _response(b"next")])
        async with pool.request(b"GET", b"/") as resp:
            assert resp.status == 200  # body left unread
        assert (pool.idle, pool.retired) == (0, 1)
        async with pool.request(b"GET", b"/") as resp:
            assert await resp.read() == b"next"
        assert (pool.opened, server.connections) == (2, 2)
        await pool.aclose()
        tg.cancel_scope.cancel()


async def test_keep_alive_closed_by_the_worker_is_retried_fresh():
    async with anyio.create_task_group() as tg:
        server, pool = await _serve(tg, [_response(b"first"), None, _response(b"second")])
        async with pool.request(b"GET", b"/", idempotent=True) as resp:
            assert await resp.read() == b"first"
        async with pool.request(b"GET", b"/", idempotent=True) as resp:
            assert await resp.read() == b"second"
        assert (pool.opened, pool.retired, server.connections) == (2, 1, 2)
        await pool.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("method", [b"POST", b"GET"])
async def test_a_request_the_worker_read_and_dropped_is_never_sent_again(method):
    async with anyio.create_task_group() as tg:
        server, pool = await _serve(tg, [_response(b"first"), None, _response(b"never")])
        async with pool.request(method, b"/generate", b'{"rid": "e0"}') as resp:
            assert await resp.read() == b"first"
        with pytest.raises(Unanswered) as exc:
            async with pool.request(method, b"/generate", b'{"rid": "e1"}'):
                pass
        assert str(exc.value) == "worker closed the connection before answering"
        assert server.requests == [(1, method + b" /generate HTTP/1.1", b'{"rid": "e0"}'),
                                   (1, method + b" /generate HTTP/1.1", b'{"rid": "e1"}')]
        assert (pool.opened, pool.retired, pool.idle, server.connections) == (1, 1, 0, 1)
        tg.cancel_scope.cancel()


async def test_an_idle_connection_the_worker_closed_carries_no_request():
    async with anyio.create_task_group() as tg:
        server, pool = await _serve(tg, [EOF, _response(b"first"), _response(b"second")])
        async with pool.request(b"POST", b"/generate", b"1") as resp:
            assert await resp.read() == b"first"
        await anyio.sleep(0.2)  # the worker's FIN reaches the idle connection
        async with pool.request(b"POST", b"/generate", b"2") as resp:
            assert await resp.read() == b"second"
        assert server.after_eof == [b""]  # the closed one was closed, nothing written to it
        assert [(n, body) for n, _, body in server.requests] == [(1, b"1"), (2, b"2")]
        assert (pool.opened, pool.retired, pool.idle) == (2, 1, 1)
        await pool.aclose()
        tg.cancel_scope.cancel()


async def test_a_reused_connection_is_checked_for_the_workers_close_by_poll_only_off_asyncio(anyio_backend,
                                                                                          monkeypatch):
    # asyncio's selector keeps watching a pooled connection: the check is free.
    polls = []
    readable_now = sockets.readable_now
    monkeypatch.setattr(sockets, "readable_now", lambda sock: polls.append(sock) or readable_now(sock))
    async with anyio.create_task_group() as tg:
        server, pool = await _serve(tg, [_response(b"a"), _response(b"b"), _response(b"c")])
        for body, answer in ((b"1", b"a"), (b"2", b"b"), (b"3", b"c")):
            async with pool.request(b"POST", b"/", body) as resp:
                assert await resp.read() == answer
        assert (len(polls), pool.opened, server.connections) == (0 if anyio_backend == "asyncio" else 2, 1, 1)
        await pool.aclose()
        tg.cancel_scope.cancel()


async def test_idle_connections_past_the_idle_timeout_are_closed_not_reused():
    async with anyio.create_task_group() as tg:
        server, pool = await _serve(tg, [_response(b"a"), _response(b"b"), _response(b"c")])
        pool.idle_timeout = 0.2
        async with pool.request(b"POST", b"/", b"1") as first:
            async with pool.request(b"POST", b"/", b"2") as second:
                assert (await first.read(), await second.read()) == (b"a", b"b")
        assert (pool.opened, pool.idle) == (2, 2)
        await anyio.sleep(0.3)
        async with pool.request(b"POST", b"/", b"3") as resp:
            assert await resp.read() == b"c"
        assert [(n, body) for n, _, body in server.requests] == [(1, b"1"), (2, b"2"), (3, b"3")]
        assert (pool.opened, pool.retired, pool.idle) == (3, 2, 1)
        await pool.aclose()
        tg.cancel_scope.cancel()


async def test_silent_worker_times_out_and_is_retired():
    async with anyio.create_task_group() as tg:
        _, pool = await _serve(tg, [2.0])
        start = anyio.current_time()
        with pytest.raises(TimedOut) as exc:
            async with pool.request(b"GET", b"/", head_deadline=start + 0.5):
                pass
        # Not before the deadline, and not at the answer (2 s): no answer came.
        assert anyio.current_time() - start >= 0.5
        assert str(exc.value) == "deadline passed waiting for the worker"
        assert (pool.idle, pool.retired) == (0, 1)
        tg.cancel_scope.cancel()


async def test_body_read_deadline_is_the_callers():
    async with anyio.create_task_group() as tg:
        # Head and a first chunk, then silence.
        _, pool = await _serve(tg, [(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n", 2.0)])
        async with pool.request(b"GET", b"/") as resp:
            assert await resp.read_some() == b"abc"
            with pytest.raises(TimedOut):
                await resp.read_some(anyio.current_time() + 0.2)
        assert (pool.idle, pool.retired) == (0, 1)
        tg.cancel_scope.cancel()


async def test_closed_port_is_connect_failed():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    pool = ConnectionPool("127.0.0.1", port)
    with pytest.raises(ConnectFailed) as exc:
        async with pool.request(b"GET", b"/"):
            pass
    assert str(exc.value) == f"connect to 127.0.0.1:{port} failed: Connection refused"
