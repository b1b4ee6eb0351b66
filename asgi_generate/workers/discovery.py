"""Where workers come from: the configured specs, DNS names and a workers
file, read into the list of workers the fleet should hold now.

- ``PROTOCOL=dns://NAME:PORT`` stands for one worker per address NAME
  resolves to (every A and AAAA record: what a Kubernetes headless service
  answers), each at PORT. Names are resolved with :func:`anyio.getaddrinfo`
  (the system resolver, run in a worker thread on asyncio and trio alike)
  at every :meth:`Discovery.members` call. A lookup that fails keeps the
  addresses of the last one that answered (logged once per outage): a
  resolver hiccup must not empty the fleet.
- A workers file (``--workers-file PATH``) holds the lists ``workers``,
  ``prefill`` and ``decode`` of specs as ``--worker``, ``--prefill`` and
  ``--decode`` take them (``dns://`` ones included), as JSON, or TOML when
  the name ends ``.toml``. It is reread whenever its modification time, size
  or inode changes; a file that does not parse (or is gone) keeps the last
  good one, logged once per change.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Awaitable, Callable, Iterable, NamedTuple
from urllib.parse import urlsplit

import anyio

from ..worker_specs import read_workers_file

log = logging.getLogger("asgi_generate.discovery")

#: ``(name, port)`` to the ``(address, port)`` pairs to reach; raises
#: ``OSError`` when the lookup fails.
Resolver = Callable[[str, int], Awaitable[list[tuple[str, int]]]]


class Member(NamedTuple):
    """One worker the fleet should hold: its role, protocol and URL
    (``http://ADDRESS:PORT``, a prefill's ``?bootstrap_port=B`` kept)."""

    role: str
    protocol: str
    url: str


async def resolve(name: str, port: int) -> list[tuple[str, int]]:
    """Every address ``name`` resolves to (A and AAAA), with ``port``,
    sorted and without duplicates.

    Raises:
        OSError: the lookup failed (``socket.gaierror``: no such name, no
            address, resolver unreachable).
    """
    infos = await anyio.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({(info[4][0], info[4][1]) for info in infos})


class Discovery:
    """The fleet's members, from fixed specs, DNS names and a workers file.

    Args:
        specs: ``(role, (protocol, url))`` as configured; a ``dns://`` URL is
            resolved at every call of :meth:`members`.
        workers_file: a workers file's path, or ``None``.
        resolver: the DNS lookup (tests pass a fake one).
    """

    def __init__(
        self,
        specs: Iterable[tuple[str, tuple[str, str]]],
        workers_file: str | None = None,
        resolver: Resolver = resolve,
    ) -> None:
        self.specs = list(specs)
        self.workers_file = workers_file
        self.resolver = resolver
        self._file_specs: list[tuple[str, tuple[str, str]]] = []
        self._file_stamp: tuple[int, int, int] | None = None
        #: The last answer per (name, port): kept when a lookup fails.
        self._answers: dict[tuple[str, int], list[tuple[str, int]]] = {}
        self._failing: set[tuple[str, int]] = set()

    @property
    def dynamic(self) -> bool:
        """Whether the members can change (a DNS name or a workers file)."""
        return self.workers_file is not None or any(u.startswith("dns://") for _, (_, u) in self.specs)

    async def members(self) -> list[Member]:
        """The workers the fleet should hold now, in configuration order,
        each once: the workers file reread if it changed, every name resolved."""
        self._reread_file()
        out: dict[Member, None] = {}
        for role, (protocol, url) in [*self.specs, *self._file_specs]:
            if not url.startswith("dns://"):
                out[Member(role, protocol, url)] = None
                continue
            parts = urlsplit(url)
            query = f"?{parts.query}" if parts.query else ""
            for host, port in await self._lookup(parts.hostname, parts.port):
                host = f"[{host}]" if ":" in host else host
                out[Member(role, protocol, f"http://{host}:{port}{query}")] = None
        return list(out)

    async def _lookup(self, name: str, port: int) -> list[tuple[str, int]]:
        key = (name, port)
        try:
            answer = await self.resolver(name, port)
        except OSError as exc:
            kept = self._answers.get(key, [])
            if key not in self._failing:  # once per outage, not every interval
                self._failing.add(key)
                log.warning("resolving %s failed (%s); keeping its %d last address(es)", name, exc, len(kept))
            return kept
        self._failing.discard(key)
        if answer != self._answers.get(key):
            log.info("%s resolves to %s", name, ", ".join(f"{h}:{p}" for h, p in answer) or "nothing")
        self._answers[key] = answer
        return answer

    def _reread_file(self) -> None:
        if self.workers_file is None:
            return
        try:
            st = os.stat(self.workers_file)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError as exc:
            stamp = None
            problem = f"workers file {self.workers_file!r}: {exc.strerror or exc}"
        if stamp is not None and stamp == self._file_stamp:
            return
        if stamp is not None:
            try:
                self._file_specs = read_workers_file(self.workers_file)
                log.info("workers file %r read: %d spec(s)", self.workers_file, len(self._file_specs))
                self._file_stamp = stamp
                return
            except ValueError as exc:
                problem = str(exc)
        if self._file_stamp != (0, 0, 0) or stamp is not None:
            log.warning("%s; keeping the last workers it listed", problem)
        # Marks the problem as reported until the file changes again.
        self._file_stamp = stamp or (0, 0, 0)
