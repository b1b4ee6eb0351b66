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
#: Seconds between looks at a worker waiting to be up, or to come back.
WATCH_S = 0.2
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


def _dial(endpoint: str, host: str) -> str:
    """``endpoint`` with a wildcard host replaced by ``host``."""
    rest = endpoint[len("tcp://"):]
    name, _, port = rest.rpartition(":")
    return f"tcp://{host}:{port}" if name in _WILDCARDS else endpoint


async def follow_events(worker: Any, kv: WorkerKV, given: Source | None) -> None:
    """``worker``'s subscriber service: once the worker is up, find where it
    publishes (:func:`discover`) and follow its events into ``kv``'s index
    until cancelled; a worker without events is scored by its tree
    (``kv.why_tree`` says why) and asked again when it comes back."""
    try:
        while True:
            while not worker.healthy:
                await anyio.sleep(WATCH_S)
            source, block_size, why = await discover(worker, given)
            if source is None:
                kv.why_tree = why
                log.warning("worker %s (%s) publishes no KV events (%s): routed by its prefix tree",
                            worker.id, worker.url, why)
                while worker.healthy:
                    await anyio.sleep(WATCH_S)
                continue
            if block_size:
                kv.index.block_size = block_size
            kv.subscriber = Subscriber(source, kv.index)
            kv.why_tree = ""
            await kv.subscriber.run()
    finally:
        kv.subscriber = None


async def discover(worker: Any, given: Source | None) -> tuple[Source | None, int | None, str]:
    """Where ``worker`` publishes its KV events, its block size if it says,
    and why not when it does not: ``given`` (a ``--kv-events`` source) when
    there is one, else what the worker answers (vLLM ``GET
    /kv_event_sources``, SGLang ``GET /server_info``'s ``kv_events``), a
    wildcard host read as the worker URL's."""
    host = urlsplit(worker.url).hostname or "127.0.0.1"
    if given is not None:
        return given, None, ""
    vllm = worker.protocol.name == "vllm"
    path = b"/kv_event_sources" if vllm else b"/server_info"
    try:
        with anyio.fail_after(DISCOVERY_TIMEOUT_S):
            async with worker.pool.request(b"GET", path) as resp:
                body = await resp.read()
        if resp.status != 200:
            return None, None, f"GET {path.decode()} answered {resp.status}"
        info = orjson.loads(body)
    except (TimeoutError, WorkerError, orjson.JSONDecodeError) as exc:
        return None, None, f"GET {path.decode()} failed: {exc!r}"
    if vllm:
        config = info.get("0") if isinstance(info, dict) else None
        if not isinstance(config, dict) or config.get("publisher") != "zmq":
            return None, None, "GET /kv_event_sources lists no zmq publisher"
        replay = config.get("replay_endpoint")
        return (Source(_dial(config["endpoint"], host), replay and _dial(replay, host), config.get("topic") or ""),
                None, "")
    events = info.get("kv_events") if isinstance(info, dict) else None
    if not isinstance(events, dict) or events.get("publisher") != "zmq":
        return None, None, "/server_info has no kv_events publisher"
    name = events.get("endpoint_host") or host
    dial = host if name in _WILDCARDS else name
    replay = events.get("replay_endpoint_port_base")
    source = Source(f"tcp://{dial}:{events['endpoint_port_base']}",
                    f"tcp://{dial}:{replay}" if replay is not None else None, events.get("topic") or "")
    return source, events.get("block_size"), ""
