"""The fleet's room, from the engines' own load figures (admission's input).

Every ``--admission-load-interval`` seconds each worker's engine is asked
for its queue (:mod:`asgi_generate.workers.engine_load`: SGLang
``GET /v1/loads?include=core``, vLLM ``GET /metrics``). A worker has room for
``--admission-worker-requests`` engine requests (running plus waiting); what
it holds is what its engine counted at the last reading that this process
did not send (every other frontend process's and replica's), plus everything
this process admitted and has not released yet. So the reading is shared by
construction, and what this process dispatched since the reading is never
missed. A worker with no reading, or one older than
``--admission-load-stale`` seconds, counts as full, never as empty; so does
one whose engine reports ``--admission-waiting-tokens`` uncached prompt
tokens waiting or its KV cache ``--admission-kv-usage`` full, and every
worker while its fleet is paused.

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
from ..workers.engine_load import EngineLoad, parse_load
from .admission import Room

log = logging.getLogger("asgi_generate.admission")
#: Seconds one load reading may take.
READ_TIMEOUT_S = 2.0
#: Roles whose workers hold running sequences.
HOLDING_ROLES = ("aggregated", "decode")


@dataclass(slots=True)
class Reading:
    """One worker's last load reading: the engine's figures, when taken
    (monotonic seconds), and this process's sequences there then."""

    load: EngineLoad
    at: float
    own: int

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
        stale: seconds after which a reading counts its worker as full.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, limit: int, waiting_tokens: int = 0, stale: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, kv_usage: float = 0.0) -> None:
        self.limit = limit
        self.waiting_tokens = waiting_tokens
        self.kv_usage = kv_usage
        self.stale = stale
        self.clock = clock
        self.readings: dict[str, Reading] = {}
        self.failures: dict[str, str] = {}
        self.count = 0

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
            reading = self.readings.get(w.id)
            if paused or reading is None or now - reading.at > self.stale:
                continue
            load = reading.load
            if self.waiting_tokens and load.waiting_tokens >= self.waiting_tokens:
                continue
            if self.kv_usage and load.kv_usage is not None and load.kv_usage >= self.kv_usage:
                continue
            free += max(0, self.limit - reading.others)
        return Room(max(0, free - held), capacity, ever)

    def take(self, worker: Any, load: EngineLoad | None, own: int) -> None:
        """Keep ``worker``'s reading ``load`` (``None``: it failed), taken
        while this process had ``own`` sequences there."""
        if load is None:
            self.readings.pop(worker.id, None)
            return
        self.readings[worker.id] = Reading(load, self.clock(), own)
        self.failures.pop(worker.id, None)
        self.count += 1

    async def read(self, worker: Any, interval: float, own: Callable[[], int], on_reading: Callable[[], None]) -> None:
        """Read ``worker``'s engine load every ``interval`` seconds while it
        is up, calling ``on_reading`` after each (the queue may pump);
        ``own()`` is this process's sequences there. Runs until cancelled;
        returns at once when its engine has no load route (it then never
        counts as having room)."""
        path = worker.protocol.load_path
        if path is None:
            self.failures[worker.id] = f"no load route known for {worker.protocol.name}"
            return
        while True:
            if worker.healthy:
                before = own()
                try:
                    with anyio.fail_after(READ_TIMEOUT_S):
                        async with worker.pool.request(b"GET", path) as resp:
                            body = await resp.read()
                    if resp.status != 200:
                        raise ValueError(f"answered {resp.status}")
                    self.take(worker, parse_load(worker.protocol.name, body), max(before, own()))
                except (TimeoutError, WorkerError, ValueError, KeyError) as exc:
                    why = f"GET {path.decode()}: {exc!r}"
                    if self.failures.get(worker.id) != why:
                        log.warning("worker %s: no load reading (%s): it counts as full for admission",
                                    worker.id, why)
                    self.failures[worker.id] = why
                    self.take(worker, None, 0)
                on_reading()
            await anyio.sleep(interval)

    def stats(self) -> dict:
        """``/stats``: each worker's last reading (engine requests, waiting
        tokens, KV usage, age in seconds, this process's share) or why none."""
        now = self.clock()
        rows: dict[str, Any] = {
            wid: {"engine_requests": r.load.requests, "waiting_tokens": r.load.waiting_tokens,
                  "kv_usage": r.load.kv_usage,
                  "age_s": round(now - r.at, 3), "own": r.own, "stale": now - r.at > self.stale}
            for wid, r in self.readings.items()
        }
        for wid, why in self.failures.items():
            rows.setdefault(wid, {})["error"] = why
        return {"limit_per_worker": self.limit, "readings": self.count, "workers": rows}
