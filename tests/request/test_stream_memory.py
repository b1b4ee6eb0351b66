"""The pieces that keep an open stream small (bench/bench_streams.py
measures the whole): compact orjson results, the bare-socket worker
connection, hypercorn's lean asyncio queue and event, the shared watchdog."""

from __future__ import annotations

import array
import asyncio
import contextlib
import math
import socket

import anyio
import orjson
import pytest
import sniffio
import trio
import trio.testing

from asgi_generate.server.app import App
from asgi_generate.sdk.codec import Attempt, dumps_compact
from asgi_generate.config import Settings
from asgi_generate.request.handler import handle_generate
from asgi_generate.server.hypercorn.lean import AppQueue, LeanEvent, TrioAppQueue, TrioEvent, TrioLock
from asgi_generate.sdk.token_ids import pack_token_ids
from asgi_generate.request.watchdog import Watchdog
from asgi_generate.workers import sockets, trio_poller
from asgi_generate.workers.sockets import TCPConnection, connect
from asgi_generate_sglang.codec import SGLangCodec


def test_h2_streams_get_the_disconnect_watch_too():
    # hypercorn's h2 protocol builds its streams from its own module's
    # HTTPStream: unpatched, an h2 stream's request had no disconnect watch
    # and kept a guard task (~5 KB more per open stream).
    import hypercorn.protocol.h2 as hypercorn_h2
    import hypercorn.protocol.h11 as hypercorn_h11

    from asgi_generate.server.hypercorn import fixes as hypercorn_fixes, patches

    patches.install(send_errors=True)
    assert hypercorn_h2.HTTPStream is hypercorn_h11.HTTPStream is hypercorn_fixes._HTTPStream


def test_app_dispatch_hands_a_stream_the_handlers_own_coroutine():
    # No frame of App's stays alive under an open stream (288 B): the server
    # awaits handle_generate's coroutine itself; other calls get _other_call's.
    app = App(Settings(workers=[("sglang", "http://127.0.0.1:9")]))
    calls = [
        ({"type": "http", "method": "POST", "path": "/generate"}, handle_generate.__code__),
        ({"type": "http", "method": "GET", "path": "/health"}, App._other_call.__code__),
        ({"type": "lifespan"}, App._other_call.__code__),
    ]
    for scope, code in calls:
        coro = app.dispatch(scope, None, None)
        try:
            assert coro.cr_code is code
        finally:
            coro.close()


def test_dumps_compact_is_orjsons_result():
    # The bytes each holds: bench/bench_held_bytes.py.
    plain = [orjson.dumps(f"rid-{i}") for i in range(200)]
    compact = [dumps_compact(f"rid-{i}") for i in range(200)]
    assert compact == plain
    assert compact[7] == b'"rid-7"'
    big = list(range(1000))
    assert dumps_compact(big) == orjson.dumps(big)



def test_packed_prompt_is_its_ids_and_their_json():
    # A request holds its packed prompt while it streams: a 4-token prompt
    # is its 4 ids and 13 bytes of JSON (the bytes: bench/bench_held_bytes.py).
    packed = [pack_token_ids([11, 12, 13, i]) for i in range(200)]
    assert packed[7].json == b"[11,12,13,7]"
    assert list(packed[7].u32) == [11, 12, 13, 7]



