"""Admission as the handler uses it (``--admission``; docs/overload.md).

:class:`Admission` reads a decoded request's headers into an
:class:`~asgi_generate.request.admission.Ask`, keeps one
:class:`~asgi_generate.request.admission.Queue` per worker protocol with the
fleet's room from :class:`~asgi_generate.request.saturation.Saturation`,
waits for a grant (:meth:`Admission.admit`) and gives the slot back when the
request ends (:meth:`Admission.release`, from the handler's ``finally``:
finished, aborted, disconnected, migrated or shut down alike). A request
with a deadline still running at it is cut by :func:`cut_at_deadline`.

Request headers (names lower-case, as ASGI gives them):

- ``x-priority-class``: a class of ``--admission-classes``;
- ``x-tenant``: the tenant (else a hash of the ``authorization`` bearer
  token, else ``default``);
- ``x-group-id`` and ``x-group-size``: requests admitted as one unit;
- ``x-deadline-ms``: milliseconds from the request's arrival by which it
  must have ended;
- ``x-preemptible: 1``: with ``--admission-preemption``, the stream may be
  preempted for a higher class (:class:`Parking`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio

from . import state
from .admission import Ask, Entry, Queue, Unit
from .saturation import TIGHT_ROOM, Saturation
from ..config import parse_priorities, parse_weights
from ..sdk._codec import GenerateRequest, RequestError

if TYPE_CHECKING:
    from ..config import Settings
    from ..tracing.state import RequestState
    from ..workers.router import Router

log = logging.getLogger("asgi_generate.admission")
PRIORITY_HEADER = b"x-priority-class"
TENANT_HEADER = b"x-tenant"
GROUP_HEADER = b"x-group-id"
GROUP_SIZE_HEADER = b"x-group-size"
DEADLINE_HEADER = b"x-deadline-ms"
PREEMPTIBLE_HEADER = b"x-preemptible"
#: A tenant named by a bearer token is this many hex digits of its SHA-256
#: (the token itself is never kept or shown).
TOKEN_HASH_DIGITS = 12
#: The longest tenant or group name kept (longer ones are cut).
MAX_NAME = 64
#: Seconds between looks for a live leg to abort once a deadline passed.
CUT_POLL_S = 0.02


class Admission:
    """The process's admission: queues, readings, figures.

    Args:
        settings: the ``admission_*`` settings.
        router: the router now (the app replaces it at start).
        clock: monotonic seconds.
    """

    def __init__(self, settings: "Settings", router: Callable[[], "Router"],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.router = router
        self.clock = clock
        self.classes = [c.strip() for c in settings.admission_classes.split(",") if c.strip()]
        self.weights = parse_weights(settings.admission_tenant_weights)
        self.priorities = {name: {"priority": p} for name, p in
                           parse_priorities(settings.admission_engine_priority, self.classes).items()}
        self.saturation = Saturation(settings.admission_worker_requests, settings.admission_waiting_tokens,
                                     settings.admission_load_stale, clock, settings.admission_kv_usage,
                                     settings.admission_load_interval, settings.admission_load_idle_interval)
        self.queues: dict[str, Queue] = {}
        self.deadline_cuts = 0
        #: Preemptible streams holding a slot, by protocol (``--admission-preemption``).
        self.preemptible: dict[str, set[Parking]] = {}
        self.parked = 0
        self.preemptions = self.resumed_parked = self.parked_expired = 0
        #: Streams chosen for preemption whose engine abort is not sent yet (:meth:`run`).
        self._victims: list[Parking] = []
        self._wake: anyio.Event | None = None

    def queue(self, protocol: str) -> Queue:
        """``protocol``'s queue (made on first use)."""
        q = self.queues.get(protocol)
        if q is None:
            s = self.settings
            q = self.queues[protocol] = Queue(
                self.classes, lambda: self.room(protocol), reserved_share=s.admission_reserved_share,
                promote_after=s.admission_promote_after, weights=self.weights,
                max_tenants=s.admission_max_tenants, depth=s.admission_queue_depth,
                nbytes=s.admission_queue_bytes, wait=s.admission_queue_wait)
            if s.admission_preemption:
                q.on_blocked = lambda unit, free: self._preempt(protocol, unit, free)
        return q

    # -- preemption -----------------------------------------------------------------

    def parking(self, entry: Entry, st: "RequestState", abort: Callable[[], Awaitable[None]]) -> "Parking | None":
        """The preemption handle of a granted stream that opted in, kept
        while it holds its slot; ``None`` when it may not be preempted."""
        if not (self.settings.admission_preemption and st.stream and entry.granted
                and st.headers.get(PREEMPTIBLE_HEADER, b"").strip() in (b"1", b"true")):
            return None
        parking = Parking(self, entry, st, abort)
        self.preemptible.setdefault(entry.ask.protocol, set()).add(parking)
        return parking

    def _preempt(self, protocol: str, unit: Unit, free: int) -> None:
        """``unit`` waits and does not fit in ``free``: preempt streams of
        lower classes, the lowest class and the latest admitted first,
        until what they free (with those being preempted) makes it fit."""
        running = self.preemptible.get(protocol)
        if not running:
            return
        freeing = sum(p.entry.ask.seqs for p in running if p.preempting)
        victims = sorted((p for p in running if not p.preempting and p.entry.ask.cls > unit.cls),
                         key=lambda p: (-p.entry.ask.cls, -p.order))
        for parking in victims:
            if free + freeing >= unit.seqs or self.parked + len(self._victims) >= self.settings.admission_max_parked:
                break
            parking.preempting = True
            freeing += parking.entry.ask.seqs
            self._victims.append(parking)
        if self._victims and self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        """Send the engine aborts of the streams chosen for preemption
        (pumping is synchronous; aborts wait for their engines). Runs
        while the app does."""
        async with anyio.create_task_group() as tg:
            while True:
                self._wake = anyio.Event()
                while self._victims:
                    parking = self._victims.pop()
                    self.preemptions += 1
                    tg.start_soon(parking.abort)
                await self._wake.wait()


    def attach(self, router: "Router") -> None:
        """Place on ``router`` by room: a granted request goes to a worker
        with room for it (:attr:`~asgi_generate.workers.router.Router.room`,
        :meth:`free_on`), not only to a fleet with room in aggregate."""
        router.room = self.free_on

    def free_on(self, worker: Any) -> int:
        """Engine sequences ``worker`` takes now: its limit less the others'
        requests at its engine's last reading and this process's sequences
        running there now (0 while the reading counts it as full, or its
        fleet is paused)."""
        if self.router().pauses.paused(worker.protocol.name):
            return 0
        return self.saturation.free_on(worker, _own_sequences(worker))

    def busy(self, protocol: str) -> bool:
        """Whether ``protocol``'s room is in demand: requests wait in its
        queue, or less than :data:`~asgi_generate.request.saturation.TIGHT_ROOM`
        of its capacity is free (the readings' fast pace)."""
        q = self.queues.get(protocol)
        if q is not None and any(c.depth for c in q.classes):
            return True
        room = self.room(protocol)
        return room.free < TIGHT_ROOM * room.capacity

    def held(self, protocol: str) -> tuple[int, int]:
        """Sequences and requests this process holds slots for on ``protocol``."""
        q = self.queues.get(protocol)
        if q is None:
            return 0, 0
        return sum(c.held for c in q.classes), sum(c.held_requests for c in q.classes)

    def room(self, protocol: str):
        """The fleet's :class:`~asgi_generate.request.admission.Room` for ``protocol`` now."""
        router = self.router()
        seqs, requests = self.held(protocol)
        workers = [w for w in router.workers if w.protocol.name == protocol]
        return self.saturation.room(workers, lambda w: w.healthy and not w.draining and router.routable(w),
                                    router.pauses.paused(protocol), seqs, seqs / requests if requests else 1.0)

    def bypass(self, protocol: str) -> bool:
        """No worker of ``protocol`` is up and its fleet is not paused: the
        request goes on to planning, which answers 503 as without admission."""
        router = self.router()
        if router.pauses.paused(protocol):
            return False
        return not any(w.healthy for w in router.workers if w.protocol.name == protocol)

    # -- one request ----------------------------------------------------------------

    def ask(self, protocol: str, request: GenerateRequest, st: "RequestState") -> Ask:
        """What admission knows of ``request`` (its headers are ``st.headers``),
        noted in ``st`` for the record.

        Raises:
            RequestError: 400 for a header it cannot read.
        """
        headers = st.headers
        name = headers.get(PRIORITY_HEADER, b"").decode("latin-1").strip() or self.settings.admission_default_class
        if name not in self.classes:
            raise RequestError(400, f"unknown priority class {name[:MAX_NAME]!r} (x-priority-class; known: "
                                    f"{', '.join(self.classes)})", "priority_class")
        cls = self.classes.index(name)
        tenant = _tenant(headers)
        q = self.queue(protocol)
        tenant = q.tenant_of(cls, tenant)
        group = headers.get(GROUP_HEADER)
        size = 1
        if group is not None:
            group = group.decode("latin-1").strip()[:MAX_NAME]
            try:
                size = int(headers.get(GROUP_SIZE_HEADER, b""))
            except ValueError:
                size = 0
            if not 1 <= size <= self.settings.admission_queue_depth:
                raise RequestError(400, f"x-group-id needs x-group-size between 1 and "
                                        f"{self.settings.admission_queue_depth}", "group_size")
        deadline = None
        raw = headers.get(DEADLINE_HEADER)
        if raw is not None:
            try:
                ms = float(raw)
            except ValueError:
                ms = -1.0
            if not ms >= 0 or ms != ms or ms == float("inf"):
                raise RequestError(400, "x-deadline-ms must be a number of milliseconds, at least 0", "deadline")
            deadline = st.t_received + ms / 1000
        items = request.items
        seqs = len(items) if items else 1
        if items:
            prompt = sum(len(i.input_ids) if i.input_ids is not None else st.body_bytes // (4 * seqs)
                         for i in items)
        else:
            prompt = st.input_length if st.input_length is not None else st.body_bytes // 4
        work = prompt + self.settings.admission_output_weight * (request.max_new_tokens or 0) * seqs
        st.priority_class, st.tenant, st.group_id = name, tenant, group
        return Ask(protocol, cls, tenant, seqs, float(work), st.body_bytes, deadline, group, size, prompt)

    def engine_fields(self, st: "RequestState") -> dict:
        """The top-level fields every engine leg of ``st``'s request carries:
        its class's engine ``priority`` (``--admission-engine-priority``), if mapped."""
        return self.priorities.get(st.priority_class, {})

    async def admit(self, ask: Ask) -> Entry:
        """Queue ``ask`` and wait for its grant or its shedding (the entry
        says which); cancelled (the client left, shutdown), it leaves the
        queue and holds nothing."""
        q = self.queue(ask.protocol)
        entry = q.enqueue(ask, self.clock())
        if self.saturation.idle and (not entry.granted or self.busy(ask.protocol)):
            self.saturation.hurry()  # demand: read the engines now, and at the fast pace
        if entry.granted or entry.refusal is not None:
            return entry
        entry.event = anyio.Event()
        try:
            while not (entry.granted or entry.refusal is not None):
                # Each waiter keeps its own unit's time (a group's members
                # alike): no scan of the queue per waiter.
                with anyio.move_on_after(max(0.0, q.expiry(entry.unit) - self.clock())):
                    await entry.event.wait()
                if not entry.event.is_set():
                    q.expire_unit(entry.unit, self.clock())
        finally:
            if not (entry.granted or entry.refusal is not None):
                q.withdraw(entry, self.clock())
        return entry

    def release(self, entry: Entry, st: "RequestState", output_before: int = 0) -> None:
        """``entry``'s request ended (or was parked), whichever way: free its
        slot, with the work it actually did under it (uncached prompt tokens
        plus weighted output tokens sent, less ``output_before`` sent under
        an earlier slot)."""
        if not entry.granted or entry.released:
            return
        output = sum(a.tokens for a in st.attempts) - output_before
        uncached = max(0, entry.ask.prompt_tokens - (st.cached_tokens or 0))
        work = uncached + self.settings.admission_output_weight * output
        self.queue(entry.ask.protocol).release(entry, work, self.clock())

    def shut(self) -> None:
        """The server shuts down: every queued request is answered 503 now."""
        for q in self.queues.values():
            q.shut()

    def pump_all(self) -> None:
        """A reading came in: admit what now fits, on every protocol."""
        now = self.clock()
        for q in self.queues.values():
            q.pump(now)

    def service(self, worker: Any) -> Callable[[], Any]:
        """The load reader of a joining worker, to run while it is a member;
        it takes the routing policy's readings of the same route too, if
        the policy reads any (one GET for both)."""
        share = self.router().policy.load_share(worker)
        protocol = worker.protocol.name
        return lambda: self.saturation.read(worker, lambda: _own_sequences(worker), self.pump_all,
                                            lambda: self.busy(protocol), share)

    # -- figures --------------------------------------------------------------------

    def stats(self) -> dict:
        """The ``/stats`` ``admission`` block: each protocol's room and
        queue figures per class and tenant, deadline cuts, preemptions
        (streams preempted, parked now, resumed, expired while parked),
        requests placed on a worker without room of its own (no worker had
        room alone: :meth:`~asgi_generate.workers.router.Router.pick`), the
        readings."""
        return {
            "enabled": True,
            "classes": self.classes,
            "deadline_cuts": self.deadline_cuts,
            "preemptions": self.preemptions,
            "parked": self.parked,
            "resumed_parked": self.resumed_parked,
            "parked_expired": self.parked_expired,
            "placed_without_room": self.router().roomless_picks,
            "protocols": {
                protocol: {"room": dict(zip(("free", "capacity", "ever"), _room(self.room(protocol)))),
                           "classes": q.stats()}
                for protocol, q in self.queues.items()
            },
            "saturation": self.saturation.stats(),
        }


