"""What the request path and the workers' services use of a worker's
connection pool and of one of its responses, as typed Protocols.

:class:`~asgi_generate.workers.http.ConnectionPool` and its
:class:`~asgi_generate.workers.http.Response` are the implementation; the
in-process tests' fakes (tests/fakes.py) implement the same Protocols, and
tests/workers/test_pool_protocols.py checks both against them, member by
member and signature by signature.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import Iterable, Protocol

__all__ = ["WorkerExchange", "WorkerPool", "WorkerResponse"]


class WorkerResponse(Protocol):
    """A worker's response: its head, then reads of its body.

    Attributes:
        status: the HTTP status code.
        content_type: the ``content-type`` header's value, ``None`` if absent.
        retry_after: the ``retry-after`` header's value as sent (RFC 9110
            section 10.2.3), ``None`` if absent.
    """

    status: int
    content_type: bytes | None
    retry_after: bytes | None

    async def read_some(self, deadline: float = math.inf) -> bytes | None:
        """Every body byte that has arrived, waiting for at least one, by
        ``deadline`` (``anyio.current_time()``'s clock); ``None`` once the
        body has ended.

        Raises:
            WorkerDisconnected: the connection broke before the body ended.
            TimedOut: ``deadline`` passed first.
        """
        ...

    async def read(self, deadline: float = math.inf) -> bytes:
        """The whole body, by ``deadline`` (as for :meth:`read_some`)."""
        ...


class WorkerExchange(Protocol):
    """One request, as an async context manager: entering sends it and
    gives the response once its head is in; leaving releases the
    connection (kept for reuse only if the body was read to its end)."""

    async def __aenter__(self) -> WorkerResponse:
        """Send the request; the response once its head is in.

        Raises:
            ConnectFailed: the worker could not be reached.
            Unanswered: the connection closed before the response head.
            WorkerDisconnected: the connection broke.
            TimedOut: the head deadline passed before the head arrived.
        """
        ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None,
    ) -> None:
        """Release the connection."""
        ...


class WorkerPool(Protocol):
    """Connections to one worker."""

    def request(
        self,
        method: bytes,
        path: bytes,
        body: bytes = b"",
        headers: Iterable[tuple[bytes, bytes]] = (),
        head_deadline: float = math.inf,
        idempotent: bool = False,
    ) -> WorkerExchange:
        """``async with pool.request(...) as response``: one request.

        Args:
            method, path: the request line's (``b"POST"``, ``b"/generate"``).
            body: the request body; its ``content-length`` is the pool's.
            headers: further request headers, lower-case names.
            head_deadline: when to stop waiting for the response head, on
                ``anyio.current_time()``'s clock.
            idempotent: the request may reach the worker twice (a probe, an
                info read), so a reused connection closing before the head
                gets one fresh try.
        """
        ...

    async def aclose(self) -> None:
        """Close every idle connection."""
        ...