def test_sglang_request_keeps_its_prompt_packed_once_sent():
    # A 2,000-token prompt held as a list of Python ints costs ~36 bytes an
    # id for as long as the request streams; packed, 4 and its JSON text
    # (the bytes: bench/bench_held_bytes.py).
    codec = SGLangCodec()
    prompt = list(range(1000, 3000))
    body = orjson.dumps({"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 9}})
    req = codec.decode(body, {})
    ex = codec.exchange(req, "r0")
    first = ex.worker_request(Attempt("a" * 32, "aggregated"))
    assert type(req.input_ids) is array.array and req.input_ids.tolist() == prompt
    assert req.input_ids_packed.u32 is req.input_ids
    sent = orjson.loads(first.body)
    assert sent["input_ids"] == prompt and sent["rid"] == "a" * 32
    again = orjson.loads(ex.worker_request(Attempt("b" * 32, "aggregated")).body)
    assert again == {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 9}, "rid": "b" * 32}
    resumed = Attempt("c" * 32, "resumed")
    resumed.resumes = [7, 8]
    out = orjson.loads(ex.worker_request(resumed).body)
    assert out["input_ids"] == prompt + [7, 8]
    assert out["sampling_params"] == {"max_new_tokens": 7}



@pytest.mark.parametrize("incremental", [False, True])
def test_sglang_stream_keeps_only_what_a_resume_needs_of_its_last_chunk(incremental):
    # An open stream waits with its last chunk held by the codec: only the
    # part a resumed attempt continues from is kept, and the resumed
    # attempt's chunk reads the same as when the whole chunk was kept.
    codec = SGLangCodec()
    body = orjson.dumps({"input_ids": [1, 2], "stream": True, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": 5}})
    ex = codec.exchange(codec.decode(body, {}), "pub")
    info = {"incremental_streaming_output": incremental}
    first = Attempt("a" * 32, "aggregated", worker_info=info)
    ex.worker_request(first)
    meta = {"id": "a" * 32, "finish_reason": None, "prompt_tokens": 2, "weight_version": "default",
            "completion_tokens": 2, "cached_tokens": 1, "input_token_logprobs": [[None, 1, None]],
            "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]}
    chunk = {"text": "ab", "output_ids": [7, 8], "meta_info": meta}
    event = ex.feed(first, orjson.dumps(chunk))
    assert event.token_ids == [7, 8]
    assert orjson.loads(ex.client_event(event)) == {**chunk, "meta_info": {**meta, "id": "pub"}}
    if incremental:
        assert ex.last == {"meta_info": {"prompt_tokens": 2, "cached_tokens": 1}}
    else:
        assert ex.last == {"text": "ab", "output_ids": [7, 8], "meta_info": {
            "prompt_tokens": 2, "cached_tokens": 1, "input_token_logprobs": [[None, 1, None]],
            "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]}}
    assert ex.payload == b""
    resumed = Attempt("b" * 32, "resumed", worker_info=info, resumes=[7, 8])
    sent = orjson.loads(ex.worker_request(resumed).body)
    assert (sent["input_ids"], sent["sampling_params"]) == ([1, 2, 7, 8], {"max_new_tokens": 3})
    # The resumed engine's own view: a 4-token prompt, its first new token.
    own = {"id": "b" * 32, "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 4,
           "weight_version": "default", "completion_tokens": 1, "cached_tokens": 3,
           "input_token_logprobs": [[None, 1, None]] * 4, "output_token_logprobs": [[-0.125, 9, None]]}
    event = ex.feed(resumed, orjson.dumps({"text": "c", "output_ids": [9], "meta_info": own}))
    assert (event.token_ids, event.finish_reason, event.completion_tokens) == ([9], "length", 3)
    out = orjson.loads(ex.client_event(event))
    expect_meta = {"id": "pub", "finish_reason": {"type": "length", "length": 5}, "prompt_tokens": 2,
                   "weight_version": "default", "completion_tokens": 3, "cached_tokens": 1}
    if incremental:
        assert out == {"text": "c", "output_ids": [9], "meta_info": {
            **expect_meta, "input_token_logprobs": [], "output_token_logprobs": [[-0.125, 9, None]]}}
    else:
        assert out == {"text": "abc", "output_ids": [7, 8, 9], "meta_info": {
            **expect_meta, "input_token_logprobs": [[None, 1, None]],
            "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None], [-0.125, 9, None]]}}


@pytest.mark.anyio
async def test_a_leg_does_not_hold_its_request_body():
    # The attempt loop keeps its WorkerRequest for the leg's whole life; the
    # body (a whole prompt's JSON) goes to the pool and is not kept there.
    from asgi_generate.tracing.state import RequestState
    from asgi_generate.sdk.codec import WorkerRequest
    from asgi_generate.config import Settings
    from asgi_generate.request.legs import Leg

    sent = []

    class Pool:
        def request(self, method, path, body, headers, head_deadline):
            sent.append((method, path, body, headers))
            return object()

    class Worker:
        id, pool = "w0", Pool()

    wreq = WorkerRequest(b"/generate", b'{"input_ids":[1,2,3]}', [(b"x-a", b"1")])
    leg = Leg(RequestState("r", "sglang", "/generate", "POST"), Settings(), Worker(), Attempt("a" * 32, "aggregated"),
              wreq)
    assert sent == [(b"POST", b"/generate", b'{"input_ids":[1,2,3]}', [(b"x-a", b"1")])]
    assert wreq.body == b"" and wreq.stream is True and leg.phase == "headers"


# -- the worker connection: a bare socket on both backends -------------------


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    if request.param == "trio-virtual-time":
        # The clock jumps to the next deadline whenever every task waits:
        # timers come due in order and number however loaded the machine.
        return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}
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
    conn = TCPConnection(a)
    with anyio.move_on_after(0.1) as scope:
        await conn.receive(10)
    assert scope.cancelled_caught
    b.send(b"late")
    assert await conn.receive(10) == b"late"
    conn.close()
    b.close()


def _registrations(fd: int) -> tuple[bool, int]:
    """(whether the running loop watches ``fd`` for reading, live timers
    of the lean wait); on trio, whether the poller has a read parked on
    ``fd`` (its deadline entries are lazy: none counted)."""
    if sniffio.current_async_library() != "asyncio":
        return fd in trio_poller.current()._parked, 0
    loop = asyncio.get_running_loop()
    try:
        key = loop._selector.get_key(fd)
    except KeyError:
        reading = False
    else:
        reading = key.data[0] is not None
    timers = sum(1 for h in loop._scheduled if not h.cancelled() and h._callback is sockets._wake)
    return reading, timers


@pytest.mark.anyio
async def test_bare_socket_read_deadline_is_none_and_leaves_nothing_registered():
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = TCPConnection(a)
    start = anyio.current_time()
    assert await conn.receive(10, start + 0.1) is None
    assert 0.1 <= anyio.current_time() - start < 1.0
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
async def test_bare_socket_wait_cancelled_removes_its_reader_and_timer(with_deadline):
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = TCPConnection(a)
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


# -- hypercorn's asyncio app queue and event ----------------------------------


def test_app_queue_is_fifo_bounded_and_cancellation_safe():
    async def main() -> list:
        q = AppQueue(2)
        seen = []
        await q.put(1)
        await q.put(2)
        put3 = asyncio.ensure_future(q.put(3))  # waits: the queue is full
        await asyncio.sleep(0)
        seen.append(put3.done())
        seen.append(await q.get())
        await asyncio.sleep(0)
        seen.append(put3.done())
        seen += [await q.get(), await q.get()]
        # A get cancelled while waiting loses nothing.
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.sleep(0)
        await q.put(4)
        seen.append(await asyncio.wait_for(q.get(), 1))
        # A get cancelled after being woken passes the item on.
        first, second = asyncio.ensure_future(q.get()), asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        await q.put(5)
        first.cancel()
        seen.append(await asyncio.wait_for(second, 1))
        return seen

    assert asyncio.run(main()) == [False, 1, True, 2, 3, 4, 5]



def test_trio_app_queue_is_fifo_bounded_and_cancellation_safe():
    async def main() -> list:
        q = TrioAppQueue(2)
        seen = []
        async with trio.open_nursery() as nursery:
            await q.put(1)
            await q.put(2)
            put3 = trio.Event()

            async def put(item) -> None:
                await q.put(item)
                put3.set()

            nursery.start_soon(put, 3)  # waits: the queue is full
            await trio.testing.wait_all_tasks_blocked()
            seen.append(put3.is_set())
            seen.append(await q.get())
            await trio.testing.wait_all_tasks_blocked()
            seen.append(put3.is_set())
            seen += [await q.get(), await q.get()]
            # A get cancelled while waiting loses nothing.
            with trio.move_on_after(0.05) as scope:
                await q.get()
            seen.append(scope.cancelled_caught)
            await q.put(4)
            with trio.fail_after(1):
                seen.append(await q.get())
            # Two getters parked: one item wakes the first, the second one the other.
            got: list = []

            async def get() -> None:
                got.append(await q.get())

            nursery.start_soon(get)
            nursery.start_soon(get)
            await trio.testing.wait_all_tasks_blocked()
            await q.put(5)
            await q.put(6)
        seen.append(sorted(got))
        # A cancelled caller does not put or get at all (trio's checkpoints).
        with trio.CancelScope() as scope:
            scope.cancel()
            await q.put(7)
        seen.append(q._items)
        return seen

    assert trio.run(main) == [False, 1, True, 2, 3, True, 4, [5, 6], []]


def test_trio_lock_is_fifo_handed_over_and_cancellation_safe():
    async def main() -> list:
        lock, log = TrioLock(), []

        async def hold(name: str, entered: trio.Event | None = None) -> None:
            async with lock:
                log.append(f"in {name}")
                if entered is not None:
                    entered.set()
                await trio.sleep(0.01)
                log.append(f"out {name}")

        async with trio.open_nursery() as nursery:
            first = trio.Event()
            nursery.start_soon(hold, "a", first)
            await first.wait()
            nursery.start_soon(hold, "b")
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.001) as scope:  # a waiter cancelled never holds it
                await hold("cancelled")
            log.append(f"cancelled caught {scope.cancelled_caught}")
            nursery.start_soon(hold, "c")
        log.append((lock._held, lock._waiters))
        return log

    # Virtual time: the 1 ms cancellation comes before a's 10 ms hold ends
    # however loaded the machine.
    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == [
        "in a", "cancelled caught True", "out a", "in b", "out b", "in c", "out c",
                              (False, None)]


def test_trio_event_wakes_every_waiter_and_is_a_checkpoint():
    async def main() -> list:
        ev, woken = TrioEvent(), []

        async def wait(i: int) -> None:
            await ev.wait()
            woken.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(wait, i)
            await trio.testing.wait_all_tasks_blocked()
            before = list(woken)
            await ev.set()
        seen = [before, sorted(woken), ev.is_set(), ev._waiters]
        with trio.CancelScope() as scope:  # set, yet a checkpoint: a cancelled caller is cancelled
            scope.cancel()
            await ev.wait()
        seen.append(scope.cancelled_caught)
        await ev.clear()
        with trio.move_on_after(0.01) as scope:  # cleared: waits again
            await ev.wait()
        return seen + [scope.cancelled_caught, ev._waiters]

    assert trio.run(main) == [[], [0, 1, 2], True, None, True, True, []]


def test_lean_event_wakes_every_waiter():
    async def main() -> list:
        ev = LeanEvent()
        waiters = [asyncio.ensure_future(ev.wait()) for _ in range(3)]
        await asyncio.sleep(0)
        before = [w.done() for w in waiters]
        await ev.set()
        await asyncio.wait_for(asyncio.gather(*waiters), 1)
        await ev.wait()  # set: returns at once
        await ev.clear()
        return [before, ev.is_set()]

    assert asyncio.run(main()) == [[False, False, False], False]


# -- the watchdog ---------------------------------------------------------------


class _Item:
    def __init__(self, name: str, every: float, times: int, log: list) -> None:
        self.name, self.every, self.left, self.log = name, every, times, log

    def due(self, now, spawn):
        self.log.append(self.name)
        self.left -= 1
        if self.left == 0:
            async def last() -> None:
                self.log.append(self.name + "!")
                raise RuntimeError("an action that fails is logged, the watchdog goes on")

            spawn(last)
            return None
        return now + self.every


@contextlib.asynccontextmanager
async def _running(dog: Watchdog, seconds: float):
    """Run ``dog`` (started: its loop runs) for ``seconds`` after the body
    of the ``async with``, then stop it."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(dog.run, anyio.current_time)
        await anyio.sleep(0.01)
        yield
        await anyio.sleep(seconds)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio-virtual-time"], indirect=True)
async def test_watchdog_runs_timers_in_order_and_forgets():
    log: list[str] = []
    dog = Watchdog()
    async with _running(dog, 0.3):
        assert dog.running
        now = anyio.current_time()
        dog.watch(_Item("a", 0.05, 2, log), now + 0.05)
        dog.watch(_Item("b", 0.02, 3, log), now + 0.02)
        gone = dog.watch(_Item("c", 0.01, 9, log), now + 0.03)
        dog.forget(gone)
    assert not dog.running
    assert log == ["b", "b", "a", "b", "b!", "a", "a!"]


class _Broken:
    def __init__(self, log: list) -> None:
        self.log = log

    def due(self, now, spawn):
        self.log.append("broken")
        raise RuntimeError("a bug in one item")


class _Eager:
    """Asks to be looked at again at once, every time."""

    def __init__(self, log: list) -> None:
        self.log = log

    def due(self, now, spawn):
        self.log.append("eager")
        return now


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio-virtual-time"], indirect=True)
async def test_watchdog_survives_a_failing_item_and_paces_an_eager_one():
    log: list[str] = []
    dog = Watchdog()
    async with _running(dog, 0.2):
        now = anyio.current_time()
        dog.watch(_Broken(log), now)
        dog.watch(_Eager(log), now)
        dog.watch(_Item("late", 0.05, 1, log), now + 0.05)
    assert log.count("broken") == 1
    assert "late!" in log
    # At most one look per MIN_STEP (0.01 s) over about 0.2 s.
    assert 5 <= log.count("eager") <= 21


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
