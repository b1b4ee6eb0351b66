"""Workers and the router that spreads requests over them.

Policy: least outstanding requests among healthy workers of the protocol a
codec rides on; ties go round-robin. A worker that cannot be reached, or
whose health probe fails or hangs, is marked down and skipped until its
health route answers 200 again and its server info was read (SGLang's
streaming mode is a server flag the codec needs).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable
from urllib.parse import urlsplit

import anyio
import orjson

from .http import ConnectionPool, WorkerError
from .protocols import PROTOCOLS, WorkerProtocol

log = logging.getLogger("asgi_generate.router")


class Worker:
    """One engine worker.

    Attributes:
        id: ``w0``, ``w1``, ... in configuration order.
        url: its base URL, ``http://host:port``.
        protocol: the native protocol it speaks.
        pool: its keep-alive connection pool.
        healthy: routable now.
        outstanding: requests in flight on it.
        info: its server info (``{}`` until read); ``info["version"]`` is
            its engine version when it reported one.
        last_error: why it was last marked down.
    """

    def __init__(self, wid: str, protocol: WorkerProtocol, url: str, pool: ConnectionPool) -> None:
        self.id = wid
        self.protocol = protocol
        self.url = url
        self.pool = pool
        self.healthy = False
        self.outstanding = 0
        self.info: dict[str, Any] = {}
        self.last_error: str | None = None
        self.index = 0

    def describe(self) -> dict[str, Any]:
        """The worker as ``/v1/models`` lists it."""
        return {
            "id": self.id,
            "url": self.url,
            "protocol": self.protocol.name,
            "state": "up" if self.healthy else "down",
            "outstanding": self.outstanding,
            "model": self.info.get("served_model_name") or self.info.get("model_path"),
            "engine_version": self.info.get("version"),
            "last_error": self.last_error,
        }


def parse_worker_spec(spec: str) -> tuple[str, str]:
    """Split ``PROTOCOL=http://HOST:PORT`` into protocol and URL.

    Raises:
        ValueError: unknown protocol, or not an ``http://host:port`` URL.
    """
    protocol, sep, url = spec.partition("=")
    if not sep:
        raise ValueError(f"worker {spec!r}: expected PROTOCOL=http://HOST:PORT")
    if protocol not in PROTOCOLS:
        raise ValueError(f"worker {spec!r}: unknown protocol {protocol!r} (known: {', '.join(PROTOCOLS)})")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise ValueError(f"worker {spec!r}: expected an http://HOST:PORT URL")
    return protocol, url.rstrip("/")


class Router:
    """Picks workers and tracks their health.

    Args:
        specs: ``(protocol, url)`` pairs.
        connect_timeout, read_timeout: for each worker's pool, in seconds.
    """

    def __init__(
        self,
        specs: Iterable[tuple[str, str]],
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 300.0,
    ) -> None:
        self.workers: list[Worker] = []
        self._by_protocol: dict[str, list[Worker]] = {}
        self._next: dict[str, int] = {}
        for i, (protocol, url) in enumerate(specs):
            parts = urlsplit(url)
            pool = ConnectionPool(
                parts.hostname, parts.port, connect_timeout=connect_timeout, read_timeout=read_timeout
            )
            worker = Worker(f"w{i}", PROTOCOLS[protocol], url, pool)
            group = self._by_protocol.setdefault(protocol, [])
            worker.index = len(group)
            group.append(worker)
            self.workers.append(worker)

    def has_protocol(self, protocol: str) -> bool:
        """Whether any worker (up or down) speaks ``protocol``."""
        return protocol in self._by_protocol

    def pick(self, protocol: str, exclude: Iterable[Worker] = ()) -> Worker | None:
        """The healthy worker of ``protocol`` with the fewest outstanding
        requests, ties round-robin; ``None`` if none is left."""
        group = self._by_protocol.get(protocol)
        if not group:
            return None
        n = len(group)
        start = self._next.get(protocol, 0)
        best = None
        for i in range(n):
            w = group[(start + i) % n]
            if w.healthy and (best is None or w.outstanding < best.outstanding) and w not in exclude:
                best = w
        if best is not None:
            self._next[protocol] = (best.index + 1) % n
        return best

    def mark_down(self, worker: Worker, reason: str) -> None:
        """Stop routing to ``worker`` until a probe succeeds (logged when it
        was up, or had not been reached yet)."""
        if worker.healthy or worker.last_error is None:
            log.warning("worker %s (%s) marked down: %s", worker.id, worker.url, reason)
        worker.healthy = False
        worker.last_error = reason

    async def probe(self, worker: Worker, timeout: float = 5.0) -> bool:
        """Check ``worker``'s health (and read its server info); mark it up or
        down accordingly. Returns whether it is up."""
        proto = worker.protocol
        try:
            with anyio.fail_after(timeout):
                async with worker.pool.request(b"GET", proto.health_path) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise WorkerError(f"health answered {resp.status}")
                info: dict[str, Any] = {}
                if proto.info_path is not None:
                    async with worker.pool.request(b"GET", proto.info_path) as resp:
                        body = await resp.read()
                        if resp.status != 200:
                            raise WorkerError(f"server info answered {resp.status}")
                    info = proto.read_info(orjson.loads(body))
                if proto.version_path is not None:
                    async with worker.pool.request(b"GET", proto.version_path) as resp:
                        body = await resp.read()
                    # An engine without the route still serves; its version
                    # stays unknown and codecs rely on no versioned behaviour.
                    info["version"] = proto.read_version(orjson.loads(body)) if resp.status == 200 else None
                worker.info = info
        except (WorkerError, TimeoutError, orjson.JSONDecodeError) as exc:
            self.mark_down(worker, str(exc) or type(exc).__name__)
            return False
        if not worker.healthy:
            log.info("worker %s (%s) is up", worker.id, worker.url)
        worker.healthy = True
        worker.last_error = None
        return True

    async def watch(self, interval: float) -> None:
        """Forever: probe every worker each ``interval`` seconds, so a down
        worker comes back and an up one that stopped answering (hung, not
        refusing connections) leaves the rotation."""
        while True:
            async with anyio.create_task_group() as tg:
                for w in self.workers:
                    tg.start_soon(self.probe, w)
            await anyio.sleep(interval)

    @property
    def healthy_count(self) -> int:
        """Workers routable now."""
        return sum(w.healthy for w in self.workers)

    async def aclose(self) -> None:
        """Close every idle worker connection."""
        for w in self.workers:
            await w.pool.aclose()
