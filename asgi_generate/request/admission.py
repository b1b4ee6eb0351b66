"""Admission: which waiting request goes to the engines next, and which is
shed (docs/overload.md).

Between decoding a request and planning its legs, a request asks for room
(:meth:`Admission.admit`). Room is the fleet's, judged from the engines' own
load figures (:mod:`asgi_generate.request.saturation`); a request that finds
none waits in a bounded queue, one per worker protocol, ordered:

1. by priority class, strictly (``--admission-classes``, highest first, from
   the ``x-priority-class`` header), except that a class holding less than
   its reserved share of the room (``--admission-reserved-share``) goes
   first, and a unit waiting ``--admission-promote-after`` seconds is ordered
   one class higher per period waited;
2. within a class, by tenant (``x-tenant``, else a hash of the bearer
   token): the tenant whose virtual counter of work served, divided by its
   weight, is lowest goes next (the virtual token counter of Sheng et al.,
   "Fairness in Serving Large Language Models", OSDI 2024); work is
   uncached prompt tokens plus ``--admission-output-weight`` times output
   tokens, charged on admission with the request's cap and corrected on
   release with what it produced;
3. within a tenant, earliest deadline first (``x-deadline-ms``), then arrival.

The queue's unit is a group: a request alone, a request with several items
(an ``n`` > 1 request, a batch: one unit of that many sequences), or the
requests carrying the same ``x-group-id`` with its ``x-group-size``: a group
is ordered only once all its members arrived, and all are admitted at once
or none; a group shed is shed whole.

A unit is shed (429 with ``Retry-After``, the reason in the body) past its
class's queue depth or bytes at arrival, past ``--admission-queue-wait``
seconds waiting, or when its deadline passes before it could start (at once
when the class's recent waits say it cannot start in time). A unit that no
worker can ever take (more sequences than the whole fleet's limits, counting
one for each group member still to come, or no
worker of its protocol) is answered 503.

The core is synchronous, on an explicit clock (``now`` arguments): the unit
tests drive it with a fake one; :meth:`Admission.admit` is its async face.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import anyio

#: Shed reasons (the body's and the record's ``shed_reason``, the metrics'
#: ``reason`` label).
QUEUE_DEPTH, QUEUE_BYTES, WAIT, DEADLINE, GROUP_INCOMPLETE, NEVER, SHUTDOWN = (
    "queue_depth", "queue_bytes", "wait", "deadline", "group_incomplete", "never", "shutdown")
REASONS = (QUEUE_DEPTH, QUEUE_BYTES, WAIT, DEADLINE, GROUP_INCOMPLETE, NEVER, SHUTDOWN)
#: Retry-After is the class's recent wait, in whole seconds, within these bounds.
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60
#: How far a class's wait estimate moves toward each new wait (a moving average).
WAIT_ALPHA = 0.2
#: The tenant label of every tenant past ``--admission-max-tenants``.
OTHER_TENANT = "other"


@dataclass(frozen=True, slots=True)
class Room:
    """The fleet's room for one worker protocol, in engine sequences.

    Attributes:
        free: sequences it may take now (0 while paused, or while every
            reading is stale).
        capacity: sequences its up workers take in all (the reserved shares
            are shares of this).
        ever: sequences every worker of the protocol would take, up or not
            (a unit larger than this is never admitted); 0: no worker.
    """

    free: int
    capacity: int
    ever: int


@dataclass(slots=True)
class Ask:
    """What admission knows of one request.

    Attributes:
        protocol: its worker protocol (one queue per protocol).
        cls: its class's index (0 = highest).
        tenant: its tenant's name (folded to :data:`OTHER_TENANT` past the bound).
        seqs: engine sequences it runs (its items, else 1).
        work: its estimated work, in weighted tokens.
        nbytes: its body's bytes (the queue's byte bound).
        deadline: when it must have started and ended (monotonic seconds), or ``None``.
        group: its group id (``x-group-id``), or ``None``.
        group_size: the group's size (``x-group-size``), 1 without a group.
        prompt_tokens: its prompt tokens (the uncached part of ``work`` is
            known only at its end).
    """

    protocol: str
    cls: int
    tenant: str
    seqs: int = 1
    work: float = 0.0
    nbytes: int = 0
    deadline: float | None = None
    group: str | None = None
    group_size: int = 1
    prompt_tokens: int = 0


@dataclass(slots=True, eq=False)
class Entry:
    """One request in the queue, and then holding its slot."""

    ask: Ask
    arrived: float
    unit: "Unit | None" = None
    event: anyio.Event | None = None
    granted: bool = False
    released: bool = False
    #: Why it was shed, once it was: ``(status, reason, message, retry_after)``.
    refusal: "Refusal | None" = None
    #: Seconds it waited before its grant (0 when admitted at once).
    waited: float = 0.0


@dataclass(slots=True, eq=False)
class Unit:
    """What the queue orders and admits whole: one request, or a group."""

    cls: int
    tenant: str
    size: int
    arrived: float
    seq: int
    entries: list[Entry] = field(default_factory=list)
    #: Bumped whenever the unit leaves or re-enters its tenant's heap
    #: (stale heap rows are skipped).
    version: int = 0
    queued: bool = False  # in its tenant's heap now
    done: bool = False  # granted or shed
    #: A group's key in :attr:`Queue.groups`, ``None`` for a request alone.
    key: tuple[int, str, str] | None = None

    @property
    def complete(self) -> bool:
        return len(self.entries) >= self.size

    @property
    def seqs(self) -> int:
        return sum(e.ask.seqs for e in self.entries)

    @property
    def work(self) -> float:
        return sum(e.ask.work for e in self.entries)

    @property
    def deadline(self) -> float:
        return min((e.ask.deadline for e in self.entries if e.ask.deadline is not None), default=math.inf)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A shed request's answer: its HTTP status (429 or 503), the reason
    (:data:`REASONS`), the message for the body, and ``Retry-After`` in
    seconds (``None``: none is sent)."""

    status: int
    reason: str
    message: str
    retry_after: int | None


