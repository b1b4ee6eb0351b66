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
when the probe cannot connect or its connection breaks. A worker the probe
marks down has its in-flight requests told at once
(:meth:`Router.worker_lost`) rather than left to their timeouts. A down
worker comes back when its health route answers 200 again and its server
info was read (SGLang's streaming mode is a server flag the codec needs).

The version fence. Each worker's weight version is read with its server
info (SGLang ``/get_model_info``, vLLM ``/weight_info``) and set by the
weight routes that change it (:meth:`Router.weights_loaded`). Once a weight
version is set on a protocol's fleet, a request goes only to workers at that
version; a worker that failed its update is fenced (out of the rotation,
logged, counted, its reason shown) until it reaches the fleet's version or
an operator clears the fence. A request may ask for a minimum version
(:data:`MIN_VERSION_HEADER`); versions compare part by part, digits as
numbers (``v9`` < ``v10``).
"""

from __future__ import annotations

import itertools
import logging
import re
import ssl
from dataclasses import dataclass
from typing import Any, Iterable, Protocol
from urllib.parse import urlsplit

import anyio
import orjson

from .http import ConnectFailed, ConnectionPool, WorkerDisconnected, WorkerError, tls_context
from .pauses import Pauses
from .policies import Policy
from ..protocols import PROTOCOLS, WorkerProtocol, read_model_card

log = logging.getLogger("asgi_generate.router")
ROLES = ("aggregated", "prefill", "decode")
#: The request header asking for workers at this weight version or later.
MIN_VERSION_HEADER = b"asgi-generate-min-weight-version"


def version_order(version: str) -> tuple:
    """A sort key for weight versions: digit runs as numbers, the rest as text."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", version) if p)


@dataclass(frozen=True, slots=True)
class RouteKey:
    """A routing key with a minimum weight version: the policy's key and
    the version a request asked for at least."""

    policy_key: Any
    min_version: str


class InFlight(Protocol):
    """A request riding a worker, as the router sees it (the handler's
    leg).

    Attributes:
        route_key: its request's routing key (:meth:`Router.routing_key`),
            or ``None``.
        attempt: its attempt; ``attempt.tokens`` are the output tokens it
            produced so far.
    """

    route_key: Any
    attempt: Any

    def worker_lost(self, worker: "Worker", reason: str) -> None:
        """``worker`` was declared lost by its health probe: stop waiting
        for it (today the request ends; migration will resume it elsewhere).
        Called from the probe's task; must not block."""


