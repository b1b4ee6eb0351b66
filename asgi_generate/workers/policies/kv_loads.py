"""The ``kv-aware`` policy's load readings: each engine's running and
waiting requests (:mod:`~asgi_generate.workers.engine_load`: SGLang
``GET /v1/loads``, vLLM ``GET /metrics``), read every ``interval`` seconds
while the worker is up, an idle engine's less often (:func:`read_due`: its
reader sleeps until the idle interval ends or something moves, never
polls), into its :class:`~asgi_generate.workers.policies.kv_worker.WorkerKV`.

With admission on, admission's reader of the same route takes the readings
for the policy (:class:`KVLoads` is its
:class:`~asgi_generate.workers.engine_load.LoadShare`): one GET feeds both."""

from __future__ import annotations

import logging
from typing import Any, Callable

import anyio

from ...exceptions import WorkerError
from ..engine_load import EngineLoad, parse_load
from .kv_sources import DISCOVERY_TIMEOUT_S
from .kv_worker import WorkerKV

log = logging.getLogger("asgi_generate.kv_aware")


class KVLoads:
    """What the policy does around one worker's load reading, whoever asks
    the engine (:func:`read_loads`, or admission's reader): a
    :class:`~asgi_generate.workers.engine_load.LoadShare`.

    Args:
        worker: the worker.
        kv: what the policy keeps of it.
        interval, idle_interval: see :func:`read_loads`.
        clock: the policy's monotonic clock.
    """

    __slots__ = ("worker", "kv", "interval", "idle_interval", "clock")

    def __init__(self, worker: Any, kv: WorkerKV, interval: float, idle_interval: float,
                 clock: Callable[[], float]) -> None:
        self.worker = worker
        self.kv = kv
        self.interval = interval
        self.idle_interval = idle_interval
        self.clock = clock

    def due(self, now: float) -> bool:
        """Whether the policy wants a reading at ``now`` (:func:`read_due`)."""
        return read_due(self.kv, self.worker.outstanding, now, self.idle_interval)

    def until_due(self, now: float) -> float:
        """Seconds from ``now`` until the policy wants a reading if nothing
        happens at the worker meanwhile: when :meth:`due`, ``interval``
        after the last (0: now); else, an idle engine's, ``idle_interval``
        after it."""
        if self.due(now):
            return max(0.0, self.kv.read_at + self.interval - now)
        return self.kv.read_at + self.idle_interval - now

    def notify(self, event: anyio.Event) -> None:
        """Set ``event`` when something happens at the worker that makes a
        reading due before :meth:`until_due` says (a request routed there,
        its engine publishing a batch of events:
        :meth:`.kv_worker.WorkerKV.wake`); the last event given wins."""
        self.kv.waiter = event

    def begin(self) -> int:
        """A reading is asked for now: the most requests this replica had
        outstanding here since the previous one was (:meth:`end` needs it)."""
        kv = self.kv
        kv.read_at, kv.read_mark = self.clock(), kv.activity()
        # Own requests that ended shortly before the reading may still be
        # in the engine's count: subtract the most this replica had there
        # since the previous reading was asked for.
        window, kv.peak = kv.peak, self.worker.outstanding
        return window

    def end(self, load: EngineLoad | None, why: str | None, begun: int) -> None:
        """Take the reading ``load``; on a failed one (``why``) count only
        this replica's requests until one succeeds."""
        kv, worker = self.kv, self.worker
        if load is not None:
            kv.read(load, max(begun, kv.peak, worker.outstanding))
            kv.readings += 1
            return
        if why != kv.why_own:  # once per reason, not per reading
            log.warning("worker %s (%s): no load reading (%s): weighed by this replica's own "
                        "requests", worker.id, worker.url, why)
        kv.read(None, 0)
        kv.why_own = why

    def down(self) -> None:
        """The worker is down: no reading stands."""
        self.kv.read(None, 0)
        self.kv.why_own = "worker down"


async def read_loads(worker: Any, kv: WorkerKV, interval: float, idle_interval: float,
                     clock: Callable[[], float]) -> None:
    """Read ``worker``'s engine load into ``kv`` every ``interval`` seconds
    while it is up (an idle engine's: :func:`read_due`, ``idle_interval``),
    on ``clock``; on a failed reading count only this replica's requests
    until one succeeds (``kv.why_own`` says why). Runs until cancelled, or
    returns at once when no load route is known for the worker's protocol."""
    protocol = worker.protocol.name
    path = worker.protocol.load_path
    if path is None:
        kv.why_own = f"no load route known for {protocol}"
        return
    share = KVLoads(worker, kv, interval, idle_interval, clock)
    while True:
        if not worker.healthy:
            share.down()
            await worker.health_changed()
            continue
        now = clock()
        if not share.due(now):
            # Idle: no tick every interval to ask whether anything moved;
            # the routing and the engine's own events say so (notify).
            kv.skipped += 1
            moved = anyio.Event()
            share.notify(moved)
            with anyio.move_on_after(share.until_due(now)):
                await moved.wait()
            continue
        begun = share.begin()
        try:
            with anyio.fail_after(DISCOVERY_TIMEOUT_S):
                async with worker.pool.request(b"GET", path) as resp:
                    body = await resp.read()
            if resp.status != 200:
                raise ValueError(f"answered {resp.status}")
            share.end(parse_load(protocol, body), None, begun)
        except (TimeoutError, WorkerError, ValueError) as exc:
            share.end(None, f"GET {path.decode()}: {exc!r}", begun)
        await anyio.sleep(interval)


def read_due(kv: WorkerKV, outstanding: int, now: float, idle_interval: float) -> bool:
    """Whether to read ``kv``'s engine load at ``now``, given this
    replica's ``outstanding`` requests there. An idle engine's reading
    cannot change: when its last reading counted no requests, this
    replica has none there, and since that reading it has neither
    routed one there nor seen its engine publish an event (a request
    another replica sent there is prefilled and published), the
    reading waits, up to ``idle_interval`` seconds after the last. A busy
    engine is read every time.
    """
    if kv.engine is None or kv.engine.requests or outstanding:
        return True
    return now - kv.read_at >= idle_interval or kv.activity() != kv.read_mark
