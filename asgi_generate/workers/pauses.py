"""Pauses of a protocol's fleet, and the streams held across them.

A trainer pauses the engines to update their weights: SGLang
``/pause_generation`` ``{"mode": "abort"}`` and vLLM ``/pause?mode=abort``
end every running request with the engine's abort; so does a weight call
that aborts without pausing (SGLang's weight routes with
``abort_all_requests``, true by default for ``/update_weight_version``).
Each is a fleet transaction: the admin routes tell this table when one
begins (before the engines get it) and when it ends: a pause when the
fleet's resume (``/continue_generation``, ``/resume``) was answered, a call
when the call itself was answered. A stream whose engine aborted it while a
transaction was open or after one began (:meth:`Pauses.aborted_since`, the
one decision) may be held (:meth:`Pauses.hold`) until no transaction is
open, then continue as a migrated leg on the new weights. Held streams have
a bound, in number and in time.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import anyio

#: Why a stream was not held, or stopped being held.
FULL, EXPIRED = "full", "expired"


class Pauses:
    """Each protocol's fleet transactions (pauses and aborting calls) and
    the streams held across them.

    ``epoch(protocol)`` counts the transactions begun: a leg whose
    :meth:`mark` is below the epoch when it ends with the engine's abort was
    aborted by one (:meth:`aborted_since`).
    """

    def __init__(self) -> None:
        self._epochs: dict[str, int] = {}
        #: Set once no transaction of the protocol is open (popped then).
        self._resumed: dict[str, anyio.Event] = {}
        self._paused: set[str] = set()
        #: Aborting calls in flight per protocol.
        self._calls: dict[str, int] = {}
        self.held = 0
        self.counts = {"held": 0, "resumed": 0, "refused_full": 0, "expired": 0}

    def epoch(self, protocol: str) -> int:
        """Pauses of ``protocol``'s fleet begun so far."""
        return self._epochs.get(protocol, 0)

    def paused(self, protocol: str) -> bool:
        """Whether a transaction of ``protocol``'s fleet is open now (a
        pause, or an aborting call in flight): its held streams wait."""
        return protocol in self._resumed

    def pausing(self, protocol: str) -> bool:
        """Whether a pause of ``protocol``'s fleet is open now (begun, not
        yet ended; an aborting call alone is not one)."""
        return protocol in self._paused

    def mark(self, protocol: str) -> int:
        """What a leg planned now notes for :meth:`aborted_since`: the
        epoch, less one while a transaction is open (its abort may reach
        the leg too)."""
        return self.epoch(protocol) - (protocol in self._resumed)

    def aborted_since(self, protocol: str, mark: int) -> bool:
        """Whether an engine abort of a leg planned at ``mark`` was a fleet
        transaction's: one began since, or was open then."""
        return self.epoch(protocol) > mark

    def begin(self, protocol: str) -> None:
        """A pause that aborts running requests is about to reach the
        engines of ``protocol``; open until :meth:`end`."""
        self._paused.add(protocol)
        self._open(protocol)

    def end(self, protocol: str) -> None:
        """The fleet of ``protocol`` was told to resume: held streams go
        on, once no aborting call is in flight either."""
        self._paused.discard(protocol)
        self._close(protocol)

    @contextmanager
    def call(self, protocol: str) -> Iterator[None]:
        """A call that aborts ``protocol``'s running requests without
        pausing: open while the block runs (the call sent and answered)."""
        self.open_call(protocol)
        try:
            yield
        finally:
            self.close_call(protocol)

    def open_call(self, protocol: str) -> None:
        """An aborting call of ``protocol`` began (here, or in a sibling
        process that said so); open until :meth:`close_call`."""
        self._calls[protocol] = self._calls.get(protocol, 0) + 1
        self._open(protocol)

    def close_call(self, protocol: str) -> None:
        """An aborting call :meth:`open_call` opened was answered."""
        if self._calls.get(protocol, 0):
            self._calls[protocol] -= 1
        self._close(protocol)

    def _open(self, protocol: str) -> None:
        self._epochs[protocol] = self.epoch(protocol) + 1
        self._resumed.setdefault(protocol, anyio.Event())

    def _close(self, protocol: str) -> None:
        if protocol in self._paused or self._calls.get(protocol, 0):
            return
        resumed = self._resumed.pop(protocol, None)
        if resumed is not None:
            resumed.set()

    async def hold(self, protocol: str, limit: int, timeout: float) -> str | None:
        """Hold one stream until ``protocol``'s fleet resumes (at once when
        it already did); ``None`` when it may go on, else why not:
        :data:`FULL` (``limit`` streams are held already) or
        :data:`EXPIRED` (no resume within ``timeout`` seconds)."""
        if self.held >= limit:
            self.counts["refused_full"] += 1
            return FULL
        self.held += 1
        self.counts["held"] += 1
        try:
            resumed = self._resumed.get(protocol)
            if resumed is not None:
                with anyio.move_on_after(timeout):
                    await resumed.wait()
                if not resumed.is_set():
                    self.counts["expired"] += 1
                    return EXPIRED
            self.counts["resumed"] += 1
            return None
        finally:
            self.held -= 1

    def stats(self) -> dict[str, Any]:
        """The ``/stats`` ``pauses`` block."""
        return {"paused": sorted(self._resumed), "held_now": self.held, **self.counts}
