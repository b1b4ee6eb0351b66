"""What the ``kv-aware`` policy keeps of one worker: its KV index, the
subscriber that fills it, and its engine's last load reading with this
replica's share of it."""

from __future__ import annotations

import anyio

from ..engine_load import EngineLoad
from ..kv_events import Subscriber
from ..kv_index import KVIndex
from . import Candidate


def moving_average(average: float, sample: float, samples_before: int) -> float:
    """``average`` moved a fifth of the way to ``sample``, or ``sample``
    itself when it is the first (no start value to creep up from)."""
    return average + 0.2 * (sample - average) if samples_before else sample


class WorkerKV:
    """What the policy keeps of one worker."""

    __slots__ = ("index", "worker", "_subscriber", "why_tree", "engine", "others", "why_own", "readings", "peak",
                 "per_request", "routed", "read_at", "read_mark", "skipped", "waiter")

    def __init__(self, index: KVIndex, worker: Candidate) -> None:
        self.index = index
        #: The worker itself (its in-flight legs, for ``/stats``).
        self.worker = worker
        self._subscriber: Subscriber | None = None
        self.why_tree = "discovering"
        #: The engine's last load reading, and the requests in it that
        #: other replicas sent.
        self.engine: EngineLoad | None = None
        self.others = self.readings = 0
        self.why_own = "no reading yet"
        #: The most requests this replica had outstanding here since the
        #: current reading was asked for.
        self.peak = 0
        #: Engine sequences per request this replica routed here (a moving
        #: average, seeded by the first): the engines count ``n`` samples
        #: as ``n`` requests.
        self.per_request = 1.0
        self.routed = 0
        #: When the last reading was taken (the policy's clock), what had
        #: happened here by then (:meth:`activity`), and the readings
        #: skipped as idle since the first (:func:`.kv_loads.read_due`).
        self.read_at = 0.0
        self.read_mark: tuple[int, int] = (-1, -1)
        self.skipped = 0
        #: Set by :meth:`wake`: what an idle engine's load reader waits on.
        self.waiter: anyio.Event | None = None

    @property
    def subscriber(self) -> Subscriber | None:
        """What follows the engine's events into :attr:`index` (``None``:
        none, the worker is scored by its tree); setting it (or clearing
        it) counts as a change of the index's
        :attr:`~asgi_generate.workers.kv_index.SharedBlocks.layout`."""
        return self._subscriber

    @subscriber.setter
    def subscriber(self, subscriber: Subscriber | None) -> None:
        if (subscriber is None) != (self._subscriber is None):
            self.index.shared.layout += 1
        self._subscriber = subscriber

    def activity(self) -> tuple[int, int]:
        """What moves when anyone uses the worker: the requests this
        replica routed here, and the event batches its engine published
        (another replica's request is prefilled, and published, here)."""
        return self.routed, self.subscriber.batches if self.subscriber is not None else 0

    def wake(self) -> None:
        """:meth:`activity` moved (a request routed here, a batch of events
        published): a load reader waiting on :attr:`waiter` reads now."""
        if self.waiter is not None:
            self.waiter.set()
            self.waiter = None

    def requests(self, outstanding: int) -> float:
        """The fleet's requests here, in the engine's units, given this
        replica's ``outstanding`` ones (``kv-aware``'s choice computes the
        same for every candidate at once: :func:`~asgi_generate.hashes.kv_lowest`)."""
        return outstanding * self.per_request + self.others

    def read(self, load: EngineLoad | None, own: int) -> None:
        """Take an engine's ``load`` reading (``None``: none) while this
        replica had ``own`` requests outstanding there."""
        self.engine = load
        self.others = max(0, round(load.requests - own * self.per_request)) if load is not None else 0
