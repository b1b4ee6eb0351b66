"""Pauses of a protocol's fleet, and the streams held across them.

A trainer pauses the engines to update their weights: SGLang
``/pause_generation`` ``{"mode": "abort"}`` and vLLM ``/pause?mode=abort``
end every running request with the engine's abort. The admin routes tell
this table when such a pause begins (before the engines get it) and when the
fleet's resume (``/continue_generation``, ``/resume``) was answered. A
stream whose engine aborted it after a pause began may be held
(:meth:`Pauses.hold`) until the resume, then continue as a migrated leg on
the new weights. Held streams have a bound, in number and in time.
"""

from __future__ import annotations

from typing import Any

import anyio

#: Why a stream was not held, or stopped being held.
FULL, EXPIRED = "full", "expired"


class Pauses:
    """Each protocol's pause state and the streams held across pauses.

    ``epoch(protocol)`` counts the pauses begun: a leg planned at an
    earlier epoch that ends with the engine's abort was aborted by a pause.
    """

    def __init__(self) -> None:
        self._epochs: dict[str, int] = {}
        self._resumed: dict[str, anyio.Event] = {}
        self.held = 0
        self.counts = {"held": 0, "resumed": 0, "refused_full": 0, "expired": 0}

    def epoch(self, protocol: str) -> int:
        """Pauses of ``protocol``'s fleet begun so far."""
        return self._epochs.get(protocol, 0)

    def paused(self, protocol: str) -> bool:
        """Whether ``protocol``'s fleet is paused now."""
        return protocol in self._resumed

    def begin(self, protocol: str) -> None:
        """A pause that aborts running requests is about to reach the
        engines of ``protocol``."""
        self._epochs[protocol] = self.epoch(protocol) + 1
        self._resumed.setdefault(protocol, anyio.Event())

    def end(self, protocol: str) -> None:
        """The fleet of ``protocol`` was told to resume: held streams go on."""
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
