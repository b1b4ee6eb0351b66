"""Opening one engine leg and its phase deadlines, shared by the aggregated
and the P/D paths: a streamed leg gets ``headers_timeout`` to its response
head, then ``first_token_timeout`` to its first event, then
``inter_token_timeout`` between events; a unary leg gets ``request_timeout``
in all (0 = none)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from .accounting import RequestState
    from ..sdk.codec import Attempt, WorkerRequest
    from ..config import Settings
    from ..workers.http import Response
    from ..workers.router import Worker


def deadline_in(limit: float) -> float:
    """The anyio clock time ``limit`` seconds from now; ``math.inf`` when
    ``limit`` is 0 (no deadline)."""
    return anyio.current_time() + limit if limit > 0 else math.inf


class Leg:
    """``async with Leg(st, settings, worker, attempt, wreq) as resp``: one
    engine leg's worker request, under its phase deadlines.

    Made: the request's dispatch time is stamped (its first leg's), the
    attempt is live and the opening phase runs (``headers`` for a streamed
    leg, ``request`` for a unary one). Entered: the request is sent and its
    response head read by that deadline; a streamed leg then waits for its
    first token (``first_token``). A non-200 answer is read whole into
    :attr:`page` (status, body) and the attempt ends ``error``; otherwise
    :attr:`page` is ``None`` and the caller reads ``resp`` by
    :attr:`deadline`. ``wreq.body`` is handed to the worker's connection
    pool and emptied: a streaming leg does not hold its prompt's bytes.

    Raises (on entering): what :meth:`ConnectionPool.request` and
    :meth:`Response.read` raise: ``ConnectFailed``, ``WorkerError``,
    ``TimedOut`` (the running :attr:`phase` is the one that was missed).
    """

    __slots__ = ("worker", "attempt", "stream", "first_token", "phase", "limit", "deadline", "page", "_exchange")

    def __init__(
        self, st: "RequestState", settings: "Settings", worker: "Worker", attempt: "Attempt", wreq: "WorkerRequest"
    ) -> None:
        if st.t_dispatched is None:
            st.t_dispatched = time.monotonic()
        attempt.live = True
        self.worker, self.attempt, self.stream = worker, attempt, wreq.stream
        #: The first-token limit in seconds (a streamed leg's second phase).
        self.first_token = settings.first_token_timeout
        #: The running phase (``headers``, ``first_token``, ``inter_token``
        #: or ``request``), its limit in seconds and its deadline on anyio's clock.
        self.phase, self.limit = (
            ("headers", settings.headers_timeout) if wreq.stream else ("request", settings.request_timeout)
        )
        self.deadline = deadline_in(self.limit)
        self.page: tuple[int, bytes] | None = None
        # Keeps the body only until it is sent; the caller's request object
        # lives as long as the leg, its body (the whole prompt) need not.
        self._exchange = worker.pool.request(b"POST", wreq.path, wreq.body, wreq.headers, head_deadline=self.deadline)
        wreq.body = b""

    def enter(self, phase: str, limit: float) -> float:
        """Start ``phase``, ``limit`` seconds from now; return its deadline."""
        self.phase, self.limit = phase, limit
        self.deadline = deadline_in(limit)
        return self.deadline

    def timeout_message(self) -> str:
        """What a client is told when the worker missed the running phase's deadline."""
        what = {
            "headers": "sent no response headers within",
            "first_token": "sent no token within",
            "inter_token": "sent no token for",
            "request": "did not answer within",
        }[self.phase]
        return f"worker {self.worker.id} {what} {self.limit:g} s"

    async def __aenter__(self) -> "Response":
        resp = await self._exchange.__aenter__()
        if self.stream:
            self.enter("first_token", self.first_token)
        if resp.status != 200:
            try:
                body = await resp.read(self.deadline)
            except BaseException as exc:
                await self._exchange.__aexit__(type(exc), exc, exc.__traceback__)
                raise
            self.attempt.live = False
            self.attempt.outcome = "error"
            self.page = (resp.status, body)
        return resp

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self._exchange.__aexit__(exc_type, exc, tb)
