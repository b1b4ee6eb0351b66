"""Fleet membership: keeps the router's workers equal to what discovery
says, while serving.

Every ``interval`` seconds (when the fleet can change at all:
:attr:`Discovery.dynamic`) the members are read again:

- a new member joins the router at once, but gets requests only after its
  health probe passes (:meth:`Router.probe`), as every worker;
- a member that vanished drains (:meth:`Router.drain`): no new requests,
  while the requests riding it finish and its probes and aborts go on; once
  nothing uses it any more (``busy`` says so, checked every
  :data:`DRAIN_POLL` seconds) it is removed and its connections closed;
- a draining member that comes back before it was removed is routed to
  again, under its id.

Each worker runs in a task of its own: its health probe loop (every
``health_interval`` seconds from the end of one probe to the next, so a
hung worker's probe never delays another's) and the per-worker services the
app adds (its abort queue).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import anyio

from .discovery import Discovery, Member
from .router import Router, Worker

log = logging.getLogger("asgi_generate.membership")
#: Seconds between checks whether a draining worker is still in use.
DRAIN_POLL = 0.05


class Membership:
    """Runs the fleet's workers and follows discovery (module docstring).

    Args:
        router: the router whose workers this keeps.
        discovery: where the members come from.
        interval: seconds between reads of the members.
        health_interval: seconds between the end of one health probe of a
            worker and the next.
        busy: whether a draining worker is still used (requests riding it,
            engine legs to abort, aborts queued or in flight).
        services: per worker, a coroutine function to run beside its probe
            loop while it is a member (cancelled at removal).
        on_remove: called with a worker once it is removed.
    """

    def __init__(
        self,
        router: Router,
        discovery: Discovery,
        *,
        interval: float,
        health_interval: float,
        busy: Callable[[Worker], bool] = lambda w: bool(w.inflight),
        services: Callable[[Worker], Callable[[], Awaitable[None]]] | None = None,
        on_remove: Callable[[Worker], None] | None = None,
    ) -> None:
        self.router = router
        self.discovery = discovery
        self.interval = interval
        self.health_interval = health_interval
        self.busy = busy
        self.services = services
        self.on_remove = on_remove
        self.members: dict[Member, Worker] = {}
        #: Set when a worker starts draining (its task then watches ``busy``).
        self._leaving: dict[Worker, anyio.Event] = {}
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Read the members, probe every worker once (concurrently), report
        started, then run the workers and, for a dynamic fleet, follow
        discovery until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            joined = self._apply(await self.discovery.members())
            async with anyio.create_task_group() as probes:
                for worker in joined:
                    probes.start_soon(self.router.probe, worker)
            for worker in joined:
                tg.start_soon(self._serve, worker, True)
            task_status.started()
            while self.discovery.dynamic:
                await anyio.sleep(self.interval)
                await self.refresh()

    async def refresh(self) -> None:
        """Read the members once and apply the change."""
        for worker in self._apply(await self.discovery.members()):
            log.info("worker %s (%s, %s) joins", worker.id, worker.url, worker.role)
            self._tg.start_soon(self._serve, worker, False)

    def _apply(self, wanted: list[Member]) -> list[Worker]:
        """Add new members, drain vanished ones, restore returning ones;
        returns the workers added."""
        joined = []
        for member in wanted:
            worker = self.members.get(member)
            if worker is None:
                worker = self.router.add(member.protocol, member.url, member.role)
                self.members[member] = worker
                self._leaving[worker] = anyio.Event()
                joined.append(worker)
            elif worker.draining:
                self.router.undrain(worker)
                log.info("worker %s (%s) is back; no longer draining", worker.id, worker.url)
        gone = set(self.members) - set(wanted)
        for member in gone:
            worker = self.members[member]
            if not worker.draining:
                self.router.drain(worker)
                self._leaving[worker].set()
                log.info("worker %s (%s) left the fleet: draining %d request(s)",
                         worker.id, worker.url, worker.outstanding)
        return joined

    async def _serve(self, worker: Worker, probed: bool) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._probe_loop, worker, probed)
            if self.services is not None:
                tg.start_soon(self.services(worker))
            while True:
                await self._leaving[worker].wait()
                while worker.draining and self.busy(worker):
                    await anyio.sleep(DRAIN_POLL)
                if worker.draining:
                    break
                self._leaving[worker] = anyio.Event()  # it came back
            tg.cancel_scope.cancel()
        member = next(m for m, w in self.members.items() if w is worker)
        del self.members[member], self._leaving[worker]
        self.router.remove(worker)
        if self.on_remove is not None:
            self.on_remove(worker)
        with anyio.CancelScope(shield=True):
            await worker.pool.aclose()
            await worker.probe_pool.aclose()
        log.info("worker %s (%s) drained and removed", worker.id, worker.url)

    async def _probe_loop(self, worker: Worker, probed: bool) -> None:
        if probed:
            await anyio.sleep(self.health_interval)
        while True:
            await self.router.probe(worker)
            await anyio.sleep(self.health_interval)
