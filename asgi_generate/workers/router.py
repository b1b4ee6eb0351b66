"""Workers and the router that spreads requests over them.

Among the healthy workers of the protocol a codec rides on, the routing
policy (``--policy``, :mod:`asgi_generate.workers.policies`) picks one:
least outstanding requests, ties round-robin, by default. Workers have a
role: ``aggregated``, or ``prefill``/``decode`` for prefill/decode
disaggregation (P/D), where a request runs as a pair of legs
(:meth:`Router.plan`): the policy picks the prefill worker, the decode
worker is least outstanding.

Slow is not dead: a worker leaves the rotation for a failed connect or a
broken connection (reported by the handler through :meth:`Router.mark_down`)
and for failed health probes, never for a slow request. Each worker is
probed on its own connection, in its own loop, every ``health_interval``
seconds, with a budget of its own (``health_timeout``); an up worker is
marked down after ``health_failures`` failed probes in a row, or at once
when the probe cannot connect or its connection breaks; a probe that fails
or times out while the worker is busy with a call the frontend sent (a
weight load, a pause until its resume) counts for nothing. A worker the probe
marks down has its in-flight requests told at once
(:meth:`Router.worker_lost`) rather than left to their timeouts. A down
worker comes back when its health route answers 200 again and its server
info was read (SGLang's streaming mode is a server flag the codec needs).

With admission on, the app gives the router each worker's room
(:attr:`Router.room`, from the engines' own load readings): a request goes
to a worker with room for it, the policy choosing among those
(:meth:`Router.pick`).

A pick reads no worker one by one: the routable workers of each group
are kept between picks (:mod:`~asgi_generate.workers.candidates`), their
outstanding requests counted as they change
(:mod:`~asgi_generate.workers.outstanding`).

The probes are :mod:`~asgi_generate.workers.probes`'s, the weight version
fence :mod:`~asgi_generate.workers.fence`'s, the pauses and versions read
from the engines :mod:`~asgi_generate.workers.fleet_state`'s.
"""

from __future__ import annotations

import itertools
import logging
import ssl
from typing import Any, Callable, Collection, Iterable
from urllib.parse import urlsplit

from . import probes
from .candidates import CandidateList
from .fence import MIN_VERSION_HEADER, Fence, RouteKey
from .fleet_state import FleetState
from .http import ConnectionPool, tls_context
from .pauses import Pauses
from .policies import Policy
from .worker import Worker
from ..protocols import PROTOCOLS

#: ``Worker`` is :mod:`~asgi_generate.workers.worker`'s, named here too for
#: the modules that pick and pass workers.
__all__ = ["ROLES", "Router", "Worker"]

log = logging.getLogger("asgi_generate.router")
ROLES = ("aggregated", "prefill", "decode")
#: Roles whose workers hold a request's running sequences: where room counts.
HOLDING_ROLES = ("aggregated", "decode")
#: Candidate lists a router keeps at most (the minimum versions requests
#: ask for are the client's: past this many the lists are all rebuilt).
MAX_CANDIDATE_LISTS = 64


