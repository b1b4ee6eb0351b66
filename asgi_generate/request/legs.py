"""The leg runner: one engine leg of a request, from its worker request to
how it ended, for every kind of leg (aggregated, resumed, replayed, a
batch's, a P/D pair's prefill and decode).

:meth:`Leg.run` sends the leg's worker request, holds it to its phase
deadlines (a streamed leg gets ``headers_timeout`` to its response head,
then ``first_token_timeout`` to its first event, then ``inter_token_timeout``
between events; a unary leg gets ``request_timeout`` in all; 0 = none),
reads its SSE (or its one unary body) into the codec's events for a
:class:`LegReader`, and returns how the leg ended as a :class:`LegEnd`. It
decides nothing: the attempt loop (:mod:`asgi_generate.request.generation`)
and the P/D handshakes (:mod:`asgi_generate.request.handshakes`) turn an end
into a failover, a migration, a failed pair or the request's error.
"""

from __future__ import annotations

import enum
import math
import time
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ..sdk._codec import RequestError
from . import state
from ..exceptions import ConnectFailed, TimedOut, Unanswered, WorkerError
from .framing import SSEDecoder

if TYPE_CHECKING:
    from ..config import Settings
    from ..sdk._codec import Event, WorkerRequest
    from ..workers.router import Router, Worker
    from ..tracing.state import LegRecord, RequestState

#: The SSE payload that ends an engine's stream (both engines send it).
DONE = b"[DONE]"


def deadline_in(limit: float) -> float:
    """The anyio clock time ``limit`` seconds from now; ``math.inf`` when
    ``limit`` is 0 (no deadline)."""
    return anyio.current_time() + limit if limit > 0 else math.inf


class LegEnd(enum.Enum):
    """How a leg ended, as :meth:`Leg.run` classifies it. The attempt's
    ``live`` and ``outcome`` are set as the row says; a leg left live is
    aborted by whoever gives it up."""

    #: Read to its end, every event handed to the reader; or the reader's
    #: answer was complete and only the rest of the leg failed (its drain).
    FINISHED = "finished"
    #: The worker answered a status other than 200 before any event:
    #: :attr:`Leg.error_answer` holds it, ``(status, body, retry-after)``
    #: (not live, outcome ``error``).
    ERROR_ANSWER = "error_answer"
    #: No connection could be opened: the worker was marked down (not live,
    #: outcome ``connect_failed``).
    CONNECT_FAILED = "connect_failed"
    #: The running phase's deadline passed (:attr:`Leg.phase`,
    #: :attr:`Leg.limit`); :attr:`Leg.error` is the client's 504. Slow is
    #: not dead: the leg stays live and its worker up.
    TIMED_OUT = "timed_out"
    #: The connection broke and the worker's probe says it is up: the break
    #: was the engine's answer to this request (outcome ``error``);
    #: :attr:`Leg.error` is the client's 502.
    ENGINE_ERROR = "engine_error"
    #: The connection broke and the worker's probe failed (outcome
    #: ``worker_lost``); :attr:`Leg.lost` says how it broke.
    WORKER_LOST = "worker_lost"
    #: The connection closed before the response head and the worker's
    #: probe says it is up (a keep-alive it closed as the request went out):
    #: it may have the request, which is never sent to it again; the leg
    #: stays live so that it is aborted (outcome ``error``).
    #: :attr:`Leg.lost` says how it closed.
    UNANSWERED = "unanswered"
    #: The worker broke its protocol (the codec raised: a
    #: :class:`~asgi_generate.sdk.WorkerAnswerError` for an answer it
    #: cannot read, else one it cannot join); :attr:`Leg.error` is the
    #: codec's error (outcome ``error``). The connection is closed, never
    #: reused: what follows on it is unknown.
    PROTOCOL_ERROR = "protocol_error"
    #: Cancelled because the health probe gave the worker up (outcome
    #: ``worker_lost``); :attr:`Leg.lost` is the probe's reason.
    CANCELLED = "cancelled"


