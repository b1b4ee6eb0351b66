"""Fleet state read from the engines: pauses and weight versions, in every
process of every replica.

A trainer's pause, resume or weight update reaches one frontend process (of
``serve --workers N``, or one replica behind a load balancer); the engines
behind it then hold the state every process needs. Each engine says it in
its description (:class:`~asgi_generate.protocols.WorkerProtocol`):
``pause_path`` read by ``pause_reader`` (SGLang ``GET /ready``, 503 while
paused; vLLM ``GET /is_paused``) and ``weight_version_path`` (SGLang ``GET
/model_info``, vLLM ``GET /weight_info``). :class:`FleetState` reads every
up worker every ``interval`` seconds (``paused_interval`` while a fleet is
paused, to see the resume soon: then the weight versions every
``interval`` still, and at once when the resume is seen), and one worker
at once when an engine's
answer shows a change this process does not know of (:meth:`FleetState.confirm_pause`:
an abort finish while no pause is known here; :meth:`FleetState.version_reported`:
a weight version in a chunk other than its worker's known one). What it learns:

- a protocol's fleet paused (every worker read reports it paused, after
  not all did): :meth:`Pauses.begin <asgi_generate.workers.pauses.Pauses.begin>`
  here too, so streams the engines abort for it may be held. A trainer
  pauses every engine; one alone saying so is one not ready for another
  reason (SGLang's ``/ready`` answers 503 while the engine starts, is
  unhealthy or shuts down too), which must not hold the fleet, nor excuse
  that worker's failing health probes as a paused fleet's;
- resumed (a worker read reports itself not paused: the resume has
  begun, or that engine was never paused): :meth:`Pauses.end
  <asgi_generate.workers.pauses.Pauses.end>`, and held streams go on,
  whoever took the pause. Were it to wait until none reports paused, one
  engine not ready would hold the fleet paused for good, its failing
  probes excused;
- a worker's new weight version: its ``info`` (what routing and records
  read), and, when a worker's version changed since the last reading, the
  fleet's weight version (:class:`~asgi_generate.workers.fence.Fence`): new
  requests go only to workers at the version the engines moved to (of
  several, the one most workers report, the greatest on a tie: a worker
  whose update failed is left behind).

While this process's own pause or resume call is on its way to the
engines (:meth:`FleetState.local_call`), readings neither begin nor end a
pause, and while its own weight call is, they set no weight version: the
call does, and a reading taken before the engines got it is stale (as is
one taken before :meth:`FleetState.confirm_pause` began a pause). A reading that fails or times out changes nothing: it never marks a
worker down (invariant 8: the health probe alone does).

What the engines do not hold (a fence an operator cleared, a worker fenced
for a failed update, a weight call that aborts running requests without
pausing) the process that took the call tells its siblings
(:meth:`FleetState.fence_message`, :meth:`FleetState.apply_fence_message`,
:meth:`FleetState.aborting_call`, carried by :mod:`asgi_generate.ops.siblings`).
So it does of a pause that aborts (:meth:`FleetState.aborting_pause`),
before the engines get it: an engine holds a pause, but a sibling reading
it later would find it already ended when the trainer's resume came first,
and take the streams it aborted for the engine's own aborts.
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import anyio
import orjson

from ..exceptions import WorkerError
from .fence import Fence, version_order
from .pauses import Pauses
from .worker import Worker

log = logging.getLogger("asgi_generate.fleet_state")
#: The kinds of this process's own calls (:meth:`FleetState.local_call`).
PAUSE, WEIGHTS = "pause", "weights"
KINDS = (PAUSE, WEIGHTS)
#: Seconds one worker's reading (its pause route, then its weight version
#: route) may take; past it the reading counts as failed and changes nothing.
READ_TIMEOUT_S = 5.0
#: Seconds past a sibling's aborting call's own deadline after which a call
#: it opened here and never closed (the sibling died) is closed anyway.
CALL_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class Reading:
    """What one engine said of itself: ``paused`` (``None``: unknown, the
    route failed or has no such answer) and its ``version`` (``None``:
    unknown)."""

    paused: bool | None
    version: str | None


async def _get(worker: Worker, path: bytes) -> tuple[int, bytes]:
    async with worker.pool.request(b"GET", path, idempotent=True) as resp:
        return resp.status, await resp.read()


async def read_worker(worker: Worker, timeout: float = READ_TIMEOUT_S, versions: bool = True) -> Reading:
    """``worker``'s pause state and (with ``versions``) weight version, as
    its engine's description reads them, within ``timeout`` seconds; what
    cannot be read is ``None``."""
    proto = worker.protocol
    paused: bool | None = None
    version: str | None = None
    with anyio.move_on_after(timeout):
        try:
            if proto.pause_path is not None and proto.pause_reader is not None:
                paused = proto.pause_reader(*await _get(worker, proto.pause_path))
            if versions and proto.weight_version_path is not None:
                status, body = await _get(worker, proto.weight_version_path)
                if status == 200:
                    version = proto.read_version(orjson.loads(body), "weight_version")
        except (WorkerError, orjson.JSONDecodeError):
            pass
    return Reading(paused, version)


class FleetState:
    """Every process's reading of its fleets' pause state and weight
    versions (module docstring).

    Args:
        workers: the router's workers now (read at each reading).
        pauses: the process's pauses (begun and ended from readings).
        fence: the process's version fence (its fleet versions follow the engines).
        interval: seconds between readings; 0: none (:meth:`run` returns).
        paused_interval: seconds between readings while a fleet is paused
            here or was last read paused.
        read: one worker's reading (:func:`read_worker`; tests pass a fake).

    Attributes:
        counts: ``readings`` (rounds over the fleet), ``failed`` (worker
            readings that gave nothing), ``pauses_learned``,
            ``transactions_learned`` (a pause or weight call that ended
            before the abort it caused was read here, :meth:`confirm_pause`),
            ``resumes_learned``, ``versions_learned`` (fleet versions set
            from a reading), ``fence_messages`` and ``call_messages``
            (applied from a sibling), ``version_triggers`` (answers that
            showed a weight version unknown here).
        share: set by the server: sends a :meth:`fence_message` to the
            sibling processes; ``None``: there are none.
    """

    def __init__(self, workers: Callable[[], list[Worker]], pauses: Pauses, fence: Fence, interval: float = 1.0,
                 paused_interval: float = 0.1,
                 read: Callable[..., Awaitable[Reading]] = read_worker) -> None:
        self._workers = workers
        self.pauses = pauses
        self.fence = fence
        self.interval = interval
        self.paused_interval = paused_interval
        self._read = read
        #: Per protocol: whether the last reading found every worker paused.
        self._seen_paused: dict[str, bool] = {}
        #: Per worker id: the weight version its engine last reported.
        self._seen_versions: dict[str, str] = {}
        #: Per (protocol, kind): this process's own calls on their way
        #: (kinds: :data:`PAUSE`, :data:`WEIGHTS`).
        self._calls: dict[tuple[str, str], int] = {}
        #: Per (protocol, kind): changes of ``_calls``; a reading taken across one is stale.
        self._marks: dict[tuple[str, str], int] = {}
        self._wake: anyio.Event | None = None
        #: Per protocol: when (``anyio.current_time()``) its weight versions were last read.
        self._versions_read: dict[str, float] = {}
        self.share: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        #: Aborting calls and pauses siblings opened here: (sender, call
        #: number) -> (protocol, whether a pause, when to close it anyway).
        self._sibling_calls: dict[tuple[int, int], tuple[str, bool, float]] = {}
        self._call_number = 0
        self.counts = {"readings": 0, "failed": 0, "pauses_learned": 0, "resumes_learned": 0,
                       "versions_learned": 0, "fence_messages": 0, "call_messages": 0, "version_triggers": 0,
                       "transactions_learned": 0}

    # -- this process's own calls -------------------------------------------

    @contextmanager
    def local_call(self, protocol: str, kind: str) -> Iterator[None]:
        """Around this process's own fan-out to ``protocol``'s engines of a
        pause or resume (``kind`` :data:`PAUSE`) or a weight route
        (:data:`WEIGHTS`): what readings taken meanwhile say of that
        (pause state, weight versions) changes nothing; the call does
        (:class:`Pauses`, :class:`Fence`)."""
        self._call_began((protocol, kind))
        try:
            yield
        finally:
            self._call_ended((protocol, kind))

    def _call_began(self, key: tuple[str, str]) -> None:
        self._calls[key] = self._calls.get(key, 0) + 1
        self._marks[key] = self._marks.get(key, 0) + 1

    def _call_ended(self, key: tuple[str, str]) -> None:
        self._calls[key] -= 1
        self._marks[key] += 1
        if self._wake is not None:
            self._wake.set()  # read again now: the call's outcome is the engines'

    # -- readings -------------------------------------------------------------

    def apply(self, protocol: str, readings: dict[Worker, Reading], mark: tuple[int, int]) -> None:
        """Act on one reading of ``protocol``'s up workers (taken when
        :meth:`mark` was ``mark``): weight versions first (a resume then
        plans on the new weights), then the pause state."""
        if self._stale(protocol, WEIGHTS, mark):
            return self._apply_pause(protocol, readings, mark)
        moved: dict[str, Worker] = {}
        for w, r in readings.items():
            if r.paused is None and r.version is None:
                self.counts["failed"] += 1
            if r.version is None:
                continue
            before = self._seen_versions.get(w.id)
            self._seen_versions[w.id] = r.version
            if r.version != w.weight_version:
                w.info = {**w.info, "weight_version": r.version}  # replaced: attempts keep theirs
            if before is not None and before != r.version:
                moved[r.version] = w
        if moved:
            # Updates between two readings: the version most workers read now,
            # the greatest of those on a tie (a worker left behind is not the fleet).
            held = [r.version for r in readings.values() if r.version is not None]
            version = max(moved, key=lambda v: (held.count(v), version_order(v)))
            if self.fence.versions.get(protocol) != version:
                w = moved[version]
                log.warning("fleet %s: worker %s (%s) moved to weight version %r: the fleet's version now",
                            protocol, w.id, w.url, version)
                self.fence.versions[protocol] = version
                self.counts["versions_learned"] += 1
        self._apply_pause(protocol, readings, mark)

    def _stale(self, protocol: str, kind: str, mark: tuple[int, int]) -> bool:
        """Whether what a reading taken at ``mark`` says of ``kind`` is
        stale: this process's own call of that kind is on its way, or one
        was made since the reading began."""
        key = (protocol, kind)
        return bool(self._calls.get(key)) or self._marks.get(key, 0) != mark[KINDS.index(kind)]

    def _apply_pause(self, protocol: str, readings: dict[Worker, Reading], mark: tuple[int, int]) -> None:
        if self._stale(protocol, PAUSE, mark):
            return
        states = [r.paused for r in readings.values() if r.paused is not None]
        if not states:
            return
        paused = all(states)
        before = self._seen_paused.get(protocol, False)
        self._seen_paused[protocol] = paused
        if paused and not before and not self.pauses.pausing(protocol):
            log.warning("fleet %s: the engines report a pause: held streams wait for its resume", protocol)
            self.pauses.begin(protocol)
            self.counts["pauses_learned"] += 1
        elif not paused and self.pauses.pausing(protocol):
            log.warning("fleet %s: the engines report the resume: held streams go on", protocol)
            self.pauses.end(protocol)
            self.counts["resumes_learned"] += 1

    def mark(self, protocol: str) -> tuple[int, int]:
        """The stamp a reading of ``protocol`` takes as it starts (:meth:`apply`)."""
        return tuple(self._marks.get((protocol, kind), 0) for kind in KINDS)  # type: ignore[return-value]

    async def read(self) -> None:
        """One reading of every up worker that says its pause state or
        weight version, side by side, each within :data:`READ_TIMEOUT_S`."""
        by_protocol: dict[str, list[Worker]] = {}
        for w in self._workers():
            if w.healthy and not w.draining and (w.protocol.pause_path or w.protocol.weight_version_path):
                by_protocol.setdefault(w.protocol.name, []).append(w)
        marks = {p: self.mark(p) for p in by_protocol}
        # While paused, the pause route is read often, the versions every
        # interval as ever, and at once when the resume is seen.
        now = anyio.current_time()
        paused = {p for p in by_protocol if (self._seen_paused.get(p) or self.pauses.paused(p))
                  and now - self._versions_read.get(p, -math.inf) < self.interval}
        for p in by_protocol.keys() - paused:
            self._versions_read[p] = now
        readings = await self._read_all(by_protocol, paused)
        resumed = {p for p in paused if any(r.paused is False for r in readings[p].values())}
        if resumed:
            readings.update(await self._read_all({p: by_protocol[p] for p in resumed}, set()))
            self._versions_read.update(dict.fromkeys(resumed, now))
        for protocol in by_protocol:
            self.apply(protocol, readings[protocol], marks[protocol])
        self.counts["readings"] += 1

    async def _read_all(self, by_protocol: dict[str, list[Worker]],
                        without_versions: set[str]) -> dict[str, dict[Worker, Reading]]:
        readings: dict[str, dict[Worker, Reading]] = {p: {} for p in by_protocol}

        async def one(protocol: str, worker: Worker) -> None:
            readings[protocol][worker] = await self._read(worker, versions=protocol not in without_versions)

        async with anyio.create_task_group() as tg:
            for protocol, workers in by_protocol.items():
                for w in workers:
                    tg.start_soon(one, protocol, w)
        return readings

    async def confirm_pause(self, worker: Worker, planned_version: str | None = None) -> bool:
        """An engine aborted a stream on ``worker`` while no pause of its
        fleet is known here: read that engine's pause state (and, given the
        weight version the stream was planned on, ``planned_version``, its
        version) now. When it says paused, the pause begins here too (a
        stream it aborted may be held). When it is not paused but serves
        another version, a fleet transaction (a pause and a weight load,
        another process's) began and ended before this reading: it counts
        here as one that began and ended, so the stream is held and resumes
        at once, on the new weights. Returns whether either was learned."""
        protocol = worker.protocol.name
        if self.pauses.paused(protocol) or worker.protocol.pause_path is None:
            return False
        mark = self.mark(protocol)
        reading = await self._read(worker, versions=planned_version is not None)
        if self._stale(protocol, PAUSE, mark) or self.pauses.paused(protocol):
            return False
        if reading.paused is True:
            log.warning("fleet %s: worker %s (%s) aborted a stream and reports a pause: held streams wait for "
                        "its resume", protocol, worker.id, worker.url)
            self._seen_paused[protocol] = True
            self._marks[(protocol, PAUSE)] = mark[0] + 1  # a reading taken before this one is stale
            self.pauses.begin(protocol)
            self.counts["pauses_learned"] += 1
        elif reading.paused is False and planned_version is not None and reading.version is not None \
                and reading.version != planned_version:
            log.warning("fleet %s: worker %s (%s) aborted a stream and serves version %s, not %s: a "
                        "transaction ended behind this process; the stream resumes", protocol, worker.id,
                        worker.url, reading.version, planned_version)
            self.pauses.begin(protocol)
            self.pauses.end(protocol)
            self.counts["transactions_learned"] += 1
        else:
            return False
        if self._wake is not None:
            self._wake.set()  # read the fleet now (and at the paused interval while paused)
        return True

    def version_reported(self, worker: Worker) -> None:
        """An engine's answer on ``worker`` carried a weight version other
        than the one known here: read the fleet now (its version may have
        moved behind this process)."""
        self.counts["version_triggers"] += 1
        if self._wake is not None:
            self._wake.set()

    def _paused_anywhere(self) -> bool:
        return any(self._seen_paused.values()) or bool(self.pauses.stats()["paused"])

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Read the fleet every :attr:`interval` seconds
        (:attr:`paused_interval` while paused) until cancelled; returns at
        once when :attr:`interval` is 0."""
        task_status.started()
        if self.interval <= 0:
            return
        while True:
            self._wake = anyio.Event()
            self._expire_sibling_calls()
            await self.read()
            with anyio.move_on_after(self.paused_interval if self._paused_anywhere() else self.interval):
                await self._wake.wait()

    # -- what the engines do not hold: sibling messages -----------------------

    def fence_message(self, protocol: str) -> dict[str, Any]:
        """What this process decided of ``protocol``'s fleet that no engine
        holds, for its siblings (:meth:`apply_fence_message`): the fleet's
        weight version and each worker's fence (by URL and role, which
        siblings share; ids may differ)."""
        return {"kind": "fence", "protocol": protocol, "version": self.fence.versions.get(protocol),
                "workers": [{"url": w.url, "role": w.role, "fence": w.fence, "weight_version": w.weight_version,
                             "failed_updates": w.failed_updates}
                            for w in self._workers() if w.protocol.name == protocol]}

    def apply_fence_message(self, message: dict[str, Any]) -> None:
        """Apply a sibling's :meth:`fence_message`: its fleet version, and
        the fence, weight version and failed updates of each worker known
        here by URL and role (others are ignored)."""
        protocol = message["protocol"]
        if message["version"] is None:
            self.fence.versions.pop(protocol, None)
        else:
            self.fence.versions[protocol] = message["version"]
        told = {(w["url"], w["role"]): w for w in message["workers"]}
        for w in self._workers():
            t = told.get((w.url, w.role))
            if t is None or w.protocol.name != protocol:
                continue
            if t["fence"] != w.fence:
                log.warning("worker %s (%s) %s by a sibling process", w.id, w.url,
                            f"fenced ({t['fence']})" if t["fence"] else "let back in the rotation")
                w.fence = t["fence"]
            w.failed_updates = max(w.failed_updates, t["failed_updates"])
            if t["weight_version"] is not None and t["weight_version"] != w.weight_version:
                w.info = {**w.info, "weight_version": t["weight_version"]}
        self.counts["fence_messages"] += 1

    @asynccontextmanager
    async def aborting_call(self, protocol: str, deadline_s: float) -> AsyncIterator[None]:
        """Around this process's own call that aborts ``protocol``'s running
        requests without pausing (a weight route with
        ``abort_all_requests``): open in :class:`Pauses` here and, told
        before the engines get it, in every sibling process, until answered
        (``deadline_s``: the call's own deadline). No engine says such a
        call is under way, so a sibling would not know its aborts are the
        fleet's without this."""
        with self.pauses.call(protocol):
            async with self._told(protocol, False, deadline_s):
                yield

    @asynccontextmanager
    async def aborting_pause(self, protocol: str, deadline_s: float) -> AsyncIterator[None]:
        """Around this process's own fan-out of a pause that aborts
        ``protocol``'s running requests (begun in :class:`Pauses` here, and
        inside :meth:`local_call`): every sibling begins the pause too,
        told before the engines get it, and takes its readings of their
        pause state as stale until the fan-out was answered (a reading
        taken before the engines paused would end it). The engines hold the
        pause, so each sibling learns its resume from its readings, after
        the weight versions (``deadline_s``: the fan-out's own deadline)."""
        async with self._told(protocol, True, deadline_s):
            yield

    @asynccontextmanager
    async def _told(self, protocol: str, pause: bool, deadline_s: float) -> AsyncIterator[None]:
        """Tell the siblings a call opens, and that it closed once the block ended."""
        self._call_number += 1
        message = {"kind": "call", "protocol": protocol, "sender": os.getpid(), "number": self._call_number,
                   "deadline_s": deadline_s, "pause": pause}
        if self.share is not None:
            await self.share({**message, "open": True})
        try:
            yield
        finally:
            if self.share is not None:
                with anyio.CancelScope(shield=True):
                    await self.share({**message, "open": False})

    def apply_call_message(self, message: dict[str, Any]) -> None:
        """Apply a sibling's :meth:`aborting_call` or :meth:`aborting_pause`
        message: open the call here (closed by its closing message, or
        :data:`CALL_GRACE_S` past its deadline should that never come), or
        close it. A pause stays begun here after its call closed, until the
        readings see the engines resumed; without readings
        (:attr:`interval` 0), a pause is open here only as a call is."""
        key = (message["sender"], message["number"])
        # Without readings (interval 0) nothing here would end a pause the
        # trainer resumes through another process: a sibling's pause is
        # open here as its aborting call is, until its fan-out was answered.
        protocol, pause = message["protocol"], message.get("pause") is True and self.interval > 0
        self.counts["call_messages"] += 1
        if message["open"]:
            if key not in self._sibling_calls:
                self._sibling_calls[key] = (protocol, pause,
                                            anyio.current_time() + message["deadline_s"] + CALL_GRACE_S)
                if pause:
                    self.pauses.begin(protocol)
                    self._call_began((protocol, PAUSE))
                else:
                    self.pauses.open_call(protocol)
        elif (opened := self._sibling_calls.pop(key, None)) is not None:
            self._close_sibling_call(protocol, opened[1])

    def _close_sibling_call(self, protocol: str, pause: bool) -> None:
        if pause:
            self._call_ended((protocol, PAUSE))
        else:
            self.pauses.close_call(protocol)

    def _expire_sibling_calls(self) -> None:
        now = anyio.current_time()
        for key, (protocol, pause, until) in list(self._sibling_calls.items()):
            if until <= now:
                log.warning("fleet %s: a sibling's aborting %s was never said answered: closed here", protocol,
                            "pause" if pause else "call")
                del self._sibling_calls[key]
                self._close_sibling_call(protocol, pause)

    async def tell_siblings(self, protocol: str) -> None:
        """Send :meth:`fence_message` of ``protocol`` to the sibling
        processes, when there are any (:attr:`share`)."""
        if self.share is not None:
            await self.share(self.fence_message(protocol))

    def stats(self) -> dict[str, Any]:
        """The ``/stats`` ``fleet_state`` block."""
        return {"interval_s": self.interval, "paused_interval_s": self.paused_interval,
                "paused_seen": sorted(p for p, v in self._seen_paused.items() if v), **self.counts}
