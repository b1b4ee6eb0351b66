"""The attempt loop of one /generate request: which legs run, where, and
what happens when one fails.

:class:`Generation` asks the router for a plan (one aggregated worker, or a
prefill/decode pair run by :mod:`asgi_generate.request.pd`), runs each engine leg
under its phase deadlines, and on a failure decides between failover (no
token reached the client yet), migration (a stream continues on another
worker as a ``resumed`` attempt) and ending the request with the format's
error. What the client sees is written by :class:`ClientStream`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import anyio

from ..sdk import ids
from .accounting import RequestState
from .budget import Lease
from .client_stream import ClientStream, send_in_band_error
from ..sdk.codec import Attempt, Codec, Event, Exchange, GenerateRequest, RequestError, WorkerRequest
from .framing import Send, SSEDecoder
from .legs import Leg
from .pd import run_pair
from ..workers.http import ConnectFailed, TimedOut, WorkerError
from ..workers.router import Worker

if TYPE_CHECKING:
    from .context import RequestContext

log = logging.getLogger("asgi_generate.request.handler")
DONE = b"[DONE]"
#: Seconds a request waits before its k-th resumed or replayed attempt:
#: ``MIGRATION_BACKOFF_S * 2 ** (k - 1)``, at most ``MIGRATION_BACKOFF_MAX_S``
#: (50, 100, 200 ms for the default limit of 3). A crash-looping fleet thus
#: sees each request come back at most ``--migration-limit`` times, ever
#: more slowly, never in a tight loop.
MIGRATION_BACKOFF_S = 0.05
MIGRATION_BACKOFF_MAX_S = 1.0


def migration_backoff(k: int) -> float:
    """Seconds to wait before a request's ``k``-th (1-based) resumed or
    replayed attempt."""
    return min(MIGRATION_BACKOFF_S * 2 ** (k - 1), MIGRATION_BACKOFF_MAX_S)


class Generation(ClientStream):
    """Drives one request's attempts; its answer is written by the base."""

    __slots__ = ("prefill_gate", "lease", "resuming", "tried")

    def __init__(
        self, ctx: "RequestContext", codec: Codec, ex: Exchange, req: GenerateRequest, st: RequestState, send: Send
    ) -> None:
        super().__init__(ctx, codec, ex, req, st, send)
        #: P/D: set once the prefill leg answered, when the decode leg's
        #: first event needs that answer (see :mod:`asgi_generate.request.pd`).
        self.prefill_gate: anyio.Event | None = None
        #: The request's share of the body budget, given back once the first
        #: worker request is built (the body is decoded and checked then).
        self.lease: Lease | None = None
        #: The last attempt failed mid-answer and the request migrates.
        self.resuming = False
        #: Workers this request failed on, never tried again for it.
        self.tried: list[Worker] = []

    def worker_lost(self, worker: Worker, reason: str) -> None:
        """The router's health probe gave ``worker`` up: stop waiting for it.

        The leg is cancelled at once, or right after the client write under
        way (a write is never cut in two); :meth:`_attempt` then resumes
        the stream on another worker (migration) or ends the request.
        """
        if self.lost is not None or self.st.response_complete or self.st.attempts[-1].worker is not worker:
            return
        self.lost = reason
        if not self.in_send and self.leg is not None:
            self.leg.cancel()

    def cancel_for_shutdown(self) -> None:
        """Stop this request because the server is shutting down; the
        handler then ends the answer cleanly and aborts the engine."""
        self.shutdown = True
        if self.scope is not None:
            self.scope.cancel()

    async def run(self) -> None:
        router = self.ctx.router
        tried = self.tried
        protocol = self.codec.worker_protocol
        key = router.routing_key(self.req, self.st.headers)  # the policy's, once per request
        while True:
            backoff = 0.0
            if self.resuming and self.st.migrations + self.st.replays >= self.ctx.settings.migration_limit:
                # Only a resumed leg that could not even connect gets here.
                await self.fail(RequestError(502, self._failed(tried[-1], "could not be reached"), "engine"),
                                "engine_error")
                return
            if self.resuming:  # migration or replay: bounded, backing off
                backoff = migration_backoff(self.st.migrations + self.st.replays + 1)
                await anyio.sleep(backoff)
                # A resumed leg runs aggregated, else on a new pair.
                worker = router.pick(protocol, tried, key=key)
                plan = (worker,) if worker is not None else router.plan(protocol, tried, key)
            else:
                plan = router.plan(protocol, tried, key)
            if plan is None and self.resuming:
                moved = self.st.migrations + self.st.replays
                await self.fail(RequestError(
                    502, f"no worker left to resume on after {moved} migration(s)", "worker_lost"
                ), "engine_error")
                return
            if plan is None:
                why = "no healthy worker" if router.has_protocol(protocol) else "no worker configured"
                await self.fail(
                    RequestError(503, f"{why} for protocol {protocol!r}", "unavailable"), "unavailable"
                )
                return
            if len(plan) == 2:  # a prefill/decode pair
                failed = await run_pair(self, *plan, self._next_role(), backoff)
                if not failed:
                    return
                tried += failed
                continue
            worker = plan[0]
            attempt = Attempt(ids.mint(), self._next_role(), worker.id, worker.info, worker)
            attempt.backoff_ms = round(backoff * 1000)
            if attempt.role == "resumed":  # continue where the client's answer stands
                attempt.resumes = list(self.sent_ids)
            try:
                wreq = self.ex.worker_request(attempt)
            except RequestError as exc:  # nothing was sent to any engine
                await self.refuse(exc)
                return
            finally:
                self.release_body()
            self.st.attempts.append(attempt)
            if self.ctx.recorder.otel is not None:
                self.stamp(attempt, wreq)
            self.lost = None
            worker.inflight.add(self)
            try:
                retry = await self._attempt(worker, attempt, wreq)
            finally:
                worker.inflight.discard(self)
            if not retry:
                return
            tried.append(worker)

    def stamp(self, attempt: Attempt, wreq: WorkerRequest) -> None:
        """With OpenTelemetry export on, give the leg its span id and the
        engine its ``traceparent`` (off: nothing)."""
        if self.ctx.recorder.otel is not None:
            self.ctx.recorder.otel.stamp(self.st, attempt, wreq)

    def _next_role(self) -> str:
        """The next attempt's role, counting it: ``resumed`` (a stream
        continues), ``replayed`` (a unary request starts over), else
        ``aggregated``."""
        if not self.resuming:
            return "aggregated"
        if self.sent_ids is None:
            self.st.replays += 1
            return "replayed"
        self.st.migrations += 1
        return "resumed"

    def release_body(self) -> None:
        """Give the request's share of the body budget back (once its first
        worker request is built, the body is decoded and checked)."""
        if self.lease is not None:
            self.lease.release()

    async def refuse(self, exc: RequestError) -> None:
        """Answer a request the codec refused while building a worker
        request (nothing reached an engine), in-band if the format says so."""
        # Nothing to replay; and a prompt too long for the model may be
        # millions of ids, which the record must not keep alive.
        self.st.input_ids = None
        self.st.replay_excluded = "rejected"
        if exc.in_band and not self.st.response_started:
            await send_in_band_error(self.codec, self._write, self.st, exc)
        else:
            await self.fail(exc, "rejected")

    async def _attempt(self, worker: Worker, attempt: Attempt, wreq: WorkerRequest) -> bool:
        """Run one attempt; return whether to try another worker.

        Phase deadlines (each 0 = none): a streamed leg gets
        ``headers_timeout`` to its response head, ``first_token_timeout``
        to its first SSE event, then ``inter_token_timeout`` between events
        (comments do not count); a unary leg, silent until its answer is
        whole, gets ``request_timeout`` in all. A leg past its deadline is
        left live for the abort and its request ends with 504 (in-band
        after the 200); the worker is not marked down and nothing is retried,
        except that a stream silent past ``inter_token_timeout`` migrates.

        Migration (:meth:`_migrate`): a stream cut mid-answer by a worker
        that is gone (broken connection and failed probe, or lost by the
        health probe), silent between tokens, or answering 503 continues on
        another worker as a ``resumed`` attempt; a client disconnect, an
        engine's own error or abort finish never does.
        """
        st, ex, settings = self.st, self.ex, self.ctx.settings
        leg = Leg(st, settings, worker, attempt, wreq)
        try:
            with anyio.CancelScope() as self.leg:
                if self.lost is not None:  # lost before the leg began
                    self.leg.cancel()
                async with leg as resp:
                    if leg.page is not None:
                        status, body = leg.page
                        # A stream's 503 is the worker going away (an engine ends a
                        # stream's own abort in-band); a unary 503 may be the
                        # engine's abort of this request, its answer.
                        if status == 503 and wreq.stream:
                            if not st.response_started and self.pending == 0:
                                if self.ctx.router.can_plan(self.codec.worker_protocol, [*self.tried, worker]):
                                    return True  # before any token: the next worker, as a failover
                            elif self._migrate(attempt, f"answered {status}"):
                                return True
                        status, body = ex.worker_error(status, body)
                        st.fail(
                            "engine_error" if status >= 500 else "rejected",
                            status,
                            "engine",
                            body[:512].decode("utf-8", "replace"),
                        )
                        await self._unary(status, body)
                        return False
                    if not wreq.stream:
                        await self._feed_whole(attempt, await resp.read(leg.deadline))
                    else:
                        decoder = SSEDecoder()
                        between = settings.inter_token_timeout
                        deadline = leg.deadline
                        while (data := await resp.read_some(deadline)) is not None:
                            payloads = decoder.feed(data)
                            # Nothing of this read is held while the next one waits.
                            data = None
                            if not payloads:  # only comments or part of an event
                                continue
                            deadline = leg.enter("inter_token", between)
                            for payload in payloads:
                                if not st.response_complete and payload != DONE:
                                    if self.prefill_gate is not None:  # P/D: after the prefill's answer
                                        await self._feed(attempt, payload)
                                    elif (event := self._take(attempt, payload)) is not None:
                                        await self._settle(attempt, event)  # else taken with no await
                            payloads = payload = event = None
                            if self.outbox:
                                await self._flush()
                            if attempt.live and st.response_complete:
                                break  # the frontend ended the answer (a stop string across a seam)
                    if not st.response_complete:
                        event = ex.end_of_stream(attempt)
                        if event is None or (event.error is None and event.finish_reason is None):
                            raise WorkerError("worker ended the response without a finish reason")
                        await self._settle(attempt, event)
                    return False
        except ConnectFailed as exc:
            attempt.live = False
            attempt.outcome = "connect_failed"
            self.ctx.router.mark_down(worker, str(exc))
            return True
        except TimedOut:
            if st.response_complete:  # only the drain after the answer was slow
                return False
            if leg.phase == "inter_token" and self._migrate(attempt, f"sent no token for {leg.limit:g} s"):
                attempt.outcome = "timeout"  # still live: aborted when the request ends
                return True
            # Slow is not dead: the leg stays live so that it is aborted.
            await self.fail(RequestError(504, leg.timeout_message(), "timeout"), "timeout")
            return False
        except WorkerError as exc:
            if self.st.response_complete:  # only the drain after the answer failed
                return False
            # A broken connection may be this request's doing (SGLang drops
            # a stream whose generator raised): ask the worker itself before
            # taking it out, so no client can empty the rotation.
            if await self.ctx.router.probe(worker):
                attempt.outcome = "error"
                await self.fail(
                    RequestError(502, f"worker {worker.id} broke the connection mid-answer: {exc}", "engine"),
                    "engine_error",
                )
                return False
            attempt.outcome = "worker_lost"
            if self.req.stream and not self.st.response_started and self.pending == 0:
                return True  # nothing reached the client: a plain failover
            if await self._held_finish(attempt) or self._migrate(attempt, str(exc)):
                return not st.response_complete
            await self.fail(RequestError(502, self._failed(worker, f"failed: {exc}"), "engine"), "engine_error")
            return False
        except RequestError as exc:  # the worker broke its protocol
            attempt.outcome = "error"
            await self.fail(exc, "engine_error")
            return False
        finally:
            self.leg = None
            if attempt.span_id:
                attempt.t_ended = time.monotonic()
        # Only a cancelled leg gets here: the health probe gave the worker up.
        # Its record is written at once: a lost worker's leg gets no abort.
        attempt.outcome = "worker_lost"
        if self._migrate(attempt, f"lost: {self.lost}"):
            return True
        await self.fail(RequestError(502, self._failed(worker, f"lost: {self.lost}"), "worker_lost"), "engine_error")
        return False

    def _migrate(self, attempt: Attempt, why: str) -> bool:
        """Whether the request, whose ``attempt`` (aggregated, resumed,
        replayed or a P/D decode leg) failed mid-answer for a migratable
        reason (``why``), continues on another worker: migration is on,
        the codec can resume the stream (or, unary, replay the request from
        scratch), another worker is up, and the request's
        ``migration_limit`` is not spent. (A P/D prefill leg fails over by
        :mod:`asgi_generate.request.pd`'s rules.)"""
        st = self.st
        limit = self.ctx.settings.migration_limit
        if limit == 0 or attempt.role == "prefill":
            return False
        refusal = self.ex.resume_refusal() if self.sent_ids is not None else None
        if refusal is not None:
            st.not_migrated = refusal
            return False
        if st.response_started and self.sent_ids is None:
            return False  # a unary answer already went out
        if not self.ctx.router.can_plan(self.codec.worker_protocol, [*self.tried, attempt.worker]):
            return False  # nowhere to go: the failure itself is the answer
        if st.migrations + st.replays >= limit:
            return False
        self.resuming = True
        if self.sent_ids is None:
            log.info("request %s: worker %s %s; replaying the unary request from scratch (attempt %d)",
                     st.request_id, attempt.worker_id, why, st.migrations + st.replays + 2)
        else:
            log.info("request %s: worker %s %s; resuming after %d tokens (migration %d)",
                     st.request_id, attempt.worker_id, why, len(self.sent_ids), st.migrations + 1)
        return True

    def _failed(self, worker: Worker, what: str) -> str:
        """The client's message for a worker failure that ends the request,
        saying so when the migration limit was what ended it."""
        limit = self.ctx.settings.migration_limit
        spent = self.st.migrations + self.st.replays >= limit > 0
        return f"worker {worker.id} {what}" + (f" (migration limit {limit} reached)" if spent else "")

    async def _held_finish(self, attempt: Attempt) -> bool:
        """A stream cut after its finishing event (e.g. vLLM's finish reason
        held for a usage chunk that never came) is finished, not resumed."""
        event = self.ex.end_of_stream(attempt)
        if event is None or (event.error is None and event.finish_reason is None):
            return False
        await self._settle(attempt, event)
        return True

    async def _feed(self, attempt: Attempt, payload: bytes) -> None:
        if self.prefill_gate is not None and attempt.role == "decode":
            await self.prefill_gate.wait()
        if (event := self._take(attempt, payload)) is not None:
            await self._settle(attempt, event)

    def _take(self, attempt: Attempt, payload: bytes) -> Event | None:
        """The event of one worker payload, for :meth:`_settle`; ``None``
        once a running stream's event was counted and queued (no await)."""
        event = self.ex.feed(attempt, payload)
        if self._queued(event):
            attempt.tokens += len(event.token_ids)
            return None
        return event

    async def _feed_whole(self, attempt: Attempt, body: bytes) -> None:
        # One unary worker answer carries no token timing: TTFT and ITL
        # stay unknown rather than equal to the total.
        self.timed = False
        await self._feed(attempt, body)

    async def _settle(self, attempt: Attempt, event: Event) -> None:
        attempt.tokens += len(event.token_ids)
        if (event.error is not None or event.finish_reason is not None) and not event.cut:
            attempt.live = False
            attempt.outcome = "finished" if event.error is None else "error"
        await self._deliver(event)