class LegReader(Protocol):
    """What a leg's events go to: the client's answer (a request's
    :class:`~asgi_generate.request.generation.Generation`) or a P/D prefill
    leg's keeper (:mod:`asgi_generate.request.handshakes`)."""

    #: Client bytes :meth:`read_payload` queued, sent by :meth:`flush` after each read.
    outbox: list
    #: The leg running for this reader (set by :meth:`Leg.run`), ``None`` between legs.
    leg: "Leg | None"

    def answered(self, attempt: "LegRecord") -> bool:
        """Nothing more is wanted from ``attempt``'s leg."""

    def read_payload(self, attempt: "LegRecord", payload: bytes) -> "Event | None":
        """The event of one worker payload for :meth:`deliver_event`;
        ``None`` once it was queued with no await, or when :meth:`answered`
        (the payload is dropped).

        Raises:
            RequestError: the payload breaks the worker protocol.
        """

    async def deliver_event(self, attempt: "LegRecord", event: "Event") -> None:
        """Account for ``event`` and deliver it."""

    async def flush(self) -> None:
        """Send :attr:`outbox`."""

    async def cut_short(self, attempt: "LegRecord") -> None:
        """The leg's answer ended before :meth:`answered`: finish it from
        what the codec holds, else raise :class:`WorkerError`."""


