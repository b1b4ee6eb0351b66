"""The ``kv-aware`` policy's load readings: each engine's running and
waiting requests (:mod:`~asgi_generate.workers.engine_load`: SGLang
``GET /v1/loads``, vLLM ``GET /metrics``), read every ``interval`` seconds
while the worker is up, an idle engine's less often (:func:`read_due`),
into its :class:`~asgi_generate.workers.policies.kv_worker.WorkerKV`."""

from __future__ import annotations

import logging
from typing import Any, Callable

import anyio

from ...exceptions import WorkerError
from ..engine_load import parse_load
from .kv_sources import DISCOVERY_TIMEOUT_S, WATCH_S
from .kv_worker import WorkerKV

log = logging.getLogger("asgi_generate.kv_aware")


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
    while True:
        if not worker.healthy:
            kv.read(None, 0)
            kv.why_own = "worker down"
            await anyio.sleep(WATCH_S)
            continue
        if not read_due(kv, worker.outstanding, clock(), idle_interval):
            kv.skipped += 1
            await anyio.sleep(interval)
            continue
        kv.read_at, kv.read_mark = clock(), kv.activity()
        # Own requests that ended shortly before the reading may still be
        # in the engine's count: subtract the most this replica had there
        # since the previous reading was asked for.
        window, kv.peak = kv.peak, worker.outstanding
        try:
            with anyio.fail_after(DISCOVERY_TIMEOUT_S):
                async with worker.pool.request(b"GET", path) as resp:
                    body = await resp.read()
            if resp.status != 200:
                raise ValueError(f"answered {resp.status}")
            kv.read(parse_load(protocol, body), max(window, kv.peak, worker.outstanding))
            kv.readings += 1
        except (TimeoutError, WorkerError, ValueError) as exc:
            why = f"GET {path.decode()}: {exc!r}"
            if why != kv.why_own:  # once per reason, not per reading
                log.warning("worker %s (%s): no load reading (%s): weighed by this replica's own "
                            "requests", worker.id, worker.url, why)
            kv.read(None, 0)
            kv.why_own = why
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