class Parking:
    """A preemptible stream's handle (:meth:`Admission.parking`).

    When admission preempts it, ``preempting`` is set and its engine legs
    are aborted (``abort``); the engine's abort finish then holds the stream
    (as a pause's does, :mod:`asgi_generate.request.generation`), which
    calls :meth:`park`: its slot is given back and it waits in its class's
    queue again; once granted, it resumes exactly as a migrated leg (the
    prompt plus the tokens sent, the remaining budget).

    Attributes:
        entry: the slot it holds now (the handler releases this one).
    """

    _order = itertools.count()

    def __init__(self, admission: Admission, entry: Entry, st: "RequestState",
                 abort: Callable[[], Awaitable[None]]) -> None:
        self.admission = admission
        self.entry = entry
        self.st = st
        self.abort = abort
        self.preempting = False
        self.order = next(self._order)
        #: Output tokens sent under earlier slots (already charged).
        self.output_before = 0

    async def park(self) -> str | None:
        """Give the slot back and wait for another: ``None`` once granted,
        else why not (the client's in-band 503 message)."""
        admission = self.admission
        running = admission.preemptible.get(self.entry.ask.protocol, set())
        running.discard(self)
        self.preempting = False
        admission.release(self.entry, self.st, self.output_before)
        self.output_before = sum(a.tokens for a in self.st.attempts)
        admission.parked += 1
        try:
            # Its prompt was charged already; its remaining output is charged when it ends.
            # It waits alone: its group was admitted whole, and no other member comes again.
            entry = await admission.admit(dataclasses.replace(self.entry.ask, work=0.0, prompt_tokens=0,
                                                              group=None, group_size=1))
        finally:
            admission.parked -= 1
        if not entry.granted:
            admission.parked_expired += 1
            return f"preempted and parked: {entry.refusal.message}"
        self.entry = entry
        self.order = next(self._order)
        running.add(self)
        admission.resumed_parked += 1
        return None

    def done(self) -> None:
        """The stream ended: it is no longer preemptible."""
        self.admission.preemptible.get(self.entry.ask.protocol, set()).discard(self)


