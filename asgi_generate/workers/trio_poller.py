"""Engine-socket reads on trio, parked in one poller task's own epoll set.

An open SSE stream parks its engine read for the stream's whole life. On
trio, ``trio.lowlevel.wait_readable`` in a ``trio.move_on_at`` scope costs
each parked read about 2.4 KB: four coroutine frames, trio's epoll waiter
and abort closure, and the deadline's ``CancelScope`` with a
``CancelStatus`` holding two sets. Here a read registers its socket in an
epoll set of our own (``EPOLLONESHOT``) and its deadline in one heap, both
served by one :class:`Poller` task per trio run, and parks its task in
``trio.lowlevel.wait_task_rescheduled`` (about 1 KB in all). The price is a
hop through the poller task per wake-up, which serves every socket that is
ready at once. Linux only (``select.epoll``, :data:`AVAILABLE`); elsewhere
:meth:`asgi_generate.workers.sockets.TCPConnection.receive` waits with
trio's own calls.

Only the task that reads a socket may close it (the worker client's
connections are closed by their owner once its reads end): a socket closed
under a parked read leaves the epoll set, and that read wakes at its
deadline at best (never, once the fd number is taken by a new socket).
"""

from __future__ import annotations

import heapq
import math
import select
from contextlib import suppress

import trio

#: Whether this platform has epoll (else reads wait with trio's own calls).
AVAILABLE = hasattr(select, "epoll")
#: Events taken from the epoll set per call (a full batch: call again).
BATCH = 1024
#: Heap entries allowed beyond two per parked read before a rebuild.
COMPACT_SLACK = 64
_MASK = getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLONESHOT", 0)
_POLLER: trio.lowlevel.RunVar = trio.lowlevel.RunVar("asgi_generate.trio_poller")


class _Parked:
    """One parked read: its task and deadline (``trio.current_time()``)."""

    __slots__ = ("poller", "fd", "task", "deadline")

    def __init__(self, poller: Poller, fd: int, task: trio.lowlevel.Task, deadline: float) -> None:
        self.poller = poller
        self.fd = fd
        self.task = task
        self.deadline = deadline

    def abort(self, _raise_cancel: object) -> trio.lowlevel.Abort:
        """trio's abort callback: the read was cancelled, forget it."""
        poller = self.poller
        if poller._parked.get(self.fd) is self:
            del poller._parked[self.fd]
            poller._disarm(self.fd)
        return trio.lowlevel.Abort.SUCCEEDED


class Poller:
    """The parked engine reads of one trio run (:func:`current`).

    ``_parked`` maps a socket's fd to its parked read; ``_heap`` holds
    ``(deadline, fd)`` entries with at most one live entry per fd (its
    time in ``_due``): a read whose deadline is later than its fd's entry,
    as each next read of a stream is, pushes nothing, and the entry, when
    it comes up, is moved on to the read's current deadline. An earlier
    deadline (a new request's head after a stream's long first-token wait)
    pushes a new entry and leaves the old one stale; once the heap holds
    more than ``2 * parked + COMPACT_SLACK`` entries it is rebuilt from the
    live ones, so it stays within that bound.
    """

    __slots__ = ("_epoll", "_parked", "_heap", "_due", "_scope")

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._parked: dict[int, _Parked] = {}
        self._heap: list[tuple[float, int]] = []
        self._due: dict[int, float] = {}
        self._scope: trio.CancelScope | None = None

    @trio.lowlevel.enable_ki_protection  # its bookkeeping is all or nothing
    def park(self, fd: int, deadline: float) -> _Parked:
        """Watch ``fd`` for the calling task until it is readable or
        ``deadline`` (``trio.current_time()``'s clock, ``math.inf``: none)
        passes; the caller then awaits
        ``trio.lowlevel.wait_task_rescheduled(parked.abort)``, in its own
        frame, and looks at the socket again (a wake-up is a hint: the
        socket may have nothing yet).

        Raises:
            trio.BusyResourceError: another task's read is parked on ``fd``.
            OSError: ``fd`` cannot be watched (not an open socket).
        """
        if fd in self._parked:
            raise trio.BusyResourceError("another task is already reading this socket")
        try:
            self._epoll.modify(fd, _MASK)
        except FileNotFoundError:  # first read on this socket
            self._epoll.register(fd, _MASK)
        parked = _Parked(self, fd, trio.lowlevel.current_task(), deadline)
        self._parked[fd] = parked
        if deadline < self._due.get(fd, math.inf):
            self._due[fd] = deadline
            heap = self._heap
            heapq.heappush(heap, (deadline, fd))
            if len(heap) > 2 * len(self._parked) + COMPACT_SLACK:
                self._compact()
            scope = self._scope
            if scope is not None and deadline < scope.deadline:
                scope.deadline = deadline
        return parked

    def _compact(self) -> None:
        # In place: run() holds the heap. Only parked reads need an entry,
        # and each has at most one live one (its _due).
        parked = self._parked
        due = {fd: when for fd, when in self._due.items() if fd in parked}
        self._due = due
        self._heap[:] = [(when, fd) for fd, when in due.items()]
        heapq.heapify(self._heap)

    def _disarm(self, fd: int) -> None:
        # Out of the set, not modify(fd, 0): the kernel adds EPOLLERR and
        # EPOLLHUP to every modify, level-triggered, so a peer's reset
        # would wake the poller again and again. The next park registers
        # the socket anew.
        with suppress(OSError):  # closed already: it left the set
            self._epoll.unregister(fd)

    def _wake_ready(self) -> None:
        parked = self._parked
        while True:
            events = self._epoll.poll(0, BATCH)
            for fd, _mask in events:
                read = parked.pop(fd, None)
                if read is not None:
                    trio.lowlevel.reschedule(read.task)
            if len(events) < BATCH:
                return

    def _wake_due(self, now: float) -> None:
        heap, due, parked = self._heap, self._due, self._parked
        while heap and heap[0][0] <= now:
            when, fd = heapq.heappop(heap)
            if due.get(fd) == when:
                del due[fd]
            read = parked.get(fd)
            if read is None:
                continue
            if read.deadline <= now:
                del parked[fd]
                self._disarm(fd)
                trio.lowlevel.reschedule(read.task)
            elif read.deadline < due.get(fd, math.inf):
                due[fd] = read.deadline
                heapq.heappush(heap, (read.deadline, fd))

    async def run(self) -> None:
        """Wake parked reads until the run ends (a system task)."""
        epfd = self._epoll.fileno()
        heap = self._heap
        try:
            while True:
                with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as self._scope:
                    await trio.lowlevel.wait_readable(epfd)
                self._scope = None
                self._wake_ready()
                if heap:
                    self._wake_due(trio.current_time())
        finally:
            self._scope = None
            self._epoll.close()


@trio.lowlevel.enable_ki_protection
def current() -> Poller:
    """This trio run's :class:`Poller`, started (as a system task) on first use."""
    try:
        return _POLLER.get()
    except LookupError:
        poller = Poller()
        trio.lowlevel.spawn_system_task(poller.run, name="asgi_generate.trio_poller")
        _POLLER.set(poller)  # only once its task runs
        return poller