class Router:
    """Picks workers and tracks their health.

    Args:
        specs: ``(protocol, url)`` pairs of aggregated workers.
        prefill, decode: ``(protocol, url)`` pairs of P/D workers (a prefill
            URL may carry its join port, SGLang's ``?bootstrap_port=B``).
        disaggregation: ``auto`` (pairs when the protocol has a healthy
            prefill and decode worker, else aggregated), ``always`` (pairs
            only) or ``never`` (aggregated only).
        connect_timeout: seconds to connect to a worker.
        health_timeout: seconds one health probe (health route, plus server
            info when the worker is down) may take.
        health_failures: failed probes in a row that take an up worker out
            of the rotation (a probe that cannot connect, or whose connection
            breaks, takes it out at once).
        policy: the routing policy (default: least outstanding).
        ssl_context: the TLS context of ``https://`` workers (default:
            :func:`~asgi_generate.workers.http.tls_context`, verifying
            against the system's CAs).
        fleet_interval, fleet_paused_interval: seconds between readings
            of the engines' pause state and weight versions, and while
            paused (:class:`~asgi_generate.workers.fleet_state.FleetState`).
    """

    def __init__(
        self,
        specs: Iterable[tuple[str, str]],
        *,
        prefill: Iterable[tuple[str, str]] = (),
        decode: Iterable[tuple[str, str]] = (),
        disaggregation: str = "auto",
        connect_timeout: float = 5.0,
        health_timeout: float = 30.0,
        health_failures: int = 3,
        policy: Policy | None = None,
        ssl_context: ssl.SSLContext | None = None,
        fleet_interval: float = 1.0,
        fleet_paused_interval: float = 0.1,
    ) -> None:
        self.policy = policy if policy is not None else Policy()
        self.workers: list[Worker] = []
        self.ssl_context = ssl_context
        self.disaggregation = disaggregation
        self._groups: dict[tuple[str, str], list[Worker]] = {}
        self._next: dict[tuple[str, str], int] = {}
        #: (protocol, role, minimum version) -> its routable workers.
        self._candidates: dict[tuple[str, str, str | None], CandidateList] = {}
        self._ids = itertools.count()
        self.connect_timeout = connect_timeout
        self.health_timeout = health_timeout
        self.health_failures = max(1, health_failures)
        #: The weight version fence.
        self.fence = Fence()
        #: Each protocol's pauses and the streams held across them.
        self.pauses = Pauses()
        #: What the engines say of the fleet (pauses, weight versions), read by every process.
        self.fleet = FleetState(lambda: self.workers, self.pauses, self.fence, fleet_interval, fleet_paused_interval)
        #: Engine sequences a worker takes now (admission's, from its
        #: engine's load reading and this process's requests there), or
        #: ``None``: every worker is a candidate (:meth:`pick`).
        self.room: Callable[[Worker], int] | None = None
        #: Picks that found no worker with room and fell back to the policy's choice.
        self.roomless_picks = 0
        for role, listed in (("aggregated", specs), ("prefill", prefill), ("decode", decode)):
            for protocol, url in listed:
                self.add(protocol, url, role)

    def add(self, protocol: str, url: str, role: str = "aggregated") -> Worker:
        """Register a worker (an ``http://`` or ``https://`` ``url`` as
        :func:`~asgi_generate.worker_specs.parse_worker_spec` gives it, a prefill's bootstrap port
        included; ``dns://`` names are resolved by
        :mod:`~asgi_generate.workers.discovery` first) under the next free
        id. It is routable once a :meth:`probe` passes.

        Raises:
            KeyError: ``protocol`` is unknown.
        """
        engine = PROTOCOLS[protocol]
        base, bootstrap_port = engine.split_url(url, role)
        parts = urlsplit(base)
        tls = None
        if parts.scheme == "https":
            if self.ssl_context is None:
                self.ssl_context = tls_context()
            tls = self.ssl_context
        pool = ConnectionPool(parts.hostname, parts.port, connect_timeout=self.connect_timeout, ssl_context=tls)
        probe_pool = ConnectionPool(parts.hostname, parts.port, connect_timeout=self.connect_timeout, max_idle=1,
                                    ssl_context=tls)
        worker = Worker(f"w{next(self._ids)}", engine, base, pool, probe_pool, role, bootstrap_port)
        self.workers.append(worker)
        self._join_group(worker)
        return worker

    def _join_group(self, worker: Worker) -> None:
        group = self._groups.setdefault((worker.protocol.name, worker.role), [])
        worker.index = len(group)
        group.append(worker)
        self._drop_candidates()

    def _drop_candidates(self) -> None:
        """Forget every candidate list (a group changed)."""
        for listed in self._candidates.values():
            listed.close()
        self._candidates.clear()

    def candidates(self, protocol: str, role: str, floor: str | None = None) -> CandidateList | None:
        """The :meth:`routable` ``role`` workers of ``protocol`` (at
        ``floor`` or later) in group order, kept until a worker's
        routability, the fleet's weight version or the group changes;
        ``None`` if there are none."""
        target = self.fence.versions.get(protocol)
        key = (protocol, role, floor)
        listed = self._candidates.get(key)
        if listed is not None and listed.current(Worker.generation, target):
            return listed if listed.workers else None
        group = self._groups.get((protocol, role))
        if not group:
            return None
        if listed is not None:
            listed.close()
        elif len(self._candidates) >= MAX_CANDIDATE_LISTS:
            self._drop_candidates()
        generation = Worker.generation
        workers = [w for w in group if self.routable(w, floor)]
        listed = self._candidates[key] = CandidateList(workers, len(group), generation, target)
        return listed if workers else None

    def drain(self, worker: Worker) -> None:
        """Stop routing new requests to ``worker``; the requests riding it
        carry on (and its probes and aborts go on) until :meth:`remove`."""
        if worker.draining:
            return
        worker.draining = True
        key = (worker.protocol.name, worker.role)
        group = self._groups[key]
        group.remove(worker)
        for i, w in enumerate(group):
            w.index = i
        self._next[key] = self._next.get(key, 0) % len(group) if group else 0
        self._drop_candidates()

    def undrain(self, worker: Worker) -> None:
        """Route to a draining ``worker`` again (it came back before it was
        removed)."""
        if worker.draining:
            worker.draining = False
            self._join_group(worker)

    def remove(self, worker: Worker) -> None:
        """Forget ``worker`` (drained first); the caller closes its pools."""
        self.drain(worker)
        self.workers.remove(worker)

    def has_protocol(self, protocol: str) -> bool:
        """Whether any worker (up or down, any role) speaks ``protocol``."""
        return any(p == protocol for p, _ in self._groups)

    def routing_key(self, request: Any, headers: Any) -> Any:
        """What the policy routes a request by (see
        :meth:`~asgi_generate.workers.policies.Policy.routing_key`), as a
        :class:`RouteKey` when the request asks for a minimum weight
        version (:data:`MIN_VERSION_HEADER`)."""
        key = self.policy.routing_key(request, headers)
        floor = headers.get(MIN_VERSION_HEADER)
        return RouteKey(key, floor.decode("latin-1").strip()) if floor else key

    @property
    def fleet_versions(self) -> dict[str, str]:
        """The weight version set on each protocol's fleet (:class:`Fence`)."""
        return self.fence.versions

    def routable(self, worker: Worker, min_version: str | None = None) -> bool:
        """Whether ``worker`` may get a new request (:meth:`Fence.admits`)."""
        return self.fence.admits(worker, min_version)

    def unavailable(self, protocol: str, key: Any = None) -> str:
        """Why no worker of ``protocol`` can take a request with ``key``:
        the 503's message."""
        if not self.has_protocol(protocol):
            return f"no worker configured for protocol {protocol!r}"
        workers = [w for w in self.workers if w.protocol.name == protocol and w.healthy and not w.draining]
        return self.fence.unavailable(protocol, workers, key)

    def weights_loaded(self, protocol: str, loaded: list[Worker], failed: dict[Worker, str],
                       version: str | None, fleet: bool, with_weights: bool) -> None:
        """A weight route answered (:meth:`Fence.weights_loaded`)."""
        self.fence.weights_loaded(protocol, loaded, failed, version, fleet, with_weights)

    def clear_fence(self, worker: Worker, version: str | None) -> None:
        """An operator let ``worker`` back, its engine now at ``version``."""
        self.fence.clear(worker, version)

    def pick(
        self, protocol: str, exclude: Collection[Worker] = (), role: str = "aggregated", key: Any = None,
        need: int = 1,
    ) -> Worker | None:
        """A :meth:`routable` ``role`` worker of ``protocol`` outside
        ``exclude`` (a collection, read only when not empty); ``None`` if
        none is left. With :attr:`room` set, an ``aggregated`` or
        ``decode`` worker with room for the request's ``need`` engine
        sequences, if any has. The policy chooses for a ``key``
        (:meth:`routing_key`) unless ``role`` is ``decode``; otherwise, and
        always as the policy's fallback: the fewest outstanding requests,
        ties round-robin. Without a key, picking changes no policy state
        (a pick may be asked only to learn whether a worker is left)."""
        floor = key.min_version if isinstance(key, RouteKey) else None
        key = key.policy_key if isinstance(key, RouteKey) else key
        listed = self.candidates(protocol, role, floor)
        if listed is None:
            return None
        start = self._next.get((protocol, role), 0) % listed.group_size
        room = self.room if role in HOLDING_ROLES else None
        chooses = key is not None and role != "decode"
        if room is None and not chooses and not exclude:
            best = listed.least(start)
        else:
            candidates = listed.rotated(start, exclude)
            if not candidates:
                return None
            least = listed.least_of(candidates, start)
            if room is not None:
                # Room is each engine's own reading, asked worker by worker:
                # a walk of the candidates, run only with admission on.
                roomy = [w for w in candidates if room(w) >= need]
                if roomy:
                    candidates = roomy
                else:
                    # Admission granted the request on the fleet's room in
                    # aggregate, yet no worker has room for it alone: its
                    # sequences are more than any one worker's free share, a
                    # reading went stale since the grant, or a resumed leg
                    # comes back. Holding it would idle the room granted: the
                    # policy's choice queues it briefly in that engine.
                    self.roomless_picks += 1
            best = self.policy.choose(candidates, key, least) if chooses else least(candidates)
        self._next[(protocol, role)] = (best.index + 1) % listed.group_size
        return best

    def can_plan(self, protocol: str, exclude: Iterable[Worker] = ()) -> bool:
        """Whether :meth:`plan` would find workers now, without moving the
        round-robin (a migration asks this before it decides)."""
        exclude = list(exclude)
        if self.disaggregation != "never" and self.up(protocol, "prefill", exclude) and \
                self.up(protocol, "decode", exclude):
            return True
        return self.disaggregation != "always" and self.up(protocol, "aggregated", exclude)

    def up(self, protocol: str, role: str, exclude: Iterable[Worker] = ()) -> bool:
        """Whether a :meth:`routable` ``role`` worker of ``protocol`` is in
        the rotation outside ``exclude``."""
        listed = self.candidates(protocol, role)
        return listed is not None and any(w not in exclude for w in listed.workers)

    def plan(self, protocol: str, exclude: Iterable[Worker] = (), key: Any = None,
             need: int = 1) -> tuple[Worker, ...] | None:
        """The workers of a request's next attempt, per ``disaggregation``:
        ``(prefill, decode)`` or ``(aggregated,)``, the policy choosing for
        ``key`` (:meth:`pick`; the worker holding the request's ``need``
        sequences with room for them, where :attr:`room` says); ``None``
        when no healthy worker (pair) is left outside ``exclude``."""
        exclude = list(exclude)
        if self.disaggregation != "never":
            # Decode first: the policy only chooses (and learns) when a pair runs.
            decode = self.pick(protocol, exclude, "decode", need=need)
            prefill = self.pick(protocol, exclude, "prefill", key) if decode is not None else None
            if prefill is not None and decode is not None:
                return prefill, decode
            if self.disaggregation == "always":
                return None
        worker = self.pick(protocol, exclude, key=key, need=need)
        return (worker,) if worker is not None else None

    def mark_down(self, worker: Worker, reason: str) -> None:
        """Stop routing to ``worker`` until a probe succeeds (logged when it
        was up, or had not been reached yet). Its in-flight requests carry
        on: only the probe declares them lost."""
        if worker.healthy or worker.last_error is None:
            log.warning("worker %s (%s) marked down: %s", worker.id, worker.url, reason)
        if worker.healthy:
            worker.times_down += 1
        worker.healthy = False
        worker.last_error = reason

    def worker_lost(self, worker: Worker, reason: str) -> None:
        """The probe gave ``worker`` up: mark it down, make the policy
        forget its cache, and tell every request riding it
        (:meth:`~asgi_generate.workers.worker.InFlight.worker_lost`) at once."""
        self.mark_down(worker, reason)
        self.policy.forget(worker)
        for request in list(worker.inflight):
            request.worker_lost(worker, reason)

    async def probe(self, worker: Worker) -> bool:
        """Check ``worker``'s health, and mark it up, count a failure or
        declare it lost (:func:`~asgi_generate.workers.probes.probe`).
        Returns whether it is up."""
        return await probes.probe(self, worker)

    #: The weight version ``worker``'s engine reports now
    #: (:func:`~asgi_generate.workers.probes.read_weight_version`).
    read_weight_version = staticmethod(probes.read_weight_version)

    @property
    def healthy_count(self) -> int:
        """Workers up and not draining."""
        return sum(w.healthy and not w.draining for w in self.workers)

    async def aclose(self) -> None:
        """Close every idle worker connection."""
        for w in self.workers:
            await w.pool.aclose()
            await w.probe_pool.aclose()

