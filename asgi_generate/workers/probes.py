"""Health probes: whether a worker is up, and what it serves.

Each worker is probed on its own connection (``probe_pool``) within the
router's ``health_timeout``: its engine's health route, and, while it is
not up, its server info, context length, engine version and weight version
(:func:`read_info`). These reads are idempotent: one the worker dropped on
a reused connection gets one fresh try. An up worker is marked down after
``health_failures`` failed probes in a row, or at once when the probe
cannot connect or its connection breaks (the worker is then lost: its
requests are told at once).

Slow is not dead: while the worker is busy with what the frontend asked
(:attr:`~asgi_generate.workers.worker.Worker.busy`: an admin or weight call
in flight on it, or a pause, sleep or memory release it took until the
route that ends it answered 200; or its fleet is paused, by this process or
by another process or replica whose pause the engines reported,
:mod:`~asgi_generate.workers.fleet_state`), a probe that times out or is answered
other than 200 counts for nothing. SGLang's ``/health`` runs a one-token
generation that a loading or paused scheduler does not serve
(``http_server.py`` ``health_generate``). The call's own deadline decides
instead (``weight_update_timeout``, ``admin_timeout``): a weight load that
failed or timed out fences the worker (:mod:`~asgi_generate.workers.fence`),
and once no call holds it its probes count again. A probe that cannot
connect, or whose connection breaks, still takes it out at once: the engine
is gone, not busy.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import anyio
import orjson

from ..exceptions import ConnectFailed, WorkerDisconnected, WorkerError
from .http import ConnectionPool
from .pauses import Pauses
from .worker import Worker
from ..protocols import read_model_card

# The router's logger: these lines are the router's decisions.
# The router's logger, as before the split: operators match its lines by that name.
log = logging.getLogger("asgi_generate.router")


class Probing(Protocol):
    """What a probe needs of the router.

    Attributes:
        health_timeout: seconds one probe may take.
        health_failures: failed probes in a row that take an up worker out.
        pauses: the fleets' pauses, this process's own and those learned
            from the engines (:mod:`~asgi_generate.workers.fleet_state`).
    """

    health_timeout: float
    health_failures: int
    pauses: Pauses

    def mark_down(self, worker: Worker, reason: str) -> None:
        """Stop routing to ``worker`` until a probe succeeds."""

    def worker_lost(self, worker: Worker, reason: str) -> None:
        """Mark ``worker`` down and tell every request riding it."""


async def probe(router: Probing, worker: Worker) -> bool:
    """Check ``worker``'s health (and, when it is not up, read its server
    info and engine version) within ``router.health_timeout``; mark it up,
    count a failure, or declare it lost (``router.worker_lost``). Returns
    whether it is up."""
    proto = worker.protocol
    pool = worker.probe_pool
    try:
        with anyio.fail_after(router.health_timeout):
            async with pool.request(b"GET", proto.health_path, idempotent=True) as resp:
                await resp.read()
                if resp.status != 200:
                    raise WorkerError(f"health answered {resp.status}")
            if not worker.healthy:
                worker.info = await read_info(worker)
    except TimeoutError:
        _failed(router, worker, f"health probe got no answer within {router.health_timeout:g} s", False)
        return False
    except (WorkerError, orjson.JSONDecodeError) as exc:
        at_once = isinstance(exc, (ConnectFailed, WorkerDisconnected))
        _failed(router, worker, str(exc) or type(exc).__name__, at_once)
        return False
    worker.failures = 0
    if not worker.healthy:
        log.info("worker %s (%s) is up", worker.id, worker.url)
    worker.healthy = True
    worker.last_error = None
    return True


async def read_info(worker: Worker) -> dict[str, Any]:
    """``worker``'s server info as its engine's description reads it
    (:meth:`~asgi_generate.protocols.WorkerProtocol.read_info`), with its
    context length, engine version and weight version where the engine
    serves them.

    Raises:
        WorkerError: the info route answered other than 200, or the
            connection failed.
        orjson.JSONDecodeError: the info or version answer is not JSON.
    """
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
            info["max_model_len"] = await _context_length(pool, proto.models_path)
    if proto.version_path is not None:
        async with pool.request(b"GET", proto.version_path, idempotent=True) as resp:
            body = await resp.read()
        # An engine without the route still serves; its version
        # stays unknown and codecs rely on no versioned behaviour.
        info["version"] = proto.read_version(orjson.loads(body)) if resp.status == 200 else None
    if proto.weight_version_path is not None:
        info["weight_version"] = await read_weight_version(worker)
    return info


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


def _failed(router: Probing, worker: Worker, reason: str, at_once: bool) -> None:
    busy = worker.busy
    if busy is None and router.pauses.pausing(worker.protocol.name):
        busy = "its fleet is paused"  # another process's or replica's pause, read from the engines
    if busy is not None and not at_once:
        log.debug("worker %s (%s) health probe failed while busy (%s), not counted: %s",
                  worker.id, worker.url, busy, reason)
        return
    worker.failures += 1
    if at_once or worker.failures >= router.health_failures:
        router.worker_lost(worker, reason)
    elif not worker.healthy:
        router.mark_down(worker, reason)
    else:
        log.warning("worker %s (%s) health probe failed (%d of %d before down): %s",
                    worker.id, worker.url, worker.failures, router.health_failures, reason)


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