class ClassQueue:
    """One class's waiting units, by tenant, and its counters."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: tenant -> heap of (deadline, seq, version, unit)
        self.heaps: dict[str, list] = {}
        #: tenant -> live units queued (in a heap) or forming (an incomplete group)
        self.backlog: dict[str, int] = {}
        #: tenant -> virtual counter (weighted work served)
        self.counters: dict[str, float] = {}
        self.depth = 0  # requests waiting (group members included)
        self.nbytes = 0
        self.held = 0  # sequences admitted and not yet released
        self.held_requests = 0
        self.last_counter = 0.0
        self.wait_estimate = 0.0
        #: units in arrival order, for promotion (lazily pruned)
        self.fifo: list[Unit] = []
        self.fifo_head = 0
        self.admitted = 0
        self.shed: dict[str, int] = {}
        self.wait_total = 0.0
        #: tenant -> [waiting now, admitted, shed, seconds waited]
        self.tenants: dict[str, list[float]] = {}

    def tenant_stats(self, tenant: str) -> list[float]:
        row = self.tenants.get(tenant)
        if row is None:
            row = self.tenants[tenant] = [0, 0, 0, 0.0]
        return row

    def oldest(self) -> Unit | None:
        fifo = self.fifo
        while self.fifo_head < len(fifo) and (fifo[self.fifo_head].done):
            self.fifo_head += 1
        if self.fifo_head > 1024 and self.fifo_head * 2 > len(fifo):
            del fifo[:self.fifo_head]
            self.fifo_head = 0
        return fifo[self.fifo_head] if self.fifo_head < len(fifo) else None


class Queue:
    """One worker protocol's admission queue (synchronous core).

    Args:
        classes: the class names, highest first.
        room: the fleet's :class:`Room` now.
        reserved_share: each class's reserved share of the capacity.
        promote_after: seconds of waiting per class of promotion.
        weights: tenant -> weight (others weigh 1).
        max_tenants: tenants tracked by name per class.
        depth, nbytes, wait: the per-class queue bounds (requests, body
            bytes, seconds).
    """

    def __init__(self, classes: Iterable[str], room: Callable[[], Room], *, reserved_share: float = 0.05,
                 promote_after: float = 30.0, weights: dict[str, float] | None = None, max_tenants: int = 1000,
                 depth: int = 1024, nbytes: int = 64 << 20, wait: float = 30.0) -> None:
        self.classes = [ClassQueue(name) for name in classes]
        self.room = room
        self.reserved_share = reserved_share
        self.promote_after = promote_after
        self.weights = weights or {}
        self.max_tenants = max_tenants
        self.depth = depth
        self.nbytes = nbytes
        self.wait = wait
        self.groups: dict[tuple[int, str, str], Unit] = {}
        self._seq = itertools.count()
        #: Called when the next unit does not fit, with it and the free room
        #: (preemption may make room); ``None``: nothing is done.
        self.on_blocked: Callable[[Unit, int], None] | None = None

    # -- arrival --------------------------------------------------------------------

    def tenant_of(self, cls: int, name: str) -> str:
        """``name``, or :data:`OTHER_TENANT` once the class tracks ``max_tenants`` others."""
        q = self.classes[cls]
        if name in q.counters or len(q.counters) < self.max_tenants:
            return name
        return OTHER_TENANT

    def enqueue(self, ask: Ask, now: float) -> Entry:
        """Queue ``ask`` arriving at ``now`` and admit what fits; the entry
        is ``granted``, or has its ``refusal``, or waits (its unit queued or
        its group forming)."""
        entry = Entry(ask, now)
        q = self.classes[ask.cls]
        room = self.room()
        if ask.seqs > room.ever or room.ever == 0:
            why = ("no worker of this protocol" if room.ever == 0 else
                   f"{ask.seqs} sequences exceed the fleet's limit of {room.ever}")
            entry.refusal = Refusal(503, NEVER, f"no worker can ever take this request: {why}", None)
            self._count_shed(q, ask.tenant, NEVER)
            return entry
        if ask.deadline is not None and ask.deadline <= now:
            entry.refusal = self._refusal(q, DEADLINE, "its deadline passed before it could start")
            self._count_shed(q, ask.tenant, DEADLINE)
            return entry
        unit = None
        if ask.group is not None and ask.group_size > 1:
            key = (ask.cls, ask.tenant, ask.group)
            unit = self.groups.get(key)
            # The least the whole group will hold: the members here, this
            # one, and one sequence for each member still to come.
            size, members, seqs = (unit.size, len(unit.entries), unit.seqs) if unit else (ask.group_size, 0, 0)
            least = seqs + ask.seqs + max(0, size - members - 1)
            if least > room.ever:
                entry.refusal = Refusal(503, NEVER, f"group {ask.group} of {size} members holds at least {least} "
                                                    f"sequences, over the fleet's limit of {room.ever}", None)
                self._count_shed(q, ask.tenant, NEVER)
                if unit is not None:  # the members waiting can never be admitted either
                    self._shed_unit(unit, entry.refusal)
                return entry
        if q.depth >= self.depth or q.nbytes + ask.nbytes > self.nbytes:
            reason = QUEUE_DEPTH if q.depth >= self.depth else QUEUE_BYTES
            what = (f"{q.depth} requests" if reason == QUEUE_DEPTH else f"{q.nbytes + ask.nbytes} bytes")
            entry.refusal = self._refusal(q, reason, f"the {q.name} queue is full ({what})")
            self._count_shed(q, ask.tenant, reason)
            if unit is not None:  # a group is shed whole
                self._shed_unit(unit, entry.refusal)
            return entry
        if unit is None:
            unit = Unit(ask.cls, ask.tenant, ask.group_size if ask.group is not None else 1, now, next(self._seq))
            q.fifo.append(unit)
            if ask.group is not None and ask.group_size > 1:
                unit.key = (ask.cls, ask.tenant, ask.group)
                self.groups[unit.key] = unit
            self._backlog(q, unit.tenant, +1)
        entry.unit = unit
        unit.entries.append(entry)
        q.depth += 1
        q.nbytes += ask.nbytes
        q.tenant_stats(ask.tenant)[0] += 1
        if unit.complete:
            self._push(q, unit)
        self.pump(now)
        if not entry.granted and entry.refusal is None and ask.deadline is not None \
                and unit.complete and ask.deadline - now < q.wait_estimate:
            refusal = self._refusal(q, DEADLINE, f"it cannot start before its deadline (the {q.name} class "
                                                 f"waits about {q.wait_estimate:.3g} s)")
            self._shed_unit(unit, refusal)
        return entry

    def _backlog(self, q: ClassQueue, tenant: str, delta: int) -> None:
        before = q.backlog.get(tenant, 0)
        if before == 0 and delta > 0:
            # The virtual token counter's lift: a tenant coming back from
            # idle starts at the backlogged tenants' least counter (else at
            # the last one served), never below its own.
            others = [q.counters.get(t, 0.0) for t, n in q.backlog.items() if n > 0]
            floor = min(others) if others else q.last_counter
            q.counters[tenant] = max(q.counters.get(tenant, 0.0), floor)
        after = before + delta
        if after > 0:
            q.backlog[tenant] = after
        else:
            q.backlog.pop(tenant, None)

    def _push(self, q: ClassQueue, unit: Unit) -> None:
        unit.version += 1
        unit.queued = True
        heapq.heappush(q.heaps.setdefault(unit.tenant, []), (unit.deadline, unit.seq, unit.version, unit))

    # -- the order ------------------------------------------------------------------

    def _head(self, q: ClassQueue, tenant: str) -> Unit | None:
        heap = q.heaps.get(tenant)
        while heap:
            _, _, version, unit = heap[0]
            if unit.queued and not unit.done and unit.version == version:
                return unit
            heapq.heappop(heap)
        if heap is not None:
            del q.heaps[tenant]
        return None

    def _class_head(self, q: ClassQueue) -> Unit | None:
        """The class's next unit: its least-counter tenant's earliest."""
        best, best_counter = None, math.inf
        for tenant in list(q.heaps):
            unit = self._head(q, tenant)
            if unit is None:
                continue
            counter = q.counters.get(tenant, 0.0)  # work served over its weight
            if counter < best_counter or (counter == best_counter and unit.seq < best.seq):
                best, best_counter = unit, counter
        return best

    def next_unit(self, now: float, capacity: int) -> Unit | None:
        """The unit to admit next, by the module's order (``None``: none waits)."""
        ranked = []
        for i, q in enumerate(self.classes):
            if not q.heaps:  # nothing ready to go (an incomplete group is not)
                continue
            if q.held < self.reserved_share * capacity:
                ranked.append((0, i, i, q))  # under its reserve: first, highest class first
                continue
            oldest = q.oldest()
            waited = now - oldest.arrived if oldest is not None else 0.0
            ranked.append((1, i - int(waited // self.promote_after), i, q))
        ranked.sort(key=lambda row: row[:3])
        for *_, q in ranked:  # only the classes looked at need their tenants scanned
            head = self._class_head(q)
            if head is not None:
                return head
        return None

    def pump(self, now: float) -> int:
        """Admit units, in order, while they fit; the count admitted. The
        first unit that does not fit stops the pump (a large group is not
        passed over forever by small requests)."""
        room = self.room()
        free = room.free
        admitted = 0
        while True:
            unit = self.next_unit(now, room.capacity)
            if unit is None:
                return admitted
            if unit.seqs > free:
                if self.on_blocked is not None:
                    self.on_blocked(unit, free)
                return admitted
            free -= unit.seqs
            self._grant(unit, now)
            admitted += 1

    def _grant(self, unit: Unit, now: float) -> None:
        q = self.classes[unit.cls]
        self._take(q, unit)
        q.counters[unit.tenant] = q.counters.get(unit.tenant, 0.0) + unit.work / self.weights.get(unit.tenant, 1.0)
        q.last_counter = q.counters[unit.tenant]
        waited = now - unit.arrived
        q.wait_estimate += WAIT_ALPHA * (waited - q.wait_estimate)
        for entry in unit.entries:
            entry.granted = True
            entry.waited = now - entry.arrived
            q.held += entry.ask.seqs
            q.held_requests += 1
            q.admitted += 1
            q.wait_total += entry.waited
            row = q.tenant_stats(entry.ask.tenant)
            row[1] += 1
            row[3] += entry.waited
            if entry.event is not None:
                entry.event.set()

    def _take(self, q: ClassQueue, unit: Unit) -> None:
        """Take ``unit`` out of the queue (granted or shed)."""
        unit.done = True
        unit.queued = False
        unit.version += 1
        for entry in unit.entries:
            q.depth -= 1
            q.nbytes -= entry.ask.nbytes
            q.tenant_stats(entry.ask.tenant)[0] -= 1
        self._backlog(q, unit.tenant, -1)
        self._ungroup(unit)

    def _ungroup(self, unit: Unit) -> None:
        if unit.key is not None and self.groups.get(unit.key) is unit:
            del self.groups[unit.key]

    # -- endings --------------------------------------------------------------------

    def release(self, entry: Entry, work: float | None, now: float) -> None:
        """``entry``'s request ended (any way): its slot is free; its
        tenant's counter is corrected by its actual ``work`` (``None``:
        keep the estimate). Idempotent."""
        if not entry.granted or entry.released:
            return
        entry.released = True
        q = self.classes[entry.ask.cls]
        q.held -= entry.ask.seqs
        q.held_requests -= 1
        if work is not None and entry.ask.tenant in q.counters:
            q.counters[entry.ask.tenant] += (work - entry.ask.work) / self.weights.get(entry.ask.tenant, 1.0)
        self._forget_idle(q)
        self.pump(now)

    def withdraw(self, entry: Entry, now: float) -> None:
        """``entry`` leaves the queue before its grant (its client left, the
        server shuts down); a group waits on for a member in its place."""
        unit = entry.unit
        if entry.granted or entry.refusal is not None or unit is None or unit.done:
            return
        q = self.classes[unit.cls]
        unit.entries.remove(entry)
        entry.unit = None  # once: a second withdraw finds nothing to do
        q.depth -= 1
        q.nbytes -= entry.ask.nbytes
        q.tenant_stats(entry.ask.tenant)[0] -= 1
        if not unit.entries:
            unit.done = True
            unit.queued = False
            self._backlog(q, unit.tenant, -1)
            self._ungroup(unit)
        elif unit.queued and not unit.complete:
            unit.queued = False
            unit.version += 1
        elif unit.queued:
            self._push(q, unit)  # its deadline may have changed
        self.pump(now)

    def expire(self, now: float) -> None:
        """Shed every unit past its wait or its deadline at ``now``."""
        for q in self.classes:
            for unit in list(q.fifo[q.fifo_head:]):
                self.expire_unit(unit, now)

    def expiry(self, unit: Unit) -> float:
        """When ``unit`` is shed unless admitted: its wait's end or its deadline."""
        return min(unit.arrived + self.wait, unit.deadline)

    def expire_unit(self, unit: Unit, now: float) -> None:
        """Shed ``unit`` if it is past its wait or its deadline at ``now``."""
        if unit.done:
            return
        q = self.classes[unit.cls]
        if unit.deadline <= now:
            self._shed_unit(unit, self._refusal(q, DEADLINE, "its deadline passed while it waited"))
        elif now - unit.arrived >= self.wait:
            if not unit.complete:
                refusal = self._refusal(q, GROUP_INCOMPLETE, f"its group had {len(unit.entries)} of "
                                                             f"{unit.size} members after {self.wait:g} s")
            else:
                refusal = self._refusal(q, WAIT, f"no room within {self.wait:g} s")
            self._shed_unit(unit, refusal)

    def shut(self) -> None:
        """The server shuts down: every waiting unit is refused with 503
        (:data:`SHUTDOWN`, no ``Retry-After``)."""
        for q in self.classes:
            for unit in list(q.fifo[q.fifo_head:]):
                if not unit.done:
                    self._shed_unit(unit, Refusal(503, SHUTDOWN, "server is shutting down", None))

    def _shed_unit(self, unit: Unit, refusal: Refusal) -> None:
        q = self.classes[unit.cls]
        self._take(q, unit)
        for entry in unit.entries:
            entry.refusal = refusal
            self._count_shed(q, entry.ask.tenant, refusal.reason)
            if entry.event is not None:
                entry.event.set()
        self._forget_idle(q)

    def _refusal(self, q: ClassQueue, reason: str, why: str) -> Refusal:
        retry = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(q.wait_estimate)))
        return Refusal(429, reason, f"overloaded: shed from the {q.name} queue ({reason}): {why}", retry)

    def _count_shed(self, q: ClassQueue, tenant: str, reason: str) -> None:
        q.shed[reason] = q.shed.get(reason, 0) + 1
        q.tenant_stats(tenant)[2] += 1

    def _forget_idle(self, q: ClassQueue) -> None:
        """Keep at most ``max_tenants`` counters: drop idle tenants' when
        over (they come back lifted, :meth:`_backlog`)."""
        if len(q.counters) > self.max_tenants:
            for tenant in [t for t in q.counters if t not in q.backlog]:
                del q.counters[tenant]
                if len(q.counters) <= self.max_tenants:
                    break
        if len(q.tenants) > self.max_tenants + 1:
            for tenant in [t for t, row in q.tenants.items() if row[0] == 0 and t not in q.counters]:
                del q.tenants[tenant]

    # -- figures --------------------------------------------------------------------

    def stats(self) -> dict:
        """Per class: ``waiting``, ``waiting_bytes``, ``held`` (sequences),
        ``held_requests``, ``admitted``, ``wait_seconds_total``,
        ``wait_estimate_s``, ``shed`` by reason, and per tenant
        ``[waiting, admitted, shed, wait seconds]`` with its virtual counter."""
        return {
            q.name: {
                "waiting": q.depth, "waiting_bytes": q.nbytes, "held": q.held, "held_requests": q.held_requests,
                "admitted": q.admitted, "wait_seconds_total": round(q.wait_total, 6),
                "wait_estimate_s": round(q.wait_estimate, 6), "shed": dict(q.shed),
                "tenants": {
                    t: {"waiting": int(r[0]), "admitted": int(r[1]), "shed": int(r[2]),
                        "wait_seconds_total": round(r[3], 6), "counter": round(q.counters.get(t, 0.0), 3)}
                    for t, r in q.tenants.items()
                },
            }
            for q in self.classes
        }
