"""The process's bound on concurrent migrations.

When a worker carrying many streams dies, every stream resumes at once on
the survivors: each resumed leg prefills the prompt and the output so far
again, a burst of prefill work exactly when the fleet is short a worker.
:class:`MigrationSlots` lets at most ``--max-concurrent-migrations``
migrated streams (resumed or replayed attempts) run at once; a stream
holds its slot for its whole resumed life, its last token included, not
only until its first. A stream over the bound waits its turn (first come,
first served) after its migration backoff and, past ``--migration-wait``,
ends with the format's error in-band.

NVIDIA Dynamo bounds migrations per request only (``--migration-limit``,
``RetryManager`` in ``lib/llm/src/migration.rs``) and counts the ongoing
ones (``inc_migration_ongoing_request``); the bound here is fleet-wide, by
default twice the workers' count.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

import anyio

if TYPE_CHECKING:
    from ..tracing.state import RequestState


class MigrationSlots:
    """Slots for migrated streams, shared by one process's requests.

    Args:
        limit: the slots there are now (called at each acquire: the default
            follows the workers' count as workers come and go).

    Attributes:
        active: slots held now.
        peak: the most ever held at once.
    """

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.active = 0
        self.peak = 0
        self._waiters: deque[anyio.Event] = deque()

    @property
    def waiting(self) -> int:
        """Streams waiting for a slot now."""
        return len(self._waiters)

    async def acquire(self, wait: float, st: "RequestState") -> bool:
        """Take a slot for the request of ``st``, waiting up to ``wait``
        seconds behind the streams that came first; whether one was taken
        (the caller then calls :meth:`give_back` exactly once). A wait is
        noted in ``st.migration_wait`` (``taken`` or ``timed_out``)."""
        if not self._waiters and self.active < self.limit():
            self._hold()
            return True
        turn = anyio.Event()
        self._waiters.append(turn)
        try:
            with anyio.move_on_after(wait):
                while True:
                    if self._waiters[0] is turn and self.active < self.limit():
                        self._waiters.popleft()
                        self._hold()
                        self._wake_next()
                        st.migration_wait = "taken"
                        return True
                    await turn.wait()
                    turn = self._rearm(turn)
        finally:
            if turn in self._waiters:  # gave up (deadline, cancelled)
                first = self._waiters[0] is turn
                self._waiters.remove(turn)
                if first:
                    self._wake_next()
        st.migration_wait = "timed_out"
        return False

    def give_back(self) -> None:
        """Give a slot back; the first waiting stream may take it."""
        self.active -= 1
        self._wake_next()

    def stats(self) -> dict:
        """The ``/stats`` figures: ``limit``, ``active``, ``peak``, ``waiting``."""
        return {"limit": self.limit(), "active": self.active, "peak": self.peak, "waiting": self.waiting}

    def _hold(self) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)

    def _wake_next(self) -> None:
        if self._waiters:
            self._waiters[0].set()

    def _rearm(self, turn: anyio.Event) -> anyio.Event:
        """A fresh event in ``turn``'s place in the queue (an anyio event
        cannot be cleared)."""
        fresh = anyio.Event()
        self._waiters[self._waiters.index(turn)] = fresh
        return fresh
