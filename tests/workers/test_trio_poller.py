"""The trio poller (asgi_generate.workers.trio_poller): engine-socket reads
parked in one task's epoll set, their deadlines in one heap."""

from __future__ import annotations

import signal
import socket

import pytest
import trio
import trio.testing

from asgi_generate.workers import trio_poller
from asgi_generate.workers.sockets import TCPConnection

pytestmark = pytest.mark.skipif(not trio_poller.AVAILABLE, reason="epoll is Linux's")


def _pair() -> tuple[TCPConnection, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    return TCPConnection(a), b


def test_many_parked_reads_each_wake_with_their_own_data_or_deadline():
    async def main():
        pairs = [_pair() for _ in range(40)]
        results: dict[int, tuple[bytes | None, bool]] = {}
        start = trio.current_time()

        async def read(i: int, conn: TCPConnection) -> None:
            deadline = start + 0.1 + 0.002 * i
            data = await conn.receive(100, deadline)
            results[i] = (data, trio.current_time() >= deadline)

        async with trio.open_nursery() as nursery:
            for i, (conn, _) in enumerate(pairs):
                nursery.start_soon(read, i, conn)
            await trio.testing.wait_all_tasks_blocked()
            poller = trio_poller.current()
            parked = len(poller._parked)
            for i, (_, peer) in enumerate(pairs):
                if i % 2 == 0:
                    peer.send(b"to %d" % i)
        for conn, peer in pairs:
            conn.close()
            peer.close()
        return parked, results, dict(poller._parked)

    parked, results, left = trio.run(main)
    assert parked == 40
    assert results == {i: (b"to %d" % i, False) if i % 2 == 0 else (None, True) for i in range(40)}
    assert left == {}


async def _parked_reads(conn: TCPConnection, peer: socket.socket, offsets: list[float]) -> list[tuple]:
    """One read per offset (deadline: now + offset), each parked before the
    peer sends ``b"<i>"``; each read's data and the poller heap's size
    after it (``None`` without the poller)."""
    out = []

    async def reader() -> None:
        for offset in offsets:
            data = await conn.receive(100, trio.current_time() + offset)
            out.append((data, len(trio_poller.current()._heap) if trio_poller.AVAILABLE else None))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        for i in range(len(offsets)):
            await trio.testing.wait_all_tasks_blocked()
            peer.send(b"%d" % i)
    return out


def test_a_stream_of_reads_keeps_one_deadline_entry_per_socket():
    async def main():
        conn, peer = _pair()
        got = await _parked_reads(conn, peer, [30] * 100)
        sizes = len(trio_poller.current()._heap), len(trio_poller.current()._due)
        conn.close()
        peer.close()
        return got, sizes

    got, sizes = trio.run(main)
    assert got == [(b"%d" % i, 1) for i in range(100)]
    assert sizes == (1, 1)


def test_an_earlier_deadline_wakes_the_poller_sooner():
    async def main():
        conn, peer = _pair()
        ((first, _),) = await _parked_reads(conn, peer, [30])
        start = trio.current_time()
        second = await conn.receive(100, start + 0.05)
        waited = trio.current_time() - start
        poller = trio_poller.current()
        state = [when - start for when, _fd in poller._heap], dict(poller._due)
        conn.close()
        peer.close()
        return first, second, waited, state

    first, second, waited, (heap, due) = trio.run(main)
    assert (first, second) == (b"0", None)
    # Its own deadline woke it, not the first read's 30 s one (half of that
    # is room for a loaded machine).
    assert 0.05 <= waited < 15
    # The first read's entry is stale and waits to come up; no fd is due.
    assert len(heap) == 1 and 29 < heap[0] < 30 and due == {}


def test_earlier_deadlines_leave_a_bounded_heap():
    # Each read's deadline earlier than the last (as a keep-alive
    # connection's next request head after a long first-token wait) pushes
    # an entry and leaves the previous one stale; the heap is rebuilt
    # before it holds more than 2 per parked read + COMPACT_SLACK.
    async def main():
        conn, peer = _pair()
        got = await _parked_reads(conn, peer, [1000 - i for i in range(300)])
        conn.close()
        peer.close()
        return got

    got = trio.run(main)
    assert [data for data, _ in got] == [b"%d" % i for i in range(300)]
    sizes = [size for _, size in got]
    assert (max(sizes), min(sizes), sizes[:3]) == (2 * 1 + trio_poller.COMPACT_SLACK, 1, [1, 2, 3])


def test_a_timed_out_read_leaves_the_socket_out_of_the_set():
    # Left in the set with no events asked for, the kernel would still
    # report the peer's hang-up (EPOLLHUP, level-triggered) on every poll:
    # the poller spinning, and with BATCH such sockets never yielding.
    async def main():
        conn, peer = _pair()
        assert await conn.receive(100, trio.current_time() + 0.01) is None
        peer.close()
        await trio.sleep(0.01)
        poller = trio_poller.current()
        reported = poller._epoll.poll(0)
        data = await conn.receive(100, trio.current_time() + 5)  # registered anew: the hang-up wakes it
        conn.close()
        return reported, data

    assert trio.run(main) == ([], b"")


def test_keyboard_interrupt_inside_park_leaves_its_bookkeeping_whole(monkeypatch):
    # A SIGINT at the worst moment (between _due and the heap) is held back
    # until park is done, so a later read still times out on time.
    import heapq
    import types

    armed = [True]

    def push(heap, item):
        if armed[0]:
            armed[0] = False
            signal.raise_signal(signal.SIGINT)
        heapq.heappush(heap, item)

    # The poller's heapq only (trio's own heaps untouched), and Python's own
    # SIGINT handler, which trio.run replaces with its KeyboardInterrupt
    # delivery (another test may have left a handler of its own).
    shim = types.SimpleNamespace(heappush=push, heappop=heapq.heappop, heapify=heapq.heapify)
    monkeypatch.setattr(trio_poller, "heapq", shim)

    async def main():
        conn, peer = _pair()
        interrupted = False
        try:
            await conn.receive(100, trio.current_time() + 0.1)
        except KeyboardInterrupt:
            interrupted = True
        poller = trio_poller.current()
        whole = all((when, fd) in poller._heap for fd, when in poller._due.items())
        with trio.move_on_after(2):
            late = await conn.receive(100, trio.current_time() + 0.05)
        conn.close()
        peer.close()
        return interrupted, whole, late

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert trio.run(main) == (True, True, None)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_cancelled_read_leaves_nothing_parked_or_armed():
    async def main():
        conn, peer = _pair()
        with trio.move_on_after(0.05) as scope:
            await conn.receive(100, trio.current_time() + 30)
        poller = trio_poller.current()
        parked = dict(poller._parked)
        peer.send(b"after")
        await trio.sleep(0.01)
        armed = poller._epoll.poll(0)
        data = await conn.receive(100, trio.current_time() + 5)
        conn.close()
        peer.close()
        return scope.cancelled_caught, parked, armed, data

    assert trio.run(main) == (True, {}, [], b"after")


def test_a_second_reader_of_one_socket_is_refused():
    async def main():
        conn, peer = _pair()

        async def second() -> None:
            await trio.testing.wait_all_tasks_blocked()
            try:
                await conn.receive(10, trio.current_time() + 5)
            except trio.BusyResourceError as exc:
                errors.append(str(exc))
            peer.send(b"first's")

        errors: list[str] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(second)
            data = await conn.receive(10, trio.current_time() + 5)
        conn.close()
        peer.close()
        return data, errors

    assert trio.run(main) == (b"first's", ["another task is already reading this socket"])


def test_a_closed_socket_s_fd_is_watched_again_when_reused():
    async def main():
        results = []
        fds = []
        for n in range(3):
            conn, peer = _pair()
            fds.append(conn.sock.fileno())

            async def send_later(peer=peer, n=n) -> None:
                await trio.testing.wait_all_tasks_blocked()
                peer.send(b"pair %d" % n)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_later)
                results.append(await conn.receive(100, trio.current_time() + 5))
            conn.close()
            peer.close()
        return fds, results

    fds, results = trio.run(main)
    assert len(set(fds)) == 1  # the same fd each time: registered anew
    assert results == [b"pair 0", b"pair 1", b"pair 2"]


def test_the_poller_closes_its_epoll_when_the_run_ends():
    async def main():
        conn, peer = _pair()
        peer.send(b"x")
        await trio.sleep(0.01)
        assert await conn.receive(10) == b"x"  # data waiting: no poller needed
        with pytest.raises(LookupError):
            trio_poller._POLLER.get()
        assert await conn.receive(10, trio.current_time() + 0.01) is None
        conn.close()
        peer.close()
        return trio_poller.current()

    poller = trio.run(main)
    assert poller._epoll.closed


def test_without_epoll_reads_wait_with_trios_own_calls(monkeypatch):
    monkeypatch.setattr(trio_poller, "AVAILABLE", False)

    async def main():
        conn, peer = _pair()
        timed_out = await conn.receive(10, trio.current_time() + 0.02)
        ((data, _),) = await _parked_reads(conn, peer, [5])
        conn.close()
        peer.close()
        with pytest.raises(LookupError):
            trio_poller._POLLER.get()
        return timed_out, data

    assert trio.run(main) == (None, b"0")
