"""Leaner per-connection objects for hypercorn's worker classes (hypercorn
0.18.0), used by the connections of
:mod:`asgi_generate.server.hypercorn.asyncio_serve` and
:mod:`asgi_generate.server.hypercorn.trio_serve` (and installed with them by
:func:`asgi_generate.server.hypercorn.patches.install`). An open SSE stream
keeps its client connection's objects for its whole life; the bytes saved
per object are tracemalloc's (UPSTREAM.md, "Per-connection memory").

asyncio:

- Every ``collections.deque`` allocates a 64-slot block on creation, about
  700 bytes, and asyncio's ``Queue`` holds four of them (its items, getters,
  putters and the ``Event`` behind ``join()``), ``Event`` one. hypercorn
  creates per connection one ``asyncio.Queue`` for the ASGI app's messages
  (``TaskGroup.spawn_app`` in ``hypercorn/asyncio/task_group.py``) and one
  ``asyncio.Event`` (``H11Protocol.can_read``, from
  ``WorkerContext.event_class`` in ``hypercorn/asyncio/worker_context.py``):
  :class:`AppQueue` (3.1 KB less) and :class:`LeanEvent` (0.9 KB less) keep
  the same behaviour in lists that stay empty, and a future only while
  someone waits.

trio:

- hypercorn hands the app its messages through a trio memory channel
  (``TaskGroup.spawn_app`` in ``hypercorn/trio/task_group.py``): a channel
  state with a deque and two ordered dicts, and two channel ends each with a
  set. :class:`TrioAppQueue` keeps lists of items and of parked tasks
  (1.6 KB less).
- A ``trio.Lock`` (a parking lot and its ordered dict) guards each
  connection's writes, another its keep-alive task holder
  (``TrioSingleTask``), and a ``trio.Event`` behind a wrapper
  (``EventWrapper``) is H11Protocol's ``can_read``: :class:`TrioLock`,
  :class:`TrioSingleTask` and :class:`TrioEvent` keep a list of parked tasks
  only while one waits (0.9 KB less for the three).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import trio
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.trio import worker_context as trio_worker_context


async def wait_future(waiters: list[asyncio.Future]) -> None:
    """Park on a new future in ``waiters`` until :func:`_wake_one` or
    :func:`wake_all` sets it (raises what it was given, or the
    cancellation); a waiter cancelled after being woken by
    :func:`_wake_one` passes the wake-up on."""
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


def wake_all(waiters: list[asyncio.Future] | None, error: Callable[[], BaseException] | None = None) -> None:
    """Wake every future of ``waiters`` (a list its owner let go of, or
    ``None``) parked in :func:`wait_future`: with ``None``, or raising a
    new ``error()`` in each."""
    for fut in waiters or ():
        if not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error())


class AppQueue:
    """A FIFO queue of ASGI messages with ``asyncio.Queue``'s ``put`` and
    ``get`` semantics (``put`` waits while ``maxsize`` items are queued,
    ``maxsize`` <= 0 is unbounded; both are cancellation-safe: a cancelled
    ``get`` loses no item)."""

    __slots__ = ("_maxsize", "_items", "_getters", "_putters")

    def __init__(self, maxsize: int) -> None:
        self._maxsize = maxsize
        self._items: list[Any] = []
        # Lists of waiters only while someone waits (an open stream has none).
        self._getters: list[asyncio.Future] | None = None
        self._putters: list[asyncio.Future] | None = None

    async def put(self, item: Any) -> None:
        while 0 < self._maxsize <= len(self._items):
            if self._putters is None:
                self._putters = []
            await wait_future(self._putters)
        if not self._putters:
            self._putters = None
        self._items.append(item)
        if self._getters:
            _wake_one(self._getters)

    def get_nowait(self) -> Any:
        """The next item, taken as :meth:`get` takes it, if one is queued;
        else ``None`` (ASGI messages are dicts)."""
        if not self._items:
            return None
        item = self._items.pop(0)
        if self._putters:
            _wake_one(self._putters)
        return item

    async def get(self) -> Any:
        while not self._items:
            if self._getters is None:
                self._getters = []
            await wait_future(self._getters)
        if not self._getters:
            self._getters = None
        item = self._items.pop(0)
        if self._putters:
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
        await wait_future(self._waiters)

    async def set(self) -> None:
        self._set = True
        waiters, self._waiters = self._waiters, None
        wake_all(waiters)

    def is_set(self) -> bool:
        return self._set


class AsyncioWorkerContext(WorkerContext):
    """hypercorn's asyncio worker context with :class:`LeanEvent` for the
    events its protocols make per connection (``H11Protocol.can_read``)."""

    event_class = LeanEvent


class TrioAppQueue:
    """A FIFO queue of ASGI messages with a trio memory channel's ``send``
    (:meth:`put`) and ``receive`` (:meth:`get`) semantics: ``put`` waits
    while ``maxsize`` items are queued (``maxsize`` <= 0: unbounded); both are
    checkpoints and cancellable, and a cancelled ``get`` loses no item."""

    __slots__ = ("_maxsize", "_items", "_getters", "_putters")

    def __init__(self, maxsize: int) -> None:
        self._maxsize = maxsize
        self._items: list[Any] = []
        # Lists of parked tasks only while someone waits.
        self._getters: list | None = None
        self._putters: list | None = None

    async def put(self, item: Any) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        while 0 < self._maxsize <= len(self._items):
            if self._putters is None:
                self._putters = []
            await park(self._putters)
        if not self._putters:
            self._putters = None
        self._items.append(item)
        if self._getters:
            unpark_one(self._getters)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def get_nowait(self) -> Any:
        """The next item, taken as :meth:`get` takes it (but no
        checkpoint), if one is queued; else ``None`` (ASGI messages are
        dicts)."""
        if not self._items:
            return None
        item = self._items.pop(0)
        if self._putters:
            unpark_one(self._putters)
        return item

    async def get(self) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._items:
            if self._getters is None:
                self._getters = []
            await park(self._getters)
        if not self._getters:
            self._getters = None
        item = self._items.pop(0)
        if self._putters:
            unpark_one(self._putters)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return item


async def park(tasks: list) -> None:
    """Sleep in ``tasks`` until :func:`unpark_one` wakes this task (a
    wake-up is final in trio: a task woken is never also cancelled here)."""
    task = trio.lowlevel.current_task()
    tasks.append(task)

    def abort(_raise_cancel: Any) -> trio.lowlevel.Abort:
        tasks.remove(task)
        return trio.lowlevel.Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort)


def unpark_one(tasks: list) -> None:
    if tasks:
        trio.lowlevel.reschedule(tasks.pop(0))


class TrioLock:
    """``trio.Lock`` as hypercorn uses it (``async with``; FIFO, a checkpoint,
    the lock handed to the next waiter on release), with a list of parked
    tasks only while it is contended."""

    __slots__ = ("_held", "_waiters")

    def __init__(self) -> None:
        self._held = False
        self._waiters: list | None = None

    async def __aenter__(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._held:
            self._held = True
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if self._waiters is None:
            self._waiters = []
        await park(self._waiters)  # woken holding the lock

    async def __aexit__(self, *exc: Any) -> None:
        if self._waiters:
            unpark_one(self._waiters)
        else:
            self._held = False
            self._waiters = None


class TrioEvent:
    """hypercorn's trio ``IOEvent`` (``EventWrapper``) on a list of parked
    tasks: ``wait`` is a checkpoint, ``set`` wakes every waiter, ``clear``
    lets the next ``wait`` park."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list | None = None

    async def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        if self._set:
            await trio.lowlevel.checkpoint()
            return
        if self._waiters is None:
            self._waiters = []
        await park(self._waiters)

    async def set(self) -> None:
        self._set = True
        waiters, self._waiters = self._waiters, None
        for task in waiters or ():
            trio.lowlevel.reschedule(task)

    def is_set(self) -> bool:
        return self._set


class TrioSingleTask(trio_worker_context.TrioSingleTask):
    """hypercorn's keep-alive task holder with a :class:`TrioLock`."""

    def __init__(self) -> None:
        self._handle = None
        self._lock = TrioLock()


class TrioWorkerContext(trio_worker_context.WorkerContext):
    """hypercorn's trio worker context with :class:`TrioEvent` for the
    events its protocols make per connection (``H11Protocol.can_read``)."""

    event_class = TrioEvent
