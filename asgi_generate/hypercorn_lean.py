"""Leaner per-connection objects for hypercorn's asyncio worker class
(hypercorn 0.18.0), installed by :func:`install` (from
:func:`asgi_generate.hypercorn_fixes.install`).

Every ``collections.deque`` allocates a 64-slot block on creation, about
700 bytes, and asyncio's ``Queue`` holds four of them (its items, getters,
putters and the ``Event`` behind ``join()``), ``Event`` one. hypercorn
creates per connection one ``asyncio.Queue`` for the ASGI app's messages
(``TaskGroup.spawn_app`` in ``hypercorn/asyncio/task_group.py``) and one
``asyncio.Event`` (``H11Protocol.can_read``, from
``WorkerContext.event_class`` in ``hypercorn/asyncio/worker_context.py``):
about 3.4 KB of an open SSE stream's memory. :class:`AppQueue` and
:class:`LeanEvent` keep the same behaviour in lists that stay empty, and a
future only while someone waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from hypercorn.asyncio import run as asyncio_run
from hypercorn.asyncio import tcp_server as asyncio_tcp_server
from hypercorn.asyncio.task_group import TaskGroup, _handle
from hypercorn.asyncio.worker_context import WorkerContext


async def _wait(waiters: list[asyncio.Future]) -> None:
    """Park on a new future in ``waiters`` until :func:`_wake_one` sets it;
    a waiter cancelled after being woken passes the wake-up on."""
    fut = asyncio.get_running_loop().create_future()
    waiters.append(fut)
    try:
        await fut
    except BaseException:
        if fut in waiters:
            waiters.remove(fut)
        elif fut.done() and not fut.cancelled():
            _wake_one(waiters)
        raise


def _wake_one(waiters: list[asyncio.Future]) -> None:
    while waiters:
        fut = waiters.pop(0)
        if not fut.done():
            fut.set_result(None)
            return


class AppQueue:
    """A FIFO queue of ASGI messages with ``asyncio.Queue``'s ``put`` and
    ``get`` semantics (``put`` waits while ``maxsize`` items are queued,
    ``maxsize`` <= 0 is unbounded; both are cancellation-safe: a cancelled
    ``get`` loses no item)."""

    __slots__ = ("_maxsize", "_items", "_getters", "_putters")

    def __init__(self, maxsize: int) -> None:
        self._maxsize = maxsize
        self._items: list[Any] = []
        self._getters: list[asyncio.Future] = []
        self._putters: list[asyncio.Future] = []

    async def put(self, item: Any) -> None:
        while 0 < self._maxsize <= len(self._items):
            await _wait(self._putters)
        self._items.append(item)
        _wake_one(self._getters)

    async def get(self) -> Any:
        while not self._items:
            await _wait(self._getters)
        item = self._items.pop(0)
        _wake_one(self._putters)
        return item


class LeanEvent:
    """hypercorn's asyncio ``IOEvent`` (``EventWrapper``) on futures."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[asyncio.Future] | None = None

    async def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        if self._set:
            return
        if self._waiters is None:
            self._waiters = []
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            if self._waiters is not None and fut in self._waiters:
                self._waiters.remove(fut)

    async def set(self) -> None:
        self._set = True
        waiters, self._waiters = self._waiters, None
        for fut in waiters or ():
            if not fut.done():
                fut.set_result(None)

    def is_set(self) -> bool:
        return self._set


class _AsyncioTaskGroup(TaskGroup):
    async def spawn_app(
        self, app: Any, config: Any, scope: dict, send: Callable[[Any], Awaitable[None]]
    ) -> Callable[[Any], Awaitable[None]]:
        # As hypercorn's, with AppQueue for asyncio.Queue.
        app_queue = AppQueue(config.max_app_queue_size)

        def _call_soon(func: Callable, *args: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(func(*args), self._loop).result()

        self.spawn(
            _handle, app, config, scope, app_queue.get, send, partial(self._loop.run_in_executor, None), _call_soon
        )
        return app_queue.put


class _AsyncioWorkerContext(WorkerContext):
    event_class = LeanEvent


def install() -> None:
    """Make hypercorn's asyncio worker class use the lean classes (idempotent)."""
    asyncio_tcp_server.TaskGroup = _AsyncioTaskGroup
    asyncio_run.WorkerContext = _AsyncioWorkerContext
