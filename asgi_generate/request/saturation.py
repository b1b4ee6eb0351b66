"""The fleet's room, from the engines' own load figures (admission's input).

Each worker's engine is asked for its queue
(:mod:`asgi_generate.workers.engine_load`: SGLang
``GET /v1/loads?include=core``, vLLM ``GET /metrics``). A worker has room for
``--admission-worker-requests`` engine requests (running plus waiting); what
it holds is what its engine counted at the last reading that this process
did not send (every other frontend process's and replica's), plus everything
this process admitted and has not released yet. So the reading is shared by
construction, and what this process dispatched since the reading is never
missed.

The readings' pace follows demand (:meth:`Saturation.read`): every
``--admission-load-interval`` seconds while requests wait in this process's
queue or the room is tight (under :data:`TIGHT_ROOM` of the capacity free),
else every ``--admission-load-idle-interval`` seconds; a request that has to
wait makes every reader read at once (:meth:`Saturation.hurry`). A worker
with no reading, or one overdue by ``--admission-load-stale`` seconds past
the pace it was taken at, counts as full, never as empty; so does one whose
engine reports ``--admission-waiting-tokens`` uncached prompt tokens waiting
or its KV cache ``--admission-kv-usage`` full, and every worker while its
fleet is paused. Where the routing policy reads the same route
(``kv-aware``'s load readings), one GET feeds both (:meth:`Saturation.read`'s
``share``).

Only ``aggregated`` and ``decode`` workers count: they hold running
sequences (a P/D pair's prefill leg is short-lived).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import anyio

from ..exceptions import WorkerError
from ..workers.engine_load import EngineLoad, LoadShare, parse_load
from ..workers.router import HOLDING_ROLES
from .admission import Room

log = logging.getLogger("asgi_generate.admission")
#: Seconds one load reading may take.
READ_TIMEOUT_S = 2.0
#: The room is tight (readings at the fast pace) while less than this share
#: of the capacity is free.
TIGHT_ROOM = 0.5


@dataclass(slots=True)
class Reading:
    """One worker's last load reading: the engine's figures, when taken
    (monotonic seconds), this process's sequences there then, and the
    pace (seconds to the next reading) in force when it was taken."""

    load: EngineLoad
    at: float
    own: int
    pace: float = 0.0

    @property
    def others(self) -> int:
        """Engine requests there that this process did not send."""
        return max(0, self.load.requests - self.own)


class Saturation:
    """Load readings per worker and the room they leave.

    Args:
        limit: engine requests one worker takes (``--admission-worker-requests``).
        waiting_tokens: uncached prompt tokens waiting past which a worker
            is full; 0: no such bound.
        kv_usage: the KV cache usage (a fraction) at which a worker is
            full; 0: no such bound.
        stale: seconds a reading may be overdue (past its pace) before it
            counts its worker as full.
        clock: monotonic seconds (tests pass a fake).
        interval, idle_interval: seconds between readings while the room
            is in demand, and while it is not (0: always ``interval``).
    """

    def __init__(self, limit: int, waiting_tokens: int = 0, stale: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, kv_usage: float = 0.0,
                 interval: float = 0.1, idle_interval: float = 1.0) -> None:
        self.limit = limit
        self.waiting_tokens = waiting_tokens
        self.kv_usage = kv_usage
        self.stale = stale
        self.clock = clock
        self.interval = interval
        self.idle_interval = max(interval, idle_interval)
        self.readings: dict[str, Reading] = {}
        self.failures: dict[str, str] = {}
        self.count = 0
        #: Readings taken at the fast pace, and skipped turns of the shared
        #: policy reader (figures for ``/stats``).
        self.fast = 0
        #: What each reader at the idle pace waits on (:meth:`hurry` sets them all).
        self._sleepers: set[anyio.Event] = set()

    def headroom(self, worker: Any, now: float) -> int | None:
        """Engine requests ``worker`` takes beyond the others' (its limit
        less what other processes hold there: may be negative), or ``None``
        while it counts as full: no reading, one overdue by ``stale``
        seconds, or past the waiting-token or KV bound."""
        reading = self.readings.get(worker.id)
        if reading is None or now - reading.at > reading.pace + self.stale:
            return None
        load = reading.load
        if self.waiting_tokens and load.waiting_tokens >= self.waiting_tokens:
            return None
        if self.kv_usage and load.kv_usage is not None and load.kv_usage >= self.kv_usage:
            return None
        return self.limit - reading.others

    def room(self, workers: Iterable[Any], routable: Callable[[Any], bool], paused: bool, held: int,
             per_request: float) -> Room:
        """The :class:`Room` of ``workers`` (one protocol's), given this
        process's ``held`` sequences and its sequences per admitted request
        (``per_request``: a leg counts that many engine requests)."""
        now = self.clock()
        ever = capacity = free = 0
        for w in workers:
            if w.role not in HOLDING_ROLES:
                continue
            ever += self.limit
            if not routable(w):
                continue
            capacity += self.limit
            if paused:
                continue
            head = self.headroom(w, now)
            if head is not None:
                free += max(0, head)
        return Room(max(0, free - held), capacity, ever)

    def free_on(self, worker: Any, own: int) -> int:
        """Sequences ``worker`` takes now, with ``own`` of this process's
        running there (0 while it counts as full)."""
        head = self.headroom(worker, self.clock())
        return 0 if head is None else max(0, head - own)

    def take(self, worker: Any, load: EngineLoad | None, own: int, pace: float | None = None) -> None:
        """Keep ``worker``'s reading ``load`` (``None``: it failed), taken
        while this process had ``own`` sequences there, the next due in
        ``pace`` seconds (default: the fast pace)."""
        if load is None:
            self.readings.pop(worker.id, None)
            return
        self.readings[worker.id] = Reading(load, self.clock(), own, self.interval if pace is None else pace)
        self.failures.pop(worker.id, None)
        self.count += 1

    @property
    def idle(self) -> bool:
        """Whether a reader waits at the idle pace (:meth:`hurry` would wake it)."""
        return bool(self._sleepers)

    def hurry(self) -> None:
        """Demand came (a request waits, or the room got tight): every
        reader at the idle pace reads now and then at the fast pace."""
        for sleeper in self._sleepers:
            sleeper.set()
        self._sleepers.clear()

    async def read(self, worker: Any, own: Callable[[], int], on_reading: Callable[[], None],
                   busy: Callable[[], bool], share: LoadShare | None = None) -> None:
        """Read ``worker``'s engine load while it is up, calling
        ``on_reading`` after each (the queue may pump); ``own()`` is this
        process's sequences there, ``busy()`` whether the room is in
        demand (then the pace is ``interval``, backing off while readings
        change nothing: :meth:`_pace`; else ``idle_interval``, cut short
        by :meth:`hurry`). With ``share`` (the routing policy's
        reader of the same route), it also reads whenever the policy's is
        due (busy: ticking at its interval; idle: woken when the policy's
        reading comes due, never polling), and hands the policy each reading.
        Runs until cancelled; returns at once when its engine has no load
        route (it then never counts as having room)."""
        path = worker.protocol.load_path
        if path is None:
            self.failures[worker.id] = f"no load route known for {worker.protocol.name}"
            return
        last = -float("inf")
        calm = 0  # readings in a row that changed nothing admission counts
        seen: tuple | None = None
        while True:
            hot = busy()
            pace = self._pace(hot, calm)
            now = self.clock()
            if not worker.healthy:
                if share is not None:
                    share.down()
            elif now - last >= pace or (share is not None and share.due(now)):
                last = now
                self.fast += pace < self.idle_interval
                window = share.begin() if share is not None else 0
                before = own()
                try:
                    with anyio.fail_after(READ_TIMEOUT_S):
                        async with worker.pool.request(b"GET", path) as resp:
                            body = await resp.read()
                    if resp.status != 200:
                        raise ValueError(f"answered {resp.status}")
                    load = parse_load(worker.protocol.name, body)
                except (TimeoutError, WorkerError, ValueError, KeyError) as exc:
                    why = f"GET {path.decode()}: {exc!r}"
                    if self.failures.get(worker.id) != why:
                        log.warning("worker %s: no load reading (%s): it counts as full for admission",
                                    worker.id, why)
                    self.failures[worker.id] = why
                    self.take(worker, None, 0)
                    calm, seen = 0, None
                    if share is not None:
                        share.end(None, why, window)
                else:
                    self.take(worker, load, max(before, own()), pace)
                    now_seen = (self.readings[worker.id].others, self.headroom(worker, self.clock()) is None)
                    calm = calm + 1 if now_seen == seen else 0
                    seen = now_seen
                    if share is not None:
                        share.end(load, None, window)
                on_reading()
                hot = busy()  # it may change with the reading
                pace = self._pace(hot, calm)
                now = self.clock()
            wait = pace - (now - last) if worker.healthy else pace
            if hot:
                if share is not None:
                    wait = min(wait, share.interval)
                await anyio.sleep(max(0.0, wait))
            else:  # idle: a request that has to wait wakes it, as does the policy's reading coming due
                woken = anyio.Event()
                self._sleepers.add(woken)
                if share is not None and worker.healthy:
                    wait = min(wait, share.until_due(now))
                    share.notify(woken)
                with anyio.move_on_after(max(0.0, wait)):
                    await woken.wait()
                self._sleepers.discard(woken)
                if not busy():
                    continue
                last, calm = -float("inf"), 0  # hurried: read now, then at the fast pace

    def _pace(self, busy: bool, calm: int) -> float:
        """Seconds to a worker's next reading: ``idle_interval`` unless the
        room is ``busy``; then ``interval``, doubled for each of ``calm``
        readings in a row that changed nothing admission counts (the
        others' requests there, whether it is full), up to
        ``idle_interval``: this process counts its own requests exactly,
        so a reading only tells what others sent, and while they send
        nothing it need not be asked ten times a second."""
        if not busy:
            return self.idle_interval
        return min(self.idle_interval, self.interval * (1 << min(calm, 16)))

    def stats(self) -> dict:
        """``/stats``: each worker's last reading (engine requests, waiting
        tokens, KV usage, age in seconds, this process's share, the pace
        it was taken at) or why none; readings in all and at the fast pace."""
        now = self.clock()
        rows: dict[str, Any] = {
            wid: {"engine_requests": r.load.requests, "waiting_tokens": r.load.waiting_tokens,
                  "kv_usage": r.load.kv_usage, "age_s": round(now - r.at, 3), "own": r.own,
                  "pace_s": r.pace, "stale": now - r.at > r.pace + self.stale}
            for wid, r in self.readings.items()
        }
        for wid, why in self.failures.items():
            rows.setdefault(wid, {})["error"] = why
        return {"limit_per_worker": self.limit, "readings": self.count, "fast_readings": self.fast,
                "interval_s": self.interval, "idle_interval_s": self.idle_interval, "workers": rows}
