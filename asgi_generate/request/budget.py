"""The global budget of request body bytes being read and decoded at once.

A request reserves its declared ``Content-Length`` (or the body cap, when it
is chunked) before its first ``receive()``, and gives the reservation back
once its body is decoded and checked. A request that cannot reserve waits its
turn, first come first served, for a bounded time; past it the handler
answers 503 with ``Retry-After`` without reading the body. While a request
waits, hypercorn stops reading its socket once its small app queue is full
(``max_app_queue_size`` messages), so a waiting upload holds next to nothing.

Decoding expands a JSON body several times over (a list of token ids costs
about eight times its text as Python ints), so the default budget is a small
share of the machine's memory: see :func:`asgi_generate.config.default_budget_bytes`;
and large bodies are decoded in one worker thread, one at a time
(:attr:`BodyBudget.decode_limiter`).
"""

from __future__ import annotations

import ctypes
from collections import deque

import anyio

MiB = 1024 * 1024
#: A reservation this large marks the heap for trimming once it is given
#: back (1 MiB: below it, bodies come and go without fragmenting much).
TRIM_AFTER_BYTES = MiB


def _malloc_trim():
    """glibc's ``malloc_trim`` from the process's own symbols, or ``None``
    elsewhere (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


_MALLOC_TRIM = _malloc_trim()


class BodyBudget:
    """A byte budget handed out in FIFO order.

    Args:
        capacity: bytes that may be reserved at once; a reservation larger
            than this is clamped to it (it then waits for the whole budget).

    Attributes:
        reading: requests whose body is being read now (granted their
            budget); the handler counts them.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.reading = 0
        self._freed_large = False
        self._waiters: deque[tuple[int, anyio.Event]] = deque()
        self._decode_limiter: anyio.CapacityLimiter | None = None

    @property
    def decode_limiter(self) -> anyio.CapacityLimiter:
        """One worker thread decodes large bodies, one at a time (made on
        first use: it needs the running event loop)."""
        if self._decode_limiter is None:
            self._decode_limiter = anyio.CapacityLimiter(1)
        return self._decode_limiter

    @property
    def waiting(self) -> int:
        """Requests waiting for a reservation now."""
        return len(self._waiters)

    async def reserve(self, nbytes: int, timeout: float) -> "Lease | None":
        """Reserve ``nbytes`` (clamped to the capacity), waiting at most
        ``timeout`` seconds behind earlier requests.

        Returns:
            the reservation, or ``None`` if the wait ran out (nothing is
            held then).
        """
        n = min(max(nbytes, 0), self.capacity)
        if not self._waiters and self.in_use + n <= self.capacity:
            self.in_use += n
            return Lease(self, n)
        entry = (n, anyio.Event())
        self._waiters.append(entry)
        try:
            with anyio.move_on_after(timeout):
                await entry[1].wait()
        except BaseException:  # cancelled from outside: hold nothing
            self._withdraw(entry)
            raise
        if not entry[1].is_set():
            self._withdraw(entry)
            return None
        return Lease(self, n)

    def _withdraw(self, entry: tuple[int, anyio.Event]) -> None:
        if entry[1].is_set():  # granted just as the wait ended
            self.release(entry[0])
        else:
            self._waiters.remove(entry)
            self._wake()  # a large waiter leaving may unblock smaller ones

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` reserved by :meth:`reserve` (a :class:`Lease`
        does this once)."""
        self.in_use -= nbytes
        self._freed_large |= nbytes >= TRIM_AFTER_BYTES
        self._wake()

    def trim_if_idle(self) -> None:
        """Once no body is in the budget after large ones were, hand the
        memory they left free back to the OS. Call it when a request's
        objects are gone. glibc keeps freed heap pages otherwise: bodies
        arrive in 64 KiB pieces interleaved over many connections, and
        without this the process stayed ~150 MiB above its baseline after 50
        bodies of 30 MiB (``bench/bench_bodies.py``)."""
        if self._freed_large and self.in_use == 0:
            self._freed_large = False
            if _MALLOC_TRIM is not None:
                _MALLOC_TRIM(0)

    def _wake(self) -> None:
        # Grant in arrival order; the first waiter that does not fit blocks
        # the ones behind it, so a large body is never starved by small ones.
        while self._waiters and self.in_use + self._waiters[0][0] <= self.capacity:
            n, event = self._waiters.popleft()
            self.in_use += n
            event.set()


class Lease:
    """``nbytes`` of a :class:`BodyBudget`; :meth:`release` is idempotent."""

    __slots__ = ("budget", "nbytes")

    def __init__(self, budget: BodyBudget, nbytes: int) -> None:
        self.budget: BodyBudget | None = budget
        self.nbytes = nbytes

    def release(self) -> None:
        """Give the bytes back (once; later calls do nothing)."""
        if self.budget is not None:
            self.budget.release(self.nbytes)
            self.budget = None