def _own_sequences(worker: Any) -> int:
    """Engine sequences this process runs on ``worker`` now: one per leg,
    or its items (a batch's, ``n`` samples')."""
    return sum(len(leg.attempt.entries) if leg.attempt.entries else 1 for leg in worker.inflight)


def _room(room: Any) -> tuple[int, int, int]:
    return room.free, room.capacity, room.ever


def _tenant(headers: dict) -> str:
    """The ``x-tenant`` header, else a short hash of the bearer token, else ``default``."""
    tenant = headers.get(TENANT_HEADER)
    if tenant is not None and tenant.strip():
        return tenant.decode("latin-1").strip()[:MAX_NAME]
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer " and auth[7:].strip():
        return "token-" + hashlib.sha256(auth[7:].strip()).hexdigest()[:TOKEN_HASH_DIGITS]
    return "default"


async def cut_at_deadline(st: "RequestState", deadline: float, abort_live_legs: Callable[[], Awaitable[None]],
                          cuts: Callable[[], None]) -> None:
    """At ``deadline`` (monotonic seconds), end a request still running:
    its ending becomes ``deadline`` and its live engine legs are aborted, so
    each engine ends the answer with its own abort finish carrying the
    tokens so far (a partial rollout), in the format's shape
    (``abort_live_legs`` aborts them). Cancelled when the request ends first."""
    await anyio.sleep(max(0.0, deadline - time.monotonic()))
    if st.response_complete:
        return
    cuts()
    state.fail(st, "deadline", st.http_status, "deadline",
               "cut at its deadline (x-deadline-ms): the answer carries the tokens generated so far")
    st.shed_reason = "deadline"
    while not st.response_complete:
        if any(a.live for a in st.attempts):
            with anyio.CancelScope(shield=True):
                await abort_live_legs()
        await anyio.sleep(CUT_POLL_S)
