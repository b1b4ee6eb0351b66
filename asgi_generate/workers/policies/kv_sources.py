"""The ``kv-aware`` policy's subscriber service: where each worker publishes
its KV cache events, asked of the worker (vLLM ``GET /kv_event_sources``,
0.32 and later; SGLang ``GET /server_info``'s ``kv_events``) or given per
worker (``--kv-events URL=ENDPOINT[+REPLAY]``), then a
:class:`~asgi_generate.workers.kv_events.Subscriber` following them into
the worker's :class:`~asgi_generate.workers.kv_index.KVIndex`. A wildcard
host (``*``, ``0.0.0.0``, ``::``) is the worker URL's host."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import anyio
import orjson

from ...exceptions import WorkerError
from ..kv_events import Source, Subscriber
from .kv_worker import WorkerKV

log = logging.getLogger("asgi_generate.kv_aware")
#: Seconds a discovery request (or a load reading) may take.
DISCOVERY_TIMEOUT_S = 5.0


async def follow_events(worker: Any, kv: WorkerKV, given: Source | None) -> None:
    """``worker``'s subscriber service: once the worker is up, find where it
    publishes (:func:`discover`) and follow its events into ``kv``'s index
    until it leaves (marked down, or lost); then, once it is up again, find
    where it publishes now (a restarted engine may bind a new port; a
    ``given`` source is subscribed to again) with the index reset as a
    restart resets it. A worker without events is scored by its tree
    (``kv.why_tree`` says why) and asked again when it comes back. Runs
    until cancelled."""
    try:
        while True:
            while not worker.healthy:
                await worker.health_changed()
            spell = worker.times_down
            source, block_size, why = await discover(worker, given)
            if source is None:
                kv.why_tree = why
                log.warning("worker %s (%s) publishes no KV events (%s): routed by its prefix tree",
                            worker.id, worker.url, why)
                await _until_left(worker, spell)
                continue
            if block_size:
                kv.index.block_size = block_size
            kv.subscriber = Subscriber(source, kv.index, kv.wake)
            kv.why_tree = ""
            async with anyio.create_task_group() as tg:
                tg.start_soon(kv.subscriber.run)
                await _until_left(worker, spell)
                tg.cancel_scope.cancel()
            log.info("worker %s (%s) left: its KV events (%s) are no longer followed",
                     worker.id, worker.url, source.endpoint)
            kv.subscriber = None
            kv.why_tree = "discovering"
            kv.index.reset("restart")
    finally:
        kv.subscriber = None


async def _until_left(worker: Any, spell: int) -> None:
    """Return once ``worker`` is down, or has been marked down since its
    ``times_down`` was ``spell`` (a down spell over before this task ran
    counts)."""
    while worker.healthy and worker.times_down == spell:
        await worker.health_changed()


async def discover(worker: Any, given: Source | None) -> tuple[Source | None, int | None, str]:
    """Where ``worker`` publishes its KV events, its block size if it says,
    and why not when it does not: ``given`` (a ``--kv-events`` source) when
    there is one, else what the worker answers on its engine's
    ``kv_events_path`` (vLLM ``GET /kv_event_sources``, SGLang ``GET
    /server_info``'s ``kv_events``), read by its ``kv_events_reader``."""
    if given is not None:
        return given, None, ""
    protocol = worker.protocol
    if protocol.kv_events_path is None:
        return None, None, f"{protocol.name} workers say nowhere where they publish KV events"
    path = protocol.kv_events_path
    try:
        with anyio.fail_after(DISCOVERY_TIMEOUT_S):
            async with worker.pool.request(b"GET", path) as resp:
                body = await resp.read()
        if resp.status != 200:
            return None, None, f"GET {path.decode()} answered {resp.status}"
        info = orjson.loads(body)
    except (TimeoutError, WorkerError, orjson.JSONDecodeError) as exc:
        return None, None, f"GET {path.decode()} failed: {exc!r}"
    endpoints, block_size, why = protocol.kv_events_reader(info, urlsplit(worker.url).hostname or "127.0.0.1")
    return (Source(*endpoints) if endpoints is not None else None), block_size, why
