"""What keeps an open stream small on the server's side (bench/bench_streams.py
measures the whole): hypercorn's h2 streams get the shared disconnect watch,
App hands a stream the handler's own coroutine, and hypercorn's lean asyncio
queue and event and trio queue, lock and event."""

from __future__ import annotations

import asyncio

import trio
import trio.testing

from asgi_generate.config import Settings
from asgi_generate.request.handler import handle_generate
from asgi_generate.server.app import App
from asgi_generate.server.hypercorn.lean import AppQueue, LeanEvent, TrioAppQueue, TrioEvent, TrioLock


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


def test_a_request_over_our_app_queue_gets_receive_nowait_and_a_queued_body_owes_no_100():
    from asgi_generate.request.watchdog import RECEIVE_NOWAIT
    from asgi_generate.server.hypercorn.fixes import _LazyContinue

    class Stream:
        stream_id = 1
        watch_disconnect = reset_connection = None

        def __init__(self) -> None:
            self.sent: list = []

        async def send(self, event) -> None:
            self.sent.append(event)

    def call(receive) -> tuple[dict, object, Stream]:
        stream, seen = Stream(), {}

        def app(scope, receive, send, *_):
            seen.update(scope["extensions"])
            return receive

        return seen, _LazyContinue(app, stream)({"http_version": "1.1"}, receive, None, None, None), stream

    async def main() -> None:
        queue = AppQueue(0)
        extensions, receive, stream = call(queue.get)
        nowait = extensions[RECEIVE_NOWAIT]
        assert nowait() is None  # nothing queued yet: a 100 still owed
        body = {"type": "http.request", "body": b"{}", "more_body": False}
        await queue.put(body)
        assert nowait() is body
        await queue.put({"type": "http.disconnect"})
        assert await receive() == {"type": "http.disconnect"}
        assert stream.sent == []  # the body came: no 100 sent after it
        # Another server's queue: no extension (the handler reads with a deadline).
        assert RECEIVE_NOWAIT not in call(asyncio.Queue().get)[0]

    asyncio.run(main())


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