class Worker:
    """One engine worker.

    Attributes:
        id: ``w0``, ``w1``, ... in the order workers joined (never reused).
        url: its base URL, ``http://host:port`` or ``https://host:port``.
        protocol: the native protocol it speaks.
        pool: its keep-alive connection pool for requests and aborts.
        probe_pool: the health probe's own connection, so probes never wait
            behind requests.
        healthy: routable now.
        inflight: the requests riding it now (the handler adds and removes
            them around each attempt).
        failures: health probes failed in a row.
        info: its server info (``{}`` until read); ``info["version"]`` is
            its engine version when it reported one.
        last_error: why it was last marked down.
        role: ``aggregated``, ``prefill`` or ``decode``.
        bootstrap_port: a prefill worker's join port (SGLang's bootstrap port),
            for an engine whose pairs join by one, else ``None``.
        draining: left the fleet: gets no new requests, its in-flight ones
            finish (:meth:`Router.drain`).
        fence: why it is fenced (it failed a weight update), else ``None``.
        failed_updates: weight updates it failed.

    ``info`` is replaced, never changed in place, so an attempt keeps the
    info (the weight version) its worker had when the attempt was sent.
    """

    def __init__(
        self, wid: str, protocol: WorkerProtocol, url: str, pool: ConnectionPool, probe_pool: ConnectionPool,
        role: str = "aggregated", bootstrap_port: int | None = None,
    ) -> None:
        self.id = wid
        self.protocol = protocol
        self.url = url
        self.role = role
        self.bootstrap_port = bootstrap_port
        self.pool = pool
        self.probe_pool = probe_pool
        self.healthy = False
        self.inflight: set[InFlight] = set()
        self.failures = 0
        self.info: dict[str, Any] = {}
        self.last_error: str | None = None
        self.index = 0
        self.draining = False
        self.fence: str | None = None
        self.failed_updates = 0

    @property
    def weight_version(self) -> str | None:
        """The weight version its engine serves, ``None`` when unknown."""
        return self.info.get("weight_version")

    @property
    def outstanding(self) -> int:
        """Requests in flight on it."""
        return len(self.inflight)

    @property
    def state(self) -> str:
        """``draining`` (out of the rotation, its requests running on),
        ``up`` (in the rotation) or ``down``, as ``/v1/models`` lists it."""
        return "draining" if self.draining else "up" if self.healthy else "down"

    def describe(self) -> dict[str, Any]:
        """The worker as ``/v1/models`` lists it."""
        return {
            "id": self.id,
            "url": self.url,
            "protocol": self.protocol.name,
            "role": self.role,
            **({"bootstrap_port": self.bootstrap_port} if self.bootstrap_port is not None else {}),
            "state": self.state,
            "outstanding": self.outstanding,
            "model": self.info.get("served_model_name") or self.info.get("model_path"),
            "engine_version": self.info.get("version"),
            "max_model_len": self.info.get("max_model_len"),
            "last_error": self.last_error,
            "weight_version": self.weight_version,
            "fence": self.fence,
        }


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
    ) -> None:
        self.policy = policy if policy is not None else Policy()
        self.workers: list[Worker] = []
        self.ssl_context = ssl_context
        self.disaggregation = disaggregation
        self._groups: dict[tuple[str, str], list[Worker]] = {}
        self._next: dict[tuple[str, str], int] = {}
        self._ids = itertools.count()
        self.connect_timeout = connect_timeout
        self.health_timeout = health_timeout
        self.health_failures = max(1, health_failures)
        #: The weight version set on each protocol's fleet.
        self.fleet_versions: dict[str, str] = {}
        #: Each protocol's pauses and the streams held across them.
        self.pauses = Pauses()
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

    def routable(self, worker: Worker, min_version: str | None = None) -> bool:
        """Whether ``worker`` may get a new request: up, not fenced, at its
        fleet's weight version once one is set, and at ``min_version`` or
        later when given."""
        if not worker.healthy or worker.fence is not None:
            return False
        have = worker.weight_version
        target = self.fleet_versions.get(worker.protocol.name)
        if target is not None and have != target:
            return False
        return min_version is None or (have is not None and version_order(have) >= version_order(min_version))

    def unavailable(self, protocol: str, key: Any = None) -> str:
        """Why no worker of ``protocol`` can take a request with ``key``:
        the 503's message."""
        if not self.has_protocol(protocol):
            return f"no worker configured for protocol {protocol!r}"
        workers = [w for w in self.workers if w.protocol.name == protocol and w.healthy and not w.draining]
        target = self.fleet_versions.get(protocol)
        fenced = any(w.fence is not None for w in workers)
        if not workers or (target is None and not fenced and not isinstance(key, RouteKey)):
            return f"no healthy worker for protocol {protocol!r}"
        wanted = ["unfenced"] if fenced else []
        if target is not None:
            wanted.append(f"at the fleet's weight version {target!r}")
        if isinstance(key, RouteKey):
            wanted.append(f"at weight version {key.min_version!r} or later")
        seen = ", ".join(f"{w.id}: {w.weight_version}" + (f" (fenced: {w.fence})" if w.fence else "")
                         for w in workers)
        return f"no healthy worker for protocol {protocol!r} {' and '.join(wanted)} ({seen})"

    def weights_loaded(self, protocol: str, loaded: list[Worker], failed: dict[Worker, str],
                       version: str | None, fleet: bool, with_weights: bool) -> None:
        """A weight route answered: ``loaded`` workers now serve ``version``
        (``None``: the label is kept), each of ``failed`` (with why) is
        fenced and counted. With ``fleet`` (the call went to every worker,
        not a named one) ``version`` becomes the fleet's. A fenced worker
        that reaches the fleet's version (any, while no fleet call set one)
        is let back when the call loaded weights with it (``with_weights``)
        or named that worker; a fleet call that only relabels keeps it
        fenced (it missed the weights)."""
        if fleet and version is not None:
            self.fleet_versions[protocol] = version
        target = self.fleet_versions.get(protocol)
        for w in loaded:
            if version is not None:
                w.info = {**w.info, "weight_version": version}
            back = with_weights or not fleet
            if w.fence is not None and back and (target is None or w.weight_version == target):
                log.warning("worker %s (%s) reached weight version %r: back in the rotation", w.id, w.url,
                            w.weight_version)
                w.fence = None
        for w, why in failed.items():
            w.failed_updates += 1
            w.fence = why
            log.warning("worker %s (%s) fenced out of the rotation: %s", w.id, w.url, why)

    def clear_fence(self, worker: Worker, version: str | None) -> None:
        """An operator let ``worker`` back, its engine now at ``version``."""
        log.warning("worker %s (%s) fence cleared by an operator (was: %s); weight version %r", worker.id,
                    worker.url, worker.fence, version)
        worker.fence = None
        worker.info = {**worker.info, "weight_version": version}

    def pick(
        self, protocol: str, exclude: Iterable[Worker] = (), role: str = "aggregated", key: Any = None
    ) -> Worker | None:
        """A :meth:`routable` ``role`` worker of ``protocol`` outside ``exclude``;
        ``None`` if none is left. The policy chooses for a ``key``
        (:meth:`routing_key`) unless ``role`` is ``decode``; otherwise, and
        always as the policy's fallback: the fewest outstanding requests,
        ties round-robin. Without a key, picking changes no policy state
        (a pick may be asked only to learn whether a worker is left)."""
        floor = key.min_version if isinstance(key, RouteKey) else None
        key = key.policy_key if isinstance(key, RouteKey) else key
        group = self._groups.get((protocol, role))
        if not group:
            return None
        n = len(group)
        start = self._next.get((protocol, role), 0)
        candidates = [w for w in (group[(start + i) % n] for i in range(n))
                      if self.routable(w, floor) and w not in exclude]
        if not candidates:
            return None
        if key is None or role == "decode":
            best = _least(candidates)
        else:
            best = self.policy.choose(candidates, key, _least)
        self._next[(protocol, role)] = (best.index + 1) % n
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
        return any(self.routable(w) and w not in exclude for w in self._groups.get((protocol, role), ()))

    def plan(self, protocol: str, exclude: Iterable[Worker] = (), key: Any = None) -> tuple[Worker, ...] | None:
        """The workers of a request's next attempt, per ``disaggregation``:
        ``(prefill, decode)`` or ``(aggregated,)``, the policy choosing for
        ``key`` (:meth:`pick`); ``None`` when no healthy worker (pair) is
        left outside ``exclude``."""
        exclude = list(exclude)
        if self.disaggregation != "never":
            # Decode first: the policy only chooses (and learns) when a pair runs.
            decode = self.pick(protocol, exclude, "decode")
            prefill = self.pick(protocol, exclude, "prefill", key) if decode is not None else None
            if prefill is not None and decode is not None:
                return prefill, decode
            if self.disaggregation == "always":
                return None
        worker = self.pick(protocol, exclude, key=key)
        return (worker,) if worker is not None else None

    def mark_down(self, worker: Worker, reason: str) -> None:
        """Stop routing to ``worker`` until a probe succeeds (logged when it
        was up, or had not been reached yet). Its in-flight requests carry
        on: only the probe declares them lost."""
        if worker.healthy or worker.last_error is None:
            log.warning("worker %s (%s) marked down: %s", worker.id, worker.url, reason)
        worker.healthy = False
        worker.last_error = reason

    def worker_lost(self, worker: Worker, reason: str) -> None:
        """The probe gave ``worker`` up: mark it down, make the policy
        forget its cache, and tell every request riding it
        (:meth:`InFlight.worker_lost`) at once."""
        self.mark_down(worker, reason)
        self.policy.forget(worker)
        for request in list(worker.inflight):
            request.worker_lost(worker, reason)

    async def probe(self, worker: Worker) -> bool:
        """Check ``worker``'s health (and, when it is not up, read its server
        info and engine version) within ``health_timeout``; mark it up, count a failure, or
        declare it lost (:meth:`worker_lost`). Returns whether it is up.
        These reads are idempotent: one the worker dropped on a reused
        connection gets one fresh try."""
        proto = worker.protocol
        pool = worker.probe_pool
        try:
            with anyio.fail_after(self.health_timeout):
                async with pool.request(b"GET", proto.health_path, idempotent=True) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise WorkerError(f"health answered {resp.status}")
                if not worker.healthy:
                    worker.info = await self._read_info(worker)
        except TimeoutError:
            self._probe_failed(worker, f"health probe got no answer within {self.health_timeout:g} s", False)
            return False
        except (WorkerError, orjson.JSONDecodeError) as exc:
            at_once = isinstance(exc, (ConnectFailed, WorkerDisconnected))
            self._probe_failed(worker, str(exc) or type(exc).__name__, at_once)
            return False
        worker.failures = 0
        if not worker.healthy:
            log.info("worker %s (%s) is up", worker.id, worker.url)
        worker.healthy = True
        worker.last_error = None
        return True

    async def _read_info(self, worker: Worker) -> dict[str, Any]:
        proto = worker.protocol
        pool = worker.probe_pool
        info: dict[str, Any] = {}
        if proto.info_path is not None:
            async with pool.request(b"GET", proto.info_path, idempotent=True) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise WorkerError(f"server info answered {resp.status}")
            info = proto.read_info(orjson.loads(body))
            if proto.models_path is not None and info.get("max_model_len") is None:
                info["max_model_len"] = await self._context_length(pool, proto.models_path)
        if proto.version_path is not None:
            async with pool.request(b"GET", proto.version_path, idempotent=True) as resp:
                body = await resp.read()
            # An engine without the route still serves; its version
            # stays unknown and codecs rely on no versioned behaviour.
            info["version"] = proto.read_version(orjson.loads(body)) if resp.status == 200 else None
        if proto.weight_version_path is not None:
            info["weight_version"] = await self.read_weight_version(worker)
        return info

    @staticmethod
    async def read_weight_version(worker: Worker) -> str | None:
        """The weight version ``worker``'s engine reports now; ``None`` when
        it has no such route or gives none (an engine without the RL routes
        still serves)."""
        path = worker.protocol.weight_version_path
        if path is None:
            return None
        try:
            async with worker.probe_pool.request(b"GET", path) as resp:
                body = await resp.read()
            return worker.protocol.read_version(orjson.loads(body), "weight_version") if resp.status == 200 else None
        except (WorkerError, orjson.JSONDecodeError):
            return None

    def _probe_failed(self, worker: Worker, reason: str, at_once: bool) -> None:
        worker.failures += 1
        if at_once or worker.failures >= self.health_failures:
            self.worker_lost(worker, reason)
        elif not worker.healthy:
            self.mark_down(worker, reason)
        else:
            log.warning("worker %s (%s) health probe failed (%d of %d before down): %s",
                        worker.id, worker.url, worker.failures, self.health_failures, reason)

    @staticmethod
    async def _context_length(pool: ConnectionPool, path: bytes) -> int | None:
        """The context length from the worker's model list at ``path``,
        ``None`` if it gives none: a worker without the route (or one that
        drops the connection on it) is not unhealthy for that, its prompts
        are just left to it to check."""
        try:
            async with pool.request(b"GET", path, idempotent=True) as resp:
                body = await resp.read()
            if resp.status != 200:
                return None
            return read_model_card(orjson.loads(body)).get("max_model_len")
        except (WorkerError, orjson.JSONDecodeError):
            return None

    @property
    def healthy_count(self) -> int:
        """Workers up and not draining."""
        return sum(w.healthy and not w.draining for w in self.workers)

    async def aclose(self) -> None:
        """Close every idle worker connection."""
        for w in self.workers:
            await w.pool.aclose()
            await w.probe_pool.aclose()


def _least(candidates: list[Worker]) -> Worker:
    """The first of ``candidates`` (in round-robin order) with the fewest
    outstanding requests."""
    return min(candidates, key=_outstanding)


def _outstanding(worker: Worker) -> int:
    return worker.outstanding
