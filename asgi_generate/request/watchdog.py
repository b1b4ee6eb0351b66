"""One task that keeps the time for every request's client: SSE keep-alive
comments and the slow-client cut-off, instead of a guard task per request.

An open stream spends nearly all its life waiting for the engine. A guard
task of its own (:meth:`asgi_generate.request.answer.AnswerWriter.guard`:
the task, its task group, its cancel scopes and a parked ``receive()``)
costs about 4 KB per stream; served by hypercorn with
:mod:`asgi_generate.server.hypercorn.fixes`, a request learns of its client's
disconnect from a callback (:data:`DISCONNECT_WATCH`) and its timers live
here, in one heap. Each watched request has at most one live entry; what is
due is decided by the request itself (:meth:`Watched.due`), which either
returns when to look again or starts the action (a keep-alive write, a
cut-off) in this watchdog's task group, so no client write ever holds up
another request's timer.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import Awaitable, Callable, Protocol

import anyio

log = logging.getLogger("asgi_generate.request.watchdog")
#: Seconds: the soonest an item is looked at again (as the guard task's wait).
MIN_STEP = 0.01

#: The ASGI scope extension our hypercorn offers (``hypercorn_fixes``): a
#: function taking a callback (or ``None`` to stop), called once when the
#: client's connection closes, at once when it is closed already.
DISCONNECT_WATCH = "asgi_generate.disconnect_watch"
#: The ASGI scope extension our hypercorn offers beside it on HTTP/1.1: a
#: function of no arguments that closes the client's connection at once with
#: a TCP reset (what is buffered for the client is dropped, a write stuck on
#: it ends).
CONNECTION_RESET = "asgi_generate.connection_reset"
#: The ASGI scope extension our hypercorn offers beside them: a function of
#: no arguments returning the next message ``receive()`` would return if
#: it is queued already (taken, as ``receive()`` takes it), else ``None``.
RECEIVE_NOWAIT = "asgi_generate.receive_nowait"


class Watched(Protocol):
    def due(self, now: float, spawn: Callable[[Callable[[], Awaitable[None]]], None]) -> float | None:
        """What is due at ``now`` (monotonic seconds) is started with
        ``spawn``; returns when to look again, ``None`` to stop watching."""


class Watchdog:
    """Timers of many requests in one task (:meth:`run`, for the app's
    lifespan). Entries are keyed, so a finished request is forgotten at once
    (:meth:`forget`) and its stale heap entry is a key and a time, dropped
    when it comes up or when stale entries outnumber live ones."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._watched: dict[int, Watched] = {}
        self._keys = itertools.count()
        self._wakeup = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def running(self) -> bool:
        """Whether :meth:`run` is serving (requests may be watched)."""
        return self._tg is not None

    def watch(self, item: Watched, first: float) -> int:
        """Look at ``item`` at ``first`` (``time.monotonic()`` seconds); returns its key."""
        key = next(self._keys)
        self._watched[key] = item
        self._push(first, key)
        return key

    def forget(self, key: int) -> None:
        """Stop watching the item under ``key``."""
        self._watched.pop(key, None)
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._watched):
            self._heap = [e for e in self._heap if e[1] in self._watched]
            heapq.heapify(self._heap)

    def _push(self, when: float, key: int) -> None:
        heapq.heappush(self._heap, (when, key))
        if self._heap[0][1] == key:
            self._wakeup.set()  # earlier than what the loop sleeps towards

    def _spawn(self, action: Callable[[], Awaitable[None]]) -> None:
        self._tg.start_soon(_guarded, action)

    async def run(self, clock: Callable[[], float]) -> None:
        """Serve the timers until cancelled; ``clock`` is the requests' clock
        (``time.monotonic``)."""
        async with anyio.create_task_group() as self._tg:
            try:
                while True:
                    now = clock()
                    heap = self._heap
                    while heap and heap[0][0] <= now:
                        _when, key = heapq.heappop(heap)
                        item = self._watched.get(key)
                        if item is None:
                            continue
                        try:
                            again = item.due(now, self._spawn)
                        except Exception:  # a bug in one item: it alone stops being watched
                            log.exception("watchdog item %r failed", item)
                            again = None
                        if again is None:
                            del self._watched[key]
                        else:  # never sooner than MIN_STEP: no item can spin the loop
                            heapq.heappush(heap, (max(again, now + MIN_STEP), key))
                    delay = heap[0][0] - now if heap else math.inf
                    self._wakeup = anyio.Event()
                    with anyio.move_on_after(delay):
                        await self._wakeup.wait()
            finally:
                self._tg = None


async def _guarded(action: Callable[[], Awaitable[None]]) -> None:
    # One request's failing write must not end every request's timers.
    try:
        await action()
    except Exception:
        log.exception("watchdog action %r failed", action)
