"""One engine worker as the router keeps it, and what rides on it.

A worker's state (``up``, ``draining``, ``down``), its server info, its
connection pools and the requests in flight on it;
:class:`~asgi_generate.workers.router.Router` adds, picks, probes
(:mod:`~asgi_generate.workers.probes`) and fences
(:mod:`~asgi_generate.workers.fence`) them.
"""

from __future__ import annotations

from typing import Any, Protocol

import anyio

from .http import ConnectionPool
from .outstanding import Legs
from ..protocols import WorkerProtocol


class InFlight(Protocol):
    """A request riding a worker, as the router sees it (the handler's
    leg).

    Attributes:
        route_key: its request's routing key (:meth:`~asgi_generate.workers.router.Router.routing_key`),
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
            them around each attempt), a :class:`~asgi_generate.workers.outstanding.Legs`
            that the router's load counts watch; assigning a set replaces
            its content.
        failures: health probes failed in a row.
        info: its server info (``{}`` until read); ``info["version"]`` is
            its engine version when it reported one.
        last_error: why it was last marked down.
        role: ``aggregated``, ``prefill`` or ``decode``.
        bootstrap_port: a prefill worker's join port (SGLang's bootstrap port),
            for an engine whose pairs join by one, else ``None``.
        draining: left the fleet: gets no new requests, its in-flight ones
            finish (:meth:`~asgi_generate.workers.router.Router.drain`).
        fence: why it is fenced (it failed a weight update), else ``None``.
        failed_updates: weight updates it failed.
        calls: admin and weight calls the frontend sent it that are in
            flight now (each bounded by its own deadline).
        paused: the routes that end a pause the frontend sent it (its
            engine description's ``pauses``: ``/continue_generation``,
            ``/wake_up``, ...) and it has not yet answered 200; at most
            one per such route.
        times_down: times it left the rotation (marked down while up).

    ``info`` is replaced, never changed in place, so an attempt keeps the
    info (the weight version) its worker had when the attempt was sent.

    Changing what decides whether any worker is routable (``healthy``,
    ``draining``, ``fence``, the weight version in ``info``) bumps
    :attr:`generation`, so routers rebuild their cached candidate lists.
    """

    #: Changes so far, of every worker in the process, to what decides
    #: routability (:class:`~asgi_generate.workers.candidates.CandidateList`).
    generation = 0

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
        self._healthy = False
        self._inflight: Legs = Legs()
        self.failures = 0
        self._info: dict[str, Any] = {}
        self.last_error: str | None = None
        self.index = 0
        self._draining = False
        self._fence: str | None = None
        self.failed_updates = 0
        self.calls = 0
        self.paused: set[str] = set()
        self.times_down = 0
        #: One event per waiter of :meth:`health_changed` (each of its own event loop).
        self._health_waiters: set[anyio.Event] = set()

    @property
    def healthy(self) -> bool:
        """Routable now, health-wise (see the class docstring)."""
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        if value != self._healthy:
            self._healthy = value
            Worker.generation += 1
            for waiter in self._health_waiters:
                waiter.set()
            self._health_waiters.clear()

    async def health_changed(self) -> None:
        """Return at the next change of :attr:`healthy`, either way (a
        service that follows the worker waits here rather than looking
        at it on a timer). A waiter cancelled leaves nothing behind: a
        later one, in another event loop too, waits on its own event."""
        waiter = anyio.Event()
        self._health_waiters.add(waiter)
        try:
            await waiter.wait()
        finally:
            self._health_waiters.discard(waiter)

    @property
    def draining(self) -> bool:
        """Left the fleet (see the class docstring)."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        if value != self._draining:
            self._draining = value
            Worker.generation += 1

    @property
    def fence(self) -> str | None:
        """Why it is fenced, else ``None`` (see the class docstring)."""
        return self._fence

    @fence.setter
    def fence(self, why: str | None) -> None:
        if why != self._fence:
            self._fence = why
            Worker.generation += 1

    @property
    def info(self) -> dict[str, Any]:
        """Its server info (see the class docstring)."""
        return self._info

    @info.setter
    def info(self, info: dict[str, Any]) -> None:
        if info.get("weight_version") != self._info.get("weight_version"):
            Worker.generation += 1
        self._info = info

    @property
    def inflight(self) -> Legs:
        """The requests riding it now (see the class docstring)."""
        return self._inflight

    @inflight.setter
    def inflight(self, legs: Any) -> None:
        if legs is not self._inflight:  # `inflight |= ...` assigns the set itself back
            self._inflight.clear()
            self._inflight.update(legs)

    @property
    def busy(self) -> str | None:
        """Why it is doing what the frontend asked (a call in flight, or
        paused by one), else ``None``: then a failing or slow health probe
        does not take it out (:mod:`~asgi_generate.workers.probes`)."""
        if self.calls:
            return f"{self.calls} admin call(s) in flight"
        if self.paused:
            return f"paused until {', '.join(sorted(self.paused))}"
        return None

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
