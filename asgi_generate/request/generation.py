"""The attempt loop of one /generate request: which legs run, where, and
what happens when one fails.

:class:`Generation` asks the router for a plan (one aggregated worker, or a
prefill/decode pair) and has the plan's handshake
(:mod:`asgi_generate.request.handshakes`) run it: the handshake drives
this loop as its :class:`~asgi_generate.request.handshakes.LegRunner`,
whose client legs run on the leg runner (:mod:`asgi_generate.request.legs`)
and are concluded here (:meth:`Generation.conclude_leg`): failover (no
token reached the client yet), migration (a stream continues on another
worker as a ``resumed`` attempt) or the request's end with the format's
error. What the client sees is written by the loop's one
:class:`~asgi_generate.request.answer.AnswerWriter`; a request with items
runs with a :class:`~asgi_generate.request.batches.Batch`. Where the answer
goes on after a failure or a pause is the request's
:class:`~asgi_generate.request.state.Moves`.

Resuming after a pause (``resume_after_pause``, or the request's
:data:`RESUME_HEADER`): when a leg ends with the engine's abort after a
fleet transaction began (a pause in abort mode, or a weight call that aborts
running requests; :mod:`asgi_generate.workers.pauses`; a pause another
process or replica took is asked of the engine at that abort,
:meth:`~asgi_generate.workers.fleet_state.FleetState.confirm_pause`), the abort is not
the answer: the tokens it carried go out, the stream is held until the
fleet's resume (or the aborting call's answer), then continues as a
``resumed`` leg (prompt plus the tokens sent so far, the remaining budget)
on a worker at the fleet's weight version; a unary request sent nothing and
is replayed from scratch, none of the aborted leg's tokens counted. It counts as a migration in the record but not against
``migration_limit``. Past ``pause_hold_limit`` held streams or
``pause_hold_timeout`` seconds the request ends with 503, in-band after the
200.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio

from . import state
from .aborts import abort_live_legs
from .answer import AnswerWriter
from .budget import Lease
from ..sdk._codec import Codec, Event, Exchange, GenerateRequest, RequestError, WorkerRequest
from .framing import Send
from .handshakes import ClientLeg, handshake
from .legs import Leg, LegEnd
from ..tracing.state import LegRecord, RequestState
from ..exceptions import WorkerError
from ..workers.router import Worker

if TYPE_CHECKING:
    from .batches import Batch
    from .context import RequestContext

log = logging.getLogger(__name__)
#: Seconds a request waits before its k-th resumed or replayed attempt:
#: ``MIGRATION_BACKOFF_S * 2 ** (k - 1)``, at most ``MIGRATION_BACKOFF_MAX_S``
#: (50, 100, 200 ms for the default limit of 3). A crash-looping fleet thus
#: sees each request come back at most ``--migration-limit`` times, ever
#: more slowly, never in a tight loop.
MIGRATION_BACKOFF_S = 0.05
MIGRATION_BACKOFF_MAX_S = 1.0
#: The request header that turns resuming after a pause on (``1``) or off (``0``).
RESUME_HEADER = b"asgi-generate-resume-after-pause"


def migration_backoff(k: int) -> float:
    """Seconds to wait before a request's ``k``-th (1-based) resumed or
    replayed attempt."""
    return min(MIGRATION_BACKOFF_S * 2 ** (k - 1), MIGRATION_BACKOFF_MAX_S)


class Generation:
    """Drives one request's attempts; its :attr:`writer` writes the answer.

    Args:
        ctx: the process as the request sees it.
        codec: the request's format.
        codec_state: the codec's state of this request (its
            :class:`~asgi_generate.sdk.Exchange`).
        req: the decoded request.
        st: the request's state.
        send: the ASGI send.
        batch: for a request with items, its :class:`~asgi_generate.request.batches.Batch`.
        lease: the request's share of the body budget, given back once the
            first worker request is built (the body is decoded and checked then).
        scope: the cancel scope the request runs in (the writer cancels it
            when the client goes away or is cut off).
        reset: the server's reset of the client's connection, or ``None``
            (see :class:`~asgi_generate.request.answer.AnswerWriter`).
    """

    __slots__ = ("ctx", "codec", "codec_state", "req", "st", "writer", "batch", "lease", "tried", "unmoved",
                 "moves", "key", "outbox", "leg", "parking")

    def __init__(
        self, ctx: "RequestContext", codec: Codec, codec_state: Exchange, req: GenerateRequest, st: RequestState,
        send: Send, batch: "Batch | None" = None, lease: Lease | None = None,
        scope: anyio.CancelScope | None = None, reset: Callable[[], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.codec = codec
        self.codec_state = codec_state
        self.req = req
        self.st = st
        self.writer = AnswerWriter(ctx, codec, codec_state, req, st, send, batch, scope, reset)
        self.batch = batch
        self.lease = lease
        #: Workers this request failed on, never tried again for it.
        self.tried: list[Worker] = []
        #: Why the last failure was not migrated, for the client's error
        #: (:meth:`_failed`); ``None`` when nothing needs saying.
        self.unmoved: str | None = None
        wanted = st.headers.get(RESUME_HEADER, b"").strip().lower()
        opted = wanted in (b"1", b"true") or (ctx.settings.resume_after_pause and wanted not in (b"0", b"false"))
        #: Where the answer goes on after a failure or a pause.
        self.moves = state.Moves(st.request_id, 0 if opted else None)
        #: The request's routing key (:meth:`Router.routing_key`), once
        #: computed; every leg carries it, so the policy can weigh what
        #: the requests running on a worker hold there.
        self.key: Any = None
        #: The client bytes queued by :meth:`read_payload`: the writer's outbox.
        self.outbox = self.writer.outbox
        #: The leg running for this loop (set by :meth:`Leg.run`), ``None`` between legs.
        self.leg: Leg | None = None
        #: Admission's preemption handle when the stream may be preempted
        #: (:class:`~asgi_generate.request.gate.Parking`), else ``None``.
        self.parking: Any = None

    @property
    def pending(self) -> int:
        """Tokens of a unary answer counted but not sent yet."""
        return self.writer.pending

    @property
    def sent_ids(self) -> list[int] | None:
        """Every output token id sent so far (``None``: the request cannot resume)."""
        return self.writer.sent_ids

    def cancel_for_shutdown(self) -> None:
        """Stop this request because the server is shutting down; the
        handler then ends the answer cleanly and aborts the engine."""
        writer = self.writer
        writer.shutdown = True
        if writer.scope is not None:
            writer.scope.cancel()

    def run(self) -> Awaitable[None]:
        """Answer the request: its attempts, or its batch's legs (to await).
        Not a coroutine of its own: an open stream holds every frame of its
        await chain, and this one would only pick."""
        return self.run_attempts() if self.batch is None else self.batch.run(self)

    async def run_attempts(self) -> None:
        """Plan and run attempts until the request is answered (see the module docstring)."""
        router = self.ctx.router
        moves = self.moves
        tried = self.tried
        protocol = self.codec.worker_protocol
        key = self.key = router.routing_key(self.req, self.st.headers)  # the policy's, once per request
        need = len(self.req.items) if self.req.items else 1  # engine sequences: where room counts
        slot = False  # one of the process's migration slots, held to the answer's end
        try:
            while True:
                backoff = 0.0
                if moves.bounded and self.st.migrations + self.st.replays >= self.ctx.settings.migration_limit:
                    # Only a resumed leg that could not even connect gets here.
                    err = RequestError(502, self._failed(tried[-1], "could not be reached"), "engine")
                    await self.writer.fail(err, "engine_error")
                    return
                if moves.bounded:  # migration or replay: bounded, backing off
                    backoff = migration_backoff(self.st.migrations + self.st.replays + 1)
                    await anyio.sleep(backoff)
                    if not slot:
                        slot = await self._migration_slot()
                        if not slot:
                            return
                    # A resumed leg runs aggregated, else on a new pair.
                    worker = router.pick(protocol, tried, key=key, need=need)
                    plan = (worker,) if worker is not None else router.plan(protocol, tried, key, need)
                else:
                    plan = router.plan(protocol, tried, key, need)
                state.planned(moves)
                if moves.pause_epoch is not None:
                    moves.pause_epoch = router.pauses.mark(protocol)
                if plan is None and moves.continuing:
                    moved = self.st.migrations + self.st.replays
                    await self.writer.fail(RequestError(
                        502, f"no worker left to resume on after {moved} migration(s)", "worker_lost"
                    ), "engine_error")
                    return
                if plan is None:
                    await self.writer.fail(RequestError(503, router.unavailable(protocol, key), "unavailable"),
                                           "unavailable", headers=self.retry_after())
                    return
                role = state.next_role(moves, self.st, self.writer.sent_ids is not None)
                failed = await handshake(plan).run(self, plan, role, backoff)
                if type(failed) is ClientLeg:
                    # Run in this frame, not the handshake's (see ClientLeg).
                    worker, attempt, wreq = failed
                    leg = self._client_leg(worker, attempt, wreq, None)
                    failed = [worker] if await self.conclude_leg(leg, await leg.run(self, router)) else []
                if not failed and not moves.after_pause:
                    return
                # A leg given up (silent past the inter-token deadline, its pair
                # failed) is aborted now, not when the request ends: an engine
                # that misses a closed socket would keep generating for nobody.
                await self.abort_live_legs()
                tried += failed
        finally:
            if slot:
                self.ctx.migrations.give_back()

    def retry_after(self) -> list[tuple[bytes, bytes]]:
        """The ``Retry-After`` of the frontend's own 503 when no worker of
        the request's protocol can take it: the health probe interval
        (``--health-interval``, in whole seconds, at least 1), when a worker
        may be back in the rotation; none when the protocol has no worker
        configured (waiting does not help)."""
        if not self.ctx.router.has_protocol(self.codec.worker_protocol):
            return []
        return [(b"retry-after", b"%d" % max(1, math.ceil(self.ctx.settings.health_interval)))]

    async def _migration_slot(self) -> bool:
        """Take a migration slot (:mod:`asgi_generate.request.migrations`),
        waiting up to ``--migration-wait``; past it, end the answer with
        the format's error and return ``False``."""
        settings = self.ctx.settings
        slots = self.ctx.migrations
        if await slots.acquire(settings.migration_wait, self.st):
            return True
        await self.writer.fail(RequestError(
            503, f"no migration slot within {settings.migration_wait:g} s: {slots.active} streams already "
                 f"migrating (--max-concurrent-migrations {slots.limit()})", "unavailable"), "unavailable")
        return False

    def give_items(self, attempt: LegRecord) -> None:
        """Give ``attempt`` the request's items, if it has any (see
        :meth:`~asgi_generate.request.handshakes.LegRunner.give_items`)."""
        if self.batch is not None:
            self.batch.give_items(attempt, getattr(self.codec_state, "names_entries", False))

    async def worker_requests(self, *attempts: LegRecord) -> list[WorkerRequest] | None:
        """The codec's worker requests for ``attempts``, in order; ``None``
        once the codec refused one and the refusal was answered (nothing
        reached an engine). The body budget's share is given back either way."""
        admission = self.ctx.admission
        if admission is not None:  # the engines' priority for the request's class, if mapped
            fields = admission.engine_fields(self.st)
            for attempt in attempts:
                attempt.fields = fields
        try:
            return [self.codec_state.worker_request(attempt) for attempt in attempts]
        except RequestError as exc:
            await self.writer.refuse(exc)
            return None
        finally:
            self.release_body()

    def record_leg(self, attempt: LegRecord, wreq: WorkerRequest) -> None:
        """Count ``attempt`` among the request's legs (its record lists it)
        and, with OpenTelemetry export on, give the leg its span id and the
        engine its ``traceparent``."""
        self.st.attempts.append(attempt)
        if self.ctx.recorder.otel is not None:
            self.ctx.recorder.otel.stamp(self.st, attempt, wreq)

    def release_body(self) -> None:
        """Give the request's share of the body budget back (once its first
        worker request is built, the body is decoded and checked)."""
        if self.lease is not None:
            self.lease.release()

    async def run_client_leg(
        self, worker: Worker, attempt: LegRecord, wreq: WorkerRequest, gate: anyio.Event | None = None
    ) -> bool:
        """Run the leg of ``attempt`` on ``worker`` whose events make the
        client's answer (an aggregated, resumed, replayed or batch leg, or a
        P/D pair's decode leg, whose payloads wait for ``gate``), with this
        loop as its reader, and conclude it (:meth:`conclude_leg`): whether
        to try another worker."""
        leg = self._client_leg(worker, attempt, wreq, gate)
        return await self.conclude_leg(leg, await leg.run(self, self.ctx.router))

    def _client_leg(self, worker: Worker, attempt: LegRecord, wreq: WorkerRequest, gate: anyio.Event | None) -> Leg:
        """The leg runner of a client leg, with this loop as its reader."""
        settings = self.ctx.settings
        if not wreq.stream:
            # One unary worker answer carries no token timing: TTFT and ITL
            # stay unknown rather than equal to the total.
            self.writer.timed = False
        return Leg(self.st, settings, worker, attempt, wreq, settings.inter_token_timeout, gate, self.key)

    async def conclude_leg(self, leg: Leg, end: LegEnd) -> bool:
        """Failover, migration or the request's end, from how a client leg
        ended; whether to try another worker.

        A leg past its phase deadline is left live for the abort and its
        request ends with 504 (in-band after the 200); the worker is not
        marked down and nothing is retried, except that a stream silent past
        ``inter_token_timeout`` migrates.

        A stream whose worker is lost before anything reached the client
        fails over to the next worker, whether the broken connection or
        the health probe noticed first; no migration is counted.

        Migration (:meth:`_migrate`): a stream cut mid-answer by a worker
        that is gone (broken connection and failed probe, or lost by the
        health probe), silent between tokens, or answering 503 continues on
        another worker as a ``resumed`` attempt; a client disconnect, an
        engine's own error or abort finish never does. A leg whose worker
        closed the connection before answering (it may have the request)
        fails over or migrates as a lost worker's would, under a new engine
        id on another worker; with none left the request ends with 502.
        """
        st, attempt, worker, writer = self.st, leg.attempt, leg.worker, self.writer
        if self.moves.held:
            await self._hold_for_resume()
            return False
        if end is LegEnd.FINISHED:
            return False
        if end is LegEnd.CONNECT_FAILED:
            return True
        if end is LegEnd.ERROR_ANSWER:
            status, body, retry_after = leg.error_answer
            # A stream's 503 is the worker going away (an engine ends a
            # stream's own abort in-band); a unary 503 may be the engine's
            # abort of this request, its answer.
            if status == 503 and leg.stream:
                if not st.response_started and writer.pending == 0:
                    if self.ctx.router.can_plan(self.codec.worker_protocol, [*self.tried, worker]):
                        return True  # before any token: the next worker, as a failover
                elif self._migrate(attempt, f"answered {status}"):
                    return True
            await writer.answer_worker_error(status, body, retry_after)
            return False
        if end is LegEnd.TIMED_OUT:
            if leg.phase == "inter_token" and self._migrate(attempt, f"sent no token for {leg.limit:g} s"):
                state.end_leg(attempt, "timeout")  # still live: aborted before the next attempt (run_attempts)
                return True
            # Slow is not dead: the leg stays live so that it is aborted.
            await writer.fail(leg.error, "timeout")
            return False
        if end is LegEnd.WORKER_LOST or end is LegEnd.UNANSWERED or end is LegEnd.CANCELLED:
            if self.req.stream and not st.response_started and writer.pending == 0 and (
                    end is not LegEnd.UNANSWERED  # the worker is down: planning says if any other is up
                    or self.ctx.router.can_plan(self.codec.worker_protocol, [*self.tried, worker])):
                return True  # nothing reached the client: a plain failover, whichever noticed first
        if end is LegEnd.WORKER_LOST or end is LegEnd.UNANSWERED:
            if await self._held_finish(attempt) or self._migrate(attempt, f"failed: {leg.lost}"):
                return not st.response_complete
            await writer.fail(RequestError(502, self._failed(worker, f"failed: {leg.lost}"), "engine"),
                              "engine_error")
            return False
        if end is LegEnd.CANCELLED:
            if self._migrate(attempt, f"lost: {leg.lost}"):
                return True
            await writer.fail(RequestError(502, self._failed(worker, f"lost: {leg.lost}"), "worker_lost"),
                              "engine_error")
            return False
        await writer.fail(leg.error, "engine_error")  # an engine or protocol error
        return False

    async def fail(self, err: RequestError, status: str) -> None:
        """End the client's answer with ``err`` (see :meth:`AnswerWriter.fail`)."""
        await self.writer.fail(err, status)

    async def answer_worker_error(self, status: int, body: bytes, retry_after: bytes | None = None) -> None:
        """Answer the client with a worker's own error answer (see
        :meth:`AnswerWriter.answer_worker_error`)."""
        await self.writer.answer_worker_error(status, body, retry_after)

    async def abort_live_legs(self) -> None:
        """Abort every live leg of the request now (a failed P/D pair's,
        before another pair runs), shielded from cancellation."""
        with anyio.CancelScope(shield=True):
            await abort_live_legs(self.ctx, self.st)

    def _migrate(self, attempt: LegRecord, why: str) -> bool:
        """Whether the request, whose ``attempt`` (aggregated, resumed,
        replayed or a P/D decode leg) failed mid-answer for a migratable
        reason (``why``), continues on another worker: migration is on,
        the codec can resume the stream (or, unary, replay the request from
        scratch), another worker is up, and the request's
        ``migration_limit`` is not spent. (A P/D prefill leg fails over by
        :mod:`asgi_generate.request.handshakes`' rules.)"""
        st = self.st
        limit = self.ctx.settings.migration_limit
        if limit == 0 or attempt.role == "prefill":
            return False
        sent_ids = self.writer.sent_ids
        refusal = self.codec_state.resume_refusal() if sent_ids is not None else None
        if refusal is not None:
            st.not_migrated = refusal
            self.unmoved = f"not migrated: {refusal}"
            return False
        if st.response_started and sent_ids is None:
            return False  # a unary answer already went out
        if not self.ctx.router.can_plan(self.codec.worker_protocol, [*self.tried, attempt.worker]):
            self.unmoved = "migration impossible: no worker left to resume on"
            return False
        if st.migrations + st.replays >= limit:
            return False
        state.migrate(self.moves)
        if sent_ids is None:
            log.info("request %s: worker %s %s; replaying the unary request from scratch (attempt %d)",
                     st.request_id, attempt.worker_id, why, st.migrations + st.replays + 2)
        else:
            log.info("request %s: worker %s %s; resuming after %d tokens (migration %d)",
                     st.request_id, attempt.worker_id, why, len(sent_ids), st.migrations + 1)
        return True

    def _abort_without_pause(self, event: Event) -> bool:
        """Whether ``event`` is the engine's abort of a request that resumes
        after pauses while no pause began here since its plan."""
        epoch = self.moves.pause_epoch
        return epoch is not None and event.finish_reason == "abort" and event.error is None and \
            not self.ctx.router.pauses.aborted_since(self.codec.worker_protocol, epoch)

    def _paused_abort(self, attempt: LegRecord, event: Event) -> bool:
        """Whether ``event``, the engine's abort of ``attempt``, is a fleet
        transaction's to hold (module docstring): the request resumes after
        pauses, a pause or aborting call began since its plan or was open
        then (:meth:`~asgi_generate.workers.pauses.Pauses.aborted_since`),
        and the codec can resume the stream (or, unary with nothing sent,
        replay it)."""
        epoch = self.moves.pause_epoch
        if self.parking is not None and self.parking.preempting and event.finish_reason == "abort" \
                and event.error is None:  # admission's preemption: held the same way
            return self.writer.sent_ids is not None and self.codec_state.resume_refusal() is None
        if epoch is None or event.finish_reason != "abort" or event.error is not None:
            return False
        if not self.ctx.router.pauses.aborted_since(self.codec.worker_protocol, epoch):
            return False
        if self.writer.sent_ids is None:
            return not self.st.response_started and self.writer.pending == 0
        return self.codec_state.resume_refusal() is None

    async def _hold_for_resume(self) -> None:
        """Wait for the fleet's resume, then resume the stream; past the
        bound, end it with 503."""
        settings, protocol = self.ctx.settings, self.codec.worker_protocol
        if self.parking is not None and self.parking.preempting:
            parked = await self.parking.park()
            if parked is None:
                state.resume_after_preemption(self.moves, self.st)
                log.info("request %s: resuming after a preemption (%d tokens sent)", self.st.request_id,
                         len(self.writer.sent_ids or ()))
                return
            state.give_up_hold(self.moves)
            await self.writer.fail(RequestError(503, parked, "unavailable"), "unavailable")
            return
        why = await self.ctx.router.pauses.hold(protocol, settings.pause_hold_limit, settings.pause_hold_timeout)
        if why is None:
            state.resume_after_pause(self.moves, self.st)
            log.info("request %s: resuming after the pause of the %s fleet (%d tokens sent)", self.st.request_id,
                     protocol, len(self.writer.sent_ids or ()))
            return
        state.give_up_hold(self.moves)
        message = (f"held across a pause: {settings.pause_hold_limit} streams are held already (pause_hold_limit)"
                   if why == "full" else
                   f"held across a pause: the fleet did not resume within {settings.pause_hold_timeout:g} s "
                   f"(pause_hold_timeout)")
        await self.writer.fail(RequestError(503, message, "unavailable"), "unavailable")

    def _failed(self, worker: Worker, what: str) -> str:
        """The client's message for a worker failure that ends the request,
        saying why it did not move on: the migration limit was reached, no
        worker was left, or the request cannot resume (:meth:`_migrate`)."""
        limit = self.ctx.settings.migration_limit
        spent = self.st.migrations + self.st.replays >= limit > 0
        why = f"migration limit {limit} reached" if spent else self.unmoved
        return f"worker {worker.id} {what}" + (f" ({why})" if why else "")

    async def _held_finish(self, attempt: LegRecord) -> bool:
        """A stream cut after its finishing event (e.g. vLLM's finish reason
        held for a usage chunk that never came) is finished, not resumed."""
        event = self.codec_state.end_of_stream(attempt)
        if event is None or (event.error is None and event.finish_reason is None):
            return False
        await self.deliver_event(attempt, event)
        return True

    # -- the leg runner's reader (asgi_generate.request.legs.LegReader) ---------

    def answered(self, attempt: LegRecord) -> bool:
        """The client's answer is complete: nothing more is wanted of a leg."""
        return self.st.response_complete

    def read_payload(self, attempt: LegRecord, payload: bytes) -> Event | None:
        """The event of one worker payload, for :meth:`deliver_event`;
        ``None`` once a running stream's event was counted and queued (no
        await), or when the answer is complete (the payload is dropped).

        Raises:
            RequestError: the payload breaks the worker protocol.
        """
        if self.st.response_complete:
            return None
        event = self.codec_state.feed(attempt, payload)
        if self.writer.queue_without_await(event):
            if attempt.count(event):
                self.ctx.router.fleet.version_reported(attempt.worker)
            return None
        return event

    async def deliver_event(self, attempt: LegRecord, event: Event) -> None:
        """Count ``event`` on ``attempt`` (a finish or error ends the leg,
        with the usage its engine reported, unless the codec cut the answer
        short of the engine) and write it to the client; a pause's abort
        holds the stream instead (module docstring); a batch leg's event
        counts on its items (:meth:`Batch.end_items`)."""
        if self.batch is not None:
            if self.batch.end_items(attempt, event):
                await self.writer.deliver(event)
            return
        if self._abort_without_pause(event):
            # Another process or replica may have paused the fleet: ask the engine.
            await self.ctx.router.fleet.confirm_pause(attempt.worker, attempt.worker_info.get("weight_version"))
        if self._paused_abort(attempt, event):
            # Not the answer: a stream's tokens go out and it goes on after
            # the resume; a unary request sent nothing and starts over, so
            # none of this leg's tokens are the client's (DESIGN invariant 2).
            attempt.live = False
            state.end_leg(attempt, "aborted")
            attempt.usage = event.reported()
            state.hold_for_pause(self.moves)
            event.finish_reason, event.held = None, True
            if event.token_ids and self.writer.sent_ids is not None:
                attempt.count(event)
                await self.writer.deliver(event)
            return
        if attempt.count(event):
            self.ctx.router.fleet.version_reported(attempt.worker)
        if (event.error is not None or event.finish_reason is not None) and not event.cut:
            attempt.live = False
            state.end_leg(attempt, "finished" if event.error is None else "error")
            attempt.usage = event.reported()
        await self.writer.deliver(event)

    async def flush(self) -> None:
        """Write :attr:`outbox` (one worker read's events) to the client."""
        await self.writer.flush()

    async def cut_short(self, attempt: LegRecord) -> None:
        """The leg's answer ended unfinished: finish it with what the codec
        holds (:meth:`_held_finish`).

        Raises:
            WorkerError: the codec holds no finish.
        """
        if not self.moves.held and not await self._held_finish(attempt):
            raise WorkerError("worker ended the response without a finish reason")
