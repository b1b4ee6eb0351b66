"""Leaner per-connection objects for hypercorn's worker classes (hypercorn
0.18.0), installed by :func:`install` (from
:func:`asgi_generate.server.hypercorn.fixes.install`). An open SSE stream keeps its
client connection's objects for its whole life; each saving below is
measured per stream by bench/bench_streams.py (its README section).

asyncio:

- Every ``collections.deque`` allocates a 64-slot block on creation, about
  700 bytes, and asyncio's ``Queue`` holds four of them (its items, getters,
  putters and the ``Event`` behind ``join()``), ``Event`` one. hypercorn
  creates per connection one ``asyncio.Queue`` for the ASGI app's messages
  (``TaskGroup.spawn_app`` in ``hypercorn/asyncio/task_group.py``) and one
  ``asyncio.Event`` (``H11Protocol.can_read``, from
  ``WorkerContext.event_class`` in ``hypercorn/asyncio/worker_context.py``):
  about 3.4 KB. :class:`AppQueue` and :class:`LeanEvent` keep the same
  behaviour in lists that stay empty, and a future only while someone waits.
  The two helpers hypercorn makes per request for the app call (a thread
  spawner and a loop caller) are made once per loop (:func:`loop_calls`).
  The connection itself is :mod:`asgi_generate.server.hypercorn.asyncio_serve`'s.

both:

- h11 keeps an empty ``set`` of protocol-switch proposals per connection,
  and makes a new one for every response:
  :class:`asgi_generate.workers.h11_state.LeanConnectionState` shares one empty
  frozenset.
- The scope's ``client`` and ``server`` tuples: :func:`socket_addresses`
  interns the client's host and shares one server tuple per local address.

trio:

- hypercorn hands the app its messages through a trio memory channel
  (``TaskGroup.spawn_app`` in ``hypercorn/trio/task_group.py``): a channel
  state with a deque and two ordered dicts, and two channel ends each with a
  set, about 1.6 KB. :class:`TrioAppQueue` keeps lists of items and of
  parked tasks.
- A ``trio.Lock`` (a parking lot and its ordered dict, about 340 bytes)
  guards each connection's writes, another its keep-alive task holder
  (``TrioSingleTask``, 430 bytes in all), and a ``trio.Event`` behind a
  wrapper (``EventWrapper``, 360 bytes) is H11Protocol's ``can_read``:
  :class:`TrioLock`, :class:`TrioSingleTask` and :class:`TrioEvent` keep a
  list of parked tasks only while one waits.
- The connection itself (which reads under no deadline without a
  ``read_timeout``) is :mod:`asgi_generate.server.hypercorn.trio_serve`'s.
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from hypercorn import protocol as hc_protocol
from hypercorn.asyncio import run as asyncio_run
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.events import Event, RawData
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H2CProtocolRequiredError, H2ProtocolAssumedError
from hypercorn.trio import run as trio_run
from hypercorn.utils import parse_socket_addr
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


class _LoopCalls:
    """The ``sync_spawn`` and ``call_soon`` hypercorn hands every app call,
    made once per event loop rather than per request (two closures, about
    320 bytes of each open stream)."""

    __slots__ = ("loop", "sync_spawn")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sync_spawn = partial(loop.run_in_executor, None)

    def call_soon(self, func: Callable, *args: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(func(*args), self.loop).result()


#: One :class:`_LoopCalls` per live event loop.
_LOOP_CALLS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopCalls]" = weakref.WeakKeyDictionary()


def loop_calls(loop: asyncio.AbstractEventLoop) -> _LoopCalls:
    """The :class:`_LoopCalls` of ``loop``, made on first use."""
    calls = _LOOP_CALLS.get(loop)
    if calls is None:
        calls = _LOOP_CALLS[loop] = _LoopCalls(loop)
    return calls


#: Local addresses kept to be shared (a server listens on few).
LOCAL_ADDRESSES_KEPT = 64
_local_addresses: dict[tuple, tuple] = {}


def socket_addresses(sock: Any) -> tuple[tuple | None, tuple | None]:
    """The scope's ``client`` and ``server`` of a connected socket, as
    hypercorn's ``parse_socket_addr`` gives them, with the client's host
    string interned and the server's tuple shared by every connection to
    the same local address (a tuple and a string fewer per connection).

    Raises:
        OSError: the socket is no longer connected.
    """
    client = parse_socket_addr(sock.family, sock.getpeername())
    server = parse_socket_addr(sock.family, sock.getsockname())
    if client is not None:
        client = (sys.intern(client[0]), client[1])
    if server is not None:
        shared = _local_addresses.get(server)
        if shared is not None:
            server = shared
        elif len(_local_addresses) < LOCAL_ADDRESSES_KEPT:
            _local_addresses[server] = server
    return client, server


def new_protocol(alpn: str | None, owner: Any, conn: Any, ssl: bool, client: tuple | None,
                 server: tuple | None, send: Callable) -> Any:
    """What hypercorn's ``ProtocolWrapper`` (``hypercorn/protocol/__init__.py``)
    wraps, without the wrapper (~250 bytes of every connection): an
    ``H2Protocol`` for ALPN ``h2``, else an ``H11Protocol`` (the patched one
    :mod:`asgi_generate.server.hypercorn.fixes` installs). ``owner`` has the
    ``app``, ``config``, ``context`` and ``state``; ``conn`` is the task
    group, and :func:`handle` its events."""
    cls = H2Protocol if alpn == "h2" else hc_protocol.H11Protocol
    return cls(owner.app, owner.config, owner.context, conn, owner.state, ssl, client, server, send)


async def handle(conn: Any, event: Event, owner: Any, ssl: bool, send: Callable) -> None:
    """``conn.protocol.handle(event)`` as ``ProtocolWrapper.handle`` does it:
    HTTP/1.1 turning into h2 (prior knowledge, or an ``h2c`` upgrade) gets
    ``conn.protocol`` replaced by an ``H2Protocol``, which then takes the
    rest of the data (arguments as for :func:`new_protocol`)."""
    try:
        await conn.protocol.handle(event)
    except (H2ProtocolAssumedError, H2CProtocolRequiredError) as error:
        old = conn.protocol
        conn.protocol = new_protocol("h2", owner, conn, ssl, old.client, old.server, send)
        if isinstance(error, H2CProtocolRequiredError):
            await conn.protocol.initiate(error.headers, error.settings)
        else:
            await conn.protocol.initiate()
        if error.data != b"":
            await conn.protocol.handle(RawData(data=error.data))


class _AsyncioWorkerContext(WorkerContext):
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


class _TrioWorkerContext(trio_worker_context.WorkerContext):
    event_class = TrioEvent


def install() -> None:
    """Make hypercorn's worker contexts use the lean events (idempotent);
    the connections of :mod:`asgi_generate.server.hypercorn.asyncio_serve` and
    :mod:`asgi_generate.server.hypercorn.trio_serve` use the rest."""
    asyncio_run.WorkerContext = _AsyncioWorkerContext
    trio_run.WorkerContext = _TrioWorkerContext