class Leg:
    """One engine leg: ``await Leg(...).run(reader, router)``.

    Args:
        st: the request's state (its dispatch time is stamped at the first leg).
        settings: the phase deadlines' source.
        worker: where the leg runs; the leg is in its in-flight set while
            it runs, so its health probe can give it up (:meth:`worker_lost`).
        attempt: the leg's attempt, made live here.
        wreq: its worker request; the body is handed to the worker's
            connection pool and emptied (a stream does not hold its prompt).
        between: seconds allowed between a stream's events once they flow
            (``inter_token_timeout``); ``None`` keeps the first-token
            deadline for the whole leg (a prefill leg, whose one event is
            its answer).
        gate: an event the leg's first payload waits for before the codec
            reads it (a P/D decode leg whose answer joins its prefill
            leg's), or ``None``.
        route_key: the request's routing key
            (:meth:`~asgi_generate.workers.router.Router.routing_key`), or
            ``None``: the policy reads it from the worker's in-flight set
            to weigh what the requests running there hold
            (:class:`~asgi_generate.workers.router.InFlight`).

    After :meth:`run`: :attr:`phase` and :attr:`limit` are the phase that
    ran last (``headers``, ``first_token``, ``inter_token`` or ``request``),
    and :attr:`error_answer`, :attr:`error` and :attr:`lost` say what :class:`LegEnd`
    lists.
    """

    __slots__ = (
        "worker", "attempt", "stream", "first_token", "between", "gate", "phase", "limit", "deadline",
        "scope", "error_answer", "error", "lost", "delivering", "reader", "route_key", "_pooled_request",
    )

    def __init__(
        self, st: "RequestState", settings: "Settings", worker: "Worker", attempt: "LegRecord", wreq: "WorkerRequest",
        between: float | None = None, gate: anyio.Event | None = None, route_key: Any = None,
    ) -> None:
        if st.t_dispatched is None:
            st.t_dispatched = time.monotonic()
        attempt.live = True
        self.worker, self.attempt, self.stream = worker, attempt, wreq.stream
        self.first_token = settings.first_token_timeout
        self.between, self.gate = between, gate
        self.phase, self.limit = (
            ("headers", settings.headers_timeout) if wreq.stream else ("request", settings.request_timeout)
        )
        self.deadline = deadline_in(self.limit)
        self.scope = anyio.CancelScope()
        self.error_answer: tuple[int, bytes, bytes | None] | None = None
        self.error: RequestError | None = None
        self.lost: str | None = None
        #: The leg's own task is handing events to its reader (a client
        #: write may be under way): a lost worker cancels it after that.
        self.delivering = False
        self.reader: LegReader | None = None
        self.route_key = route_key
        # Keeps the body only until it is sent; the caller's request object
        # lives as long as the leg, its body (the whole prompt) need not.
        self._pooled_request = worker.pool.request(
            b"POST", wreq.path, wreq.body, wreq.headers, head_deadline=self.deadline)
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

    def worker_lost(self, worker: "Worker", reason: str) -> None:
        """The health probe gave ``worker`` up (see
        :meth:`asgi_generate.workers.router.InFlight.worker_lost`): cancel
        the leg at once, or, with a client write under way, once that write
        and the rest of its worker read reached the client (:meth:`run`: a
        cancelled write would lose tokens the request counts as sent); not
        once its reader wants nothing more from it. (The leg is in the
        worker's in-flight set only while :meth:`run` runs it.)"""
        reader = self.reader
        if self.lost is not None or reader.answered(self.attempt):
            return
        self.lost = reason
        if not self.delivering:
            self.scope.cancel()

    async def run(self, reader: LegReader, router: "Router") -> LegEnd:
        """Run the leg to its end, its events to ``reader``; how it ended.

        A broken connection is judged by the worker's own probe on
        ``router`` (it may be this request's doing: SGLang drops a stream
        whose generator raised), so no client can empty the rotation; a
        connect failure marks the worker down at once.

        Raises:
            What ``reader`` raises other than :class:`RequestError`, and
            cancellation from outside the leg.
        """
        # One frame from the request down to the worker read: an open
        # stream holds every coroutine of its await chain.
        attempt, worker = self.attempt, self.worker
        self.reader = reader
        reader.leg = self
        worker.inflight.add(self)
        try:
            with self.scope:
                resp = await self._pooled_request.__aenter__()
                try:
                    if self.stream:
                        self.enter("first_token", self.first_token)
                    if resp.status != 200:
                        body = await resp.read(self.deadline)
                        attempt.live = False
                        state.end_leg(attempt, "error")
                        self.error_answer = (resp.status, body, resp.retry_after)
                    else:
                        gate = self.gate
                        if not self.stream:
                            payload = await resp.read(self.deadline)
                            if gate is not None:
                                await gate.wait()
                            if (event := reader.read_payload(attempt, payload)) is not None:
                                self.delivering = True
                                await reader.deliver_event(attempt, event)
                                self.delivering = False
                        else:
                            decoder = SSEDecoder()
                            between = self.between
                            deadline = self.deadline
                            while (data := await resp.read_some(deadline)) is not None:
                                payloads = decoder.feed(data)
                                # Nothing of this read is held while the next one waits.
                                data = None
                                if not payloads:  # only comments or part of an event
                                    continue
                                if between is not None:
                                    deadline = self.enter("inter_token", between)
                                for payload in payloads:
                                    if payload != DONE:
                                        if gate is not None:  # the first payload waits for the prefill's answer
                                            if reader.answered(attempt):
                                                continue
                                            await gate.wait()
                                            gate = None
                                        if (event := reader.read_payload(attempt, payload)) is not None:
                                            self.delivering = True
                                            await reader.deliver_event(attempt, event)  # else queued with no await
                                            self.delivering = False
                                payloads = payload = event = None
                                if reader.outbox:
                                    self.delivering = True
                                    await reader.flush()
                                    self.delivering = False
                                if attempt.live and reader.answered(attempt):
                                    break  # the reader ended the answer (a stop string across a seam)
                                if self.lost is not None:  # given up while this read was delivered
                                    self.scope.cancel()
                        if not reader.answered(attempt):
                            self.delivering = True
                            await reader.cut_short(attempt)
                except BaseException as exc:
                    await self._pooled_request.__aexit__(type(exc), exc, exc.__traceback__)
                    raise
                await self._pooled_request.__aexit__(None, None, None)
                return LegEnd.FINISHED if self.error_answer is None else LegEnd.ERROR_ANSWER
        except (WorkerError, TimedOut, RequestError) as exc:
            return await self._failed(exc, reader, router)
        finally:
            reader.leg = None
            worker.inflight.discard(self)
            if attempt.span_id:
                attempt.t_ended = time.monotonic()
        # Only a cancelled leg gets here: the health probe gave the worker up.
        state.end_leg(attempt, "worker_lost")
        return LegEnd.CANCELLED

    async def _failed(self, exc: Exception, reader: LegReader, router: "Router") -> LegEnd:
        """Classify the exception a leg ended with (see :class:`LegEnd`)."""
        attempt, worker = self.attempt, self.worker
        if isinstance(exc, ConnectFailed):
            attempt.live = False
            state.end_leg(attempt, "connect_failed")
            router.mark_down(worker, str(exc))
            return LegEnd.CONNECT_FAILED
        if isinstance(exc, RequestError):
            state.end_leg(attempt, "error")
            self.error = exc
            return LegEnd.PROTOCOL_ERROR
        if reader.answered(attempt):  # only the drain after the answer was slow or failed
            return LegEnd.FINISHED
        if isinstance(exc, TimedOut):
            self.error = RequestError(504, self.timeout_message(), "timeout")
            return LegEnd.TIMED_OUT
        if await router.probe(worker):
            state.end_leg(attempt, "error")
            if isinstance(exc, Unanswered):
                self.lost = str(exc)
                return LegEnd.UNANSWERED
            self.error = RequestError(502, f"worker {worker.id} broke the connection mid-answer: {exc}", "engine")
            return LegEnd.ENGINE_ERROR
        state.end_leg(attempt, "worker_lost")
        self.lost = str(exc)
        return LegEnd.WORKER_LOST
