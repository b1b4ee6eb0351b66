"""The shared /generate handler: one anyio task group per request.

For every registered format::

    reserve room in the body budget (bounded wait, else 503)
    read body (size-capped, within the body-read deadline) -> codec.decode
        (large bodies in a worker thread) -> GenerateRequest
    pick a worker -> attempt -> stream worker events -> codec -> client
    watch receive() for http.disconnect the whole time
    finally (shielded): abort every live engine leg, await its ack,
                        hand the finished RequestState to the trace sink

The handler owns framing: unary answers carry ``content-length``; SSE answers
are ``text/event-stream`` events ending with the format's terminal marker,
with ``:`` keep-alive comments while the engine is silent. The 200 of an SSE
answer goes out with the first event (or the first keep-alive), so errors
before it keep their real status; errors after it travel in-band.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import anyio

from . import ids
from .accounting import RequestState
from .budget import Lease
from .codec import Attempt, Codec, Event, Exchange, GenerateRequest, RequestError, WorkerRequest
from .deadlines import deadline_in, opening_phase
from .framing import (
    KEEPALIVE,
    SSE_HEADERS,
    BodyTimeout,
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Send,
    SSEDecoder,
    read_body,
    send_unary,
    sse_event,
)
from .pd import run_pair
from .workers.aborts import ACKED, LOST
from .workers.http import ConnectFailed, TimedOut, WorkerError
from .workers.router import Worker

if TYPE_CHECKING:
    from .app import App

log = logging.getLogger("asgi_generate.handler")
DONE = b"[DONE]"
#: Bodies from this size on are decoded in a worker thread (1 MiB: about
#: 10 ms of parsing; smaller ones cost less than the thread hop).
DECODE_THREAD_BYTES = 1 << 20
#: Sent with every answer given before the body was read: the unread body
#: makes the connection unusable for another request.
CLOSE = [(b"connection", b"close")]
RETRY_AFTER = b"1"


async def handle_generate(app: "App", codec: Codec, scope: dict, receive: Receive, send: Send) -> None:
    """Serve one request on a codec's route; always leaves one RequestState."""
    st = RequestState(ids.mint(), codec.name, scope["path"], scope["method"])
    try:
        await _serve(app, codec, scope, receive, send, st)
    except OSError:  # an error answer's write: the client is gone (ASGI send exception)
        st.status = "client_disconnect"
    except Exception as exc:  # a bug: answer 500 rather than drop the client
        log.exception("request %s failed", st.request_id)
        st.fail("engine_error", 500, "internal", repr(exc))
        if not st.response_started:
            with anyio.CancelScope(shield=True):
                await _send_error(codec, send, st, RequestError(500, "internal error", "internal"))
    finally:
        with anyio.CancelScope(shield=True):
            await abort_live_legs(app, st)
        if st.status is None:  # cancelled from outside, e.g. server shutdown
            st.status = "shutdown"
        finish_record(app, st)
        app.body_budget.trim_if_idle()  # the request's body and objects are gone now


def finish_record(app: "App", st: RequestState) -> None:
    """Hand ``st`` to the app exactly once per request."""
    if st.t_done is None:
        st.t_done = time.monotonic()
        app.request_finished(st)


async def reject_method(app: "App", codec: Codec, scope: dict, allowed: list[str], send: Send) -> None:
    """405 on a registered path with the wrong method, in the format's shape."""
    st = RequestState(ids.mint(), codec.name, scope["path"], scope["method"])
    st.headers = dict(scope["headers"])
    err = RequestError(405, "Method Not Allowed", "method_not_allowed")
    try:
        await _send_error(codec, send, st, err, [(b"allow", ", ".join(allowed).encode())])
    except OSError:  # the client is gone (ASGI send exception)
        st.status = "client_disconnect"
    finally:
        finish_record(app, st)


async def _send_error(
    codec: Codec, send: Send, st: RequestState, err: RequestError, headers: list | None = None
) -> None:
    outcome = "shutdown" if err.kind == "shutdown" else "unavailable" if err.status == 503 else "rejected"
    st.fail(outcome, err.status, err.kind, err.message)
    st.response_started = True
    st.response_complete = True
    await send_unary(send, err.status, codec.error_body(err), headers=headers or ())


async def _send_in_band_error(codec: Codec, send: Send, st: RequestState, err: RequestError) -> None:
    """A refused streamed request, answered as the format's engine answers
    it: 200, then the in-band error event and the terminal marker."""
    st.stream = True
    st.fail("rejected", 200, err.kind, err.message)
    st.response_started = True
    st.response_complete = True
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    body = sse_event(codec.in_band_error(err)) + codec.sse_terminal
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _serve(app: "App", codec: Codec, scope: dict, receive: Receive, send: Send, st: RequestState) -> None:
    headers = dict(scope["headers"])
    st.headers = headers
    settings = app.settings
    try:
        declared = headers.get(b"content-length")
        length = int(declared) if declared is not None else None
    except ValueError:
        await _send_error(codec, send, st, RequestError(400, "invalid content-length header"), CLOSE)
        return
    if length is not None and length > settings.max_body_bytes:
        # Refused before the first receive(), unread: the connection cannot
        # be reused, so say it closes.
        err = RequestError(413, str(BodyTooLarge(settings.max_body_bytes)), "too_large")
        await _send_error(codec, send, st, err, CLOSE)
        return
    lease = await app.body_budget.reserve(
        settings.max_body_bytes if length is None else length, settings.body_budget_wait
    )
    if lease is None:
        err = RequestError(503, "too many request bodies in flight; retry later", "busy")
        await _send_error(codec, send, st, err, [(b"retry-after", RETRY_AFTER), *CLOSE])
        return
    try:
        request = await _read_and_decode(app, codec, receive, send, st, headers, length)
        if request is not None:
            await _generate(app, codec, request, receive, send, st, lease)
    finally:
        lease.release()


async def _read_and_decode(
    app: "App", codec: Codec, receive: Receive, send: Send, st: RequestState, headers: dict, length: int | None
) -> GenerateRequest | None:
    """The decoded request, or ``None`` once the client was answered (or left)."""
    settings = app.settings
    app.reading_body += 1
    try:
        body = await read_body(receive, settings.max_body_bytes, length, settings.body_read_timeout)
    except BodyTooLarge as exc:
        await _send_error(codec, send, st, RequestError(413, str(exc), "too_large"), CLOSE)
        return None
    except BodyTimeout:
        err = RequestError(408, f"request body not received within {settings.body_read_timeout:g} s", "body_timeout")
        await _send_error(codec, send, st, err, CLOSE)
        return None
    except ClientDisconnected:
        st.status = "client_disconnect"
        return None
    finally:
        app.reading_body -= 1
    if app.shutting_down:
        await _send_error(codec, send, st, RequestError(503, "server is shutting down", "shutdown"))
        return None
    try:
        if len(body) < DECODE_THREAD_BYTES:
            return codec.decode(body, headers)
        # orjson holds the GIL while it parses, but the codec's checks after
        # it are Python and let the event loop in; one big decode at a time
        # keeps every stall of the loop to one parse.
        return await anyio.to_thread.run_sync(codec.decode, body, headers, limiter=app.decode_limiter)
    except RequestError as exc:
        if exc.in_band:
            await _send_in_band_error(codec, send, st, exc)
        else:
            await _send_error(codec, send, st, exc)
        return None


async def _generate(
    app: "App", codec: Codec, request: GenerateRequest, receive: Receive, send: Send, st: RequestState, lease: Lease
) -> None:
    st.public_id = request.public_id
    st.stream = request.stream
    st.input_ids = request.input_ids
    st.input_length = len(request.input_ids) if request.input_ids is not None else None
    st.replay_excluded = request.replay_excluded
    st.model = request.model
    gen = _Generation(app, codec, codec.exchange(request, st.request_id), request, st, send)
    gen.lease = lease
    async with anyio.create_task_group() as tg:
        gen.scope = tg.cancel_scope
        app.inflight[st.request_id] = gen
        try:
            tg.start_soon(gen.guard, receive, app.settings.sse_keepalive if request.stream else 0.0)
            await gen.run()
            tg.cancel_scope.cancel()
        finally:
            del app.inflight[st.request_id]
    if gen.shutdown and not st.response_complete:
        # The grace period ran out: end the answer cleanly, in-band if begun.
        st.status = None
        await gen.fail(RequestError(503, "server is shutting down", "shutdown"), "shutdown")


class _Generation:
    """Drives one request's attempts and writes its response."""

    __slots__ = (
        "app", "codec", "ex", "req", "st", "send", "pending", "in_send", "last_send",
        "scope", "shutdown", "write_timeout", "send_started", "timed", "outbox", "outbox_tokens",
        "leg", "lost", "prefill_gate", "lease", "gone", "sent_ids", "resuming", "tried",
    )

    def __init__(
        self, app: "App", codec: Codec, ex: Exchange, req: GenerateRequest, st: RequestState, send: Send
    ) -> None:
        self.app = app
        self.codec = codec
        self.ex = ex
        self.req = req
        self.st = st
        self.send = send
        self.pending = 0
        self.in_send = False
        self.last_send = self.send_started = time.monotonic()
        self.timed = True
        self.outbox: list[bytes] = []
        self.outbox_tokens = 0
        self.scope: anyio.CancelScope | None = None
        self.shutdown = False
        self.write_timeout = app.settings.slow_client_timeout
        #: The running leg's scope, cancelled when its worker is lost.
        self.leg: anyio.CancelScope | None = None
        #: Why the running leg's worker was declared lost.
        self.lost: str | None = None
        #: P/D: set once the prefill leg answered, when the decode leg's
        #: first event needs that answer (see :mod:`asgi_generate.pd`).
        self.prefill_gate: anyio.Event | None = None
        #: The request's share of the body budget, given back once the first
        #: worker request is built (the body is decoded and checked then).
        self.lease: Lease | None = None
        #: A write failed because the client is gone (see :meth:`_write`).
        self.gone = False
        #: Every output token id received for the client, what a resumed
        #: attempt continues from; ``None`` when migration is off or the
        #: answer is unary (its engine leg shows no tokens before the end).
        self.sent_ids: list[int] | None = [] if req.stream and app.settings.migration_limit > 0 else None
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
        router = self.app.router
        tried = self.tried
        protocol = self.codec.worker_protocol
        while True:
            if self.resuming:  # a resumed leg runs aggregated
                worker = router.pick(protocol, tried)
                plan = None if worker is None else (worker,)
            else:
                plan = router.plan(protocol, tried)
            if plan is None and self.resuming:
                await self.fail(RequestError(
                    502, f"no worker left to resume on after {self.st.migrations} migration(s)", "worker_lost"
                ), "engine_error")
                return
            if plan is None:
                why = "no healthy worker" if router.has_protocol(protocol) else "no worker configured"
                await self.fail(
                    RequestError(503, f"{why} for protocol {protocol!r}", "unavailable"), "unavailable"
                )
                return
            if len(plan) == 2:  # a prefill/decode pair
                failed = await run_pair(self, *plan)
                if not failed:
                    return
                tried += failed
                continue
            worker = plan[0]
            if self.resuming:  # migration: continue where the client's answer stands
                self.st.migrations += 1
                attempt = Attempt(ids.mint(), "resumed", worker.id, worker.info, worker, resumes=list(self.sent_ids))
            else:
                attempt = Attempt(ids.mint(), "aggregated", worker.id, worker.info, worker)
            try:
                wreq = self.ex.worker_request(attempt)
            except RequestError as exc:  # nothing was sent to any engine
                await self.refuse(exc)
                return
            finally:
                self.release_body()
            self.st.attempts.append(attempt)
            self.lost = None
            worker.inflight.add(self)
            try:
                retry = await self._attempt(worker, attempt, wreq)
            finally:
                worker.inflight.discard(self)
            if not retry:
                return
            tried.append(worker)

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
            await _send_in_band_error(self.codec, self._write, self.st, exc)
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
        st, ex, settings = self.st, self.ex, self.app.settings
        if st.t_dispatched is None:
            st.t_dispatched = time.monotonic()
        attempt.live = True
        phase, limit = opening_phase(settings, wreq.stream)
        deadline = deadline_in(limit)
        try:
            with anyio.CancelScope() as self.leg:
                if self.lost is not None:  # lost before the leg began
                    self.leg.cancel()
                async with worker.pool.request(
                    b"POST", wreq.path, wreq.body, wreq.headers, head_deadline=deadline
                ) as resp:
                    if wreq.stream:
                        phase, limit = "first_token", settings.first_token_timeout
                        deadline = deadline_in(limit)
                    if resp.status != 200:
                        body = await resp.read(deadline)
                        attempt.live = False
                        attempt.outcome = "error"
                        if resp.status == 503 and self._migrate(attempt, f"answered {resp.status}"):
                            return True  # the worker is going away
                        status, body = ex.worker_error(resp.status, body)
                        st.fail(
                            "engine_error" if status >= 500 else "rejected",
                            status,
                            "engine",
                            body[:512].decode("utf-8", "replace"),
                        )
                        await self._unary(status, body)
                        return False
                    if not wreq.stream:
                        await self._feed_whole(attempt, await resp.read(deadline))
                    else:
                        decoder = SSEDecoder()
                        between = settings.inter_token_timeout
                        while (data := await resp.read_some(deadline)) is not None:
                            payloads = decoder.feed(data)
                            if not payloads:  # only comments or part of an event
                                continue
                            phase, limit = "inter_token", between
                            deadline = deadline_in(between)
                            for payload in payloads:
                                if not st.response_complete and payload != DONE:
                                    await self._feed(attempt, payload)
                            if self.outbox:
                                await self._flush()
                    if not st.response_complete:
                        event = ex.end_of_stream(attempt)
                        if event is None or (event.error is None and event.finish_reason is None):
                            raise WorkerError("worker ended the response without a finish reason")
                        await self._settle(attempt, event)
                    return False
        except ConnectFailed as exc:
            attempt.live = False
            attempt.outcome = "connect_failed"
            self.app.router.mark_down(worker, str(exc))
            return True
        except TimedOut:
            if st.response_complete:  # only the drain after the answer was slow
                return False
            if phase == "inter_token" and self._migrate(attempt, f"sent no token for {limit:g} s"):
                attempt.outcome = "timeout"  # still live: aborted when the request ends
                return True
            # Slow is not dead: the leg stays live so that it is aborted.
            await self.fail(RequestError(504, _timeout_message(worker, phase, limit), "timeout"), "timeout")
            return False
        except WorkerError as exc:
            if self.st.response_complete:  # only the drain after the answer failed
                return False
            # A broken connection may be this request's doing (SGLang drops
            # a stream whose generator raised): ask the worker itself before
            # taking it out, so no client can empty the rotation.
            if await self.app.router.probe(worker):
                attempt.outcome = "error"
                await self.fail(
                    RequestError(502, f"worker {worker.id} broke the connection mid-answer: {exc}", "engine"),
                    "engine_error",
                )
                return False
            attempt.outcome = "worker_lost"
            if not self.st.response_started and self.pending == 0:
                return True
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
        # Only a cancelled leg gets here: the health probe gave the worker up.
        # Its record is written at once: a lost worker's leg gets no abort.
        attempt.outcome = "worker_lost"
        if self._migrate(attempt, f"lost: {self.lost}"):
            return True
        await self.fail(RequestError(502, self._failed(worker, f"lost: {self.lost}"), "worker_lost"), "engine_error")
        return False

    def _migrate(self, attempt: Attempt, why: str) -> bool:
        """Whether the request, whose aggregated ``attempt`` failed
        mid-answer for a migratable reason (``why``), continues on another
        worker: migration is on, the answer is a stream the codec can
        resume, another worker is up, and the request's ``migration_limit``
        is not spent. (P/D
        legs fail over by :mod:`asgi_generate.pd`'s rules.)"""
        st = self.st
        if self.sent_ids is None or attempt.role not in ("aggregated", "resumed"):
            return False
        if self.ex.resume_refusal() is not None:
            return False
        if self.app.router.pick(self.codec.worker_protocol, [*self.tried, attempt.worker]) is None:
            return False  # nowhere to go: the failure itself is the answer
        if st.migrations >= self.app.settings.migration_limit:
            return False
        self.resuming = True
        log.info("request %s: worker %s %s; resuming after %d tokens (migration %d)",
                 st.request_id, attempt.worker_id, why, len(self.sent_ids), st.migrations + 1)
        return True

    def _failed(self, worker: Worker, what: str) -> str:
        """The client's message for a worker failure that ends the request,
        saying so when the migration limit was what ended it."""
        limit = self.app.settings.migration_limit
        spent = self.sent_ids is not None and self.st.migrations >= limit > 0
        return f"worker {worker.id} {what}" + (f" (migration limit {limit} reached)" if spent else "")

    async def _held_finish(self, attempt: Attempt) -> bool:
        """A stream cut after its finishing event (e.g. vLLM's finish reason
        held for a usage chunk that never came) is finished, not resumed."""
        event = self.ex.end_of_stream(attempt)
        if event is None or (event.error is None and event.finish_reason is None):
            return False
        await self._settle(attempt, event)
        return True

    async def _write(self, message: dict) -> None:
        """Hand ``message`` to the server. A client is only ever owed the
        events of one worker read (at most 64 KiB of worker bytes);
        :meth:`guard` cuts off a client that leaves a write untaken too
        long."""
        self.in_send = True
        self.send_started = time.monotonic()
        try:
            await self.send(message)
        except OSError:
            # ASGI: the server raises on a send to a closed connection (our
            # hypercorn does, asgi_generate.hypercorn_fixes): nothing of
            # ``message`` went out, so its tokens are not counted.
            self.gone = True
            if self.st.status is None:
                self.st.status = "client_disconnect"
            if self.scope is not None:
                self.scope.cancel()
        finally:
            self.in_send = False
            self.last_send = time.monotonic()
            if self.lost is not None and self.leg is not None and not self.st.response_complete:
                self.leg.cancel()  # the worker was lost during this write

    async def _feed(self, attempt: Attempt, payload: bytes) -> None:
        if self.prefill_gate is not None and attempt.role == "decode":
            await self.prefill_gate.wait()
        await self._settle(attempt, self.ex.feed(attempt, payload))

    async def _feed_whole(self, attempt: Attempt, body: bytes) -> None:
        # One unary worker answer carries no token timing: TTFT and ITL
        # stay unknown rather than equal to the total.
        self.timed = False
        await self._feed(attempt, body)

    async def _settle(self, attempt: Attempt, event: Event) -> None:
        attempt.tokens += len(event.token_ids)
        if event.error is not None or event.finish_reason is not None:
            attempt.live = False
            attempt.outcome = "finished" if event.error is None else "error"
        await self._deliver(event)

    async def _send(self, body: bytes, more: bool) -> None:
        await self._write({"type": "http.response.body", "body": body, "more_body": more})

    async def _start_stream(self) -> None:
        if not self.st.response_started:
            self.st.response_started = True
            self.st.http_status = 200
            await self._write({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def _unary(self, status: int, body: bytes) -> None:
        st = self.st
        st.response_started = True
        st.http_status = status
        st.response_complete = True
        await send_unary(self._write, status, body, self.codec.content_type)

    async def _deliver(self, event: Event) -> None:
        st, ex = self.st, self.ex
        now = time.monotonic()
        n = len(event.token_ids)
        if n and self.timed:
            if st.t_first_token is None:
                st.t_first_token = now
            st.t_last_token = now
        if n and self.sent_ids is not None:
            self.sent_ids += event.token_ids
        if n and self.app.trace_output_ids:  # only for a trace parser; default path skips it
            if st.output_ids is None:
                st.output_ids = []
            st.output_ids.extend(event.token_ids)
        if event.completion_tokens is not None:
            st.engine_completion_tokens = event.completion_tokens
        if event.prompt_tokens is not None:
            st.prompt_tokens = event.prompt_tokens
        if event.cached_tokens is not None:
            st.cached_tokens = event.cached_tokens
        done = event.error is not None or event.finish_reason is not None
        if event.error is not None:
            st.fail("engine_error", None, "engine", event.error.message)
        elif done:
            st.finish_reason = event.finish_reason
            st.finish_matched = event.matched
        if self.req.stream:
            await self._start_stream()
            data = ex.client_event(event)
            if data is not None:
                self.outbox.append(sse_event(data))
            self.outbox_tokens += n
            if done:
                self.outbox.append(self.codec.sse_terminal)
                # Complete once the last bytes are handed over: a client that
                # hangs up as they arrive has not disconnected early.
                st.response_complete = True
                await self._flush(more=False)
        else:
            self.pending += n
            if done:
                status, body = ex.unary_body()
                if st.http_status is None:
                    st.http_status = status
                await self._unary(status, body)
                if not self.gone:
                    st.output_tokens = self.pending
        if done and st.status is None:
            st.status = "ok"

    async def _flush(self, more: bool = True) -> None:
        """Send every event decoded from one worker read in one write; count
        their tokens as delivered once the server took them (a write to a
        client that is gone raises in the server, see :meth:`_write`)."""
        body = b"".join(self.outbox) if len(self.outbox) > 1 else self.outbox[0]
        tokens = self.outbox_tokens
        self.outbox.clear()
        self.outbox_tokens = 0
        await self._send(body, more)
        if not self.gone:
            self.st.output_tokens += tokens

    async def fail(self, err: RequestError, status: str) -> None:
        """End the response with ``err``: its own status before the 200,
        in-band after it."""
        st = self.st
        st.response_complete = True
        if not st.response_started:
            st.fail(status, err.status, err.kind, err.message)
            st.response_started = True
            await send_unary(self._write, err.status, self.codec.error_body(err))
        else:
            st.fail(status, st.http_status, err.kind, err.message)
            self.outbox.append(sse_event(self.codec.in_band_error(err)) + self.codec.sse_terminal)
            await self._flush(more=False)

    async def guard(self, receive: Receive, keepalive: float) -> None:
        """Watch the client for the whole request, in one task.

        - ``http.disconnect`` before the answer is complete makes the request
          a ``client_disconnect`` and cancels it (the handler then aborts
          every live engine leg).
        - A write the client has left untaken for ``slow_client_timeout``
          seconds makes it a ``slow_client``: the engine legs are aborted
          and the record handed over at once, then the request is cancelled.
          (hypercorn's trio worker shields its socket writes, so the stuck
          write itself may only end when the client reads or hangs up.)
        - With ``keepalive`` > 0, an SSE comment goes out after that many
          seconds of silence, committing to the 200 if nothing was sent yet.

        Waiting on ``receive()`` under a timeout loses nothing: ASGI servers
        hand messages over through cancellation-safe queues.
        """
        st = self.st
        timeout = self.write_timeout
        while True:
            now = time.monotonic()
            if self.in_send:
                wake = self.send_started + timeout
                if now >= wake:
                    await self._cut_off_slow_client()
                    return
            elif keepalive > 0 and not st.response_complete:
                wake = self.last_send + keepalive
                if now >= wake:
                    await self._start_stream()
                    await self._send(KEEPALIVE, True)
                    continue
            else:
                wake = now + timeout
            # A write may start while we wait: look again within `timeout`.
            with anyio.move_on_after(max(0.01, min(wake - now, timeout))):
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not st.response_complete:
                        st.status = "client_disconnect"
                        if self.scope is not None:
                            self.scope.cancel()
                    return

    async def _cut_off_slow_client(self) -> None:
        st = self.st
        st.status = None
        st.fail("slow_client", st.http_status, "slow_client",
                f"client left a write untaken for {self.write_timeout:g} s")
        with anyio.CancelScope(shield=True):
            await abort_live_legs(self.app, st)
        finish_record(self.app, st)
        if self.scope is not None:
            self.scope.cancel()


def _timeout_message(worker: Worker, phase: str, limit: float) -> str:
    """What a client is told when ``worker`` missed a phase deadline."""
    what = {
        "headers": "sent no response headers within",
        "first_token": "sent no token within",
        "inter_token": "sent no token for",
        "request": "did not answer within",
    }[phase]
    return f"worker {worker.id} {what} {limit:g} s"


async def abort_live_legs(app: "App", st: RequestState) -> None:
    """Abort every engine leg of ``st`` that may still run, concurrently,
    recording on each attempt whether the engine acknowledged."""
    live = [a for a in st.attempts if a.live]
    if len(live) == 1:  # the common case needs no task group
        await _abort_leg(app, live[0])
        return
    if not live:
        return
    async with anyio.create_task_group() as tg:
        for attempt in live:
            tg.start_soon(_abort_leg, app, attempt)


async def _abort_leg(app: "App", attempt: Attempt) -> None:
    attempt.live = False
    # A worker marked down (dead, or given up by its probe) gets no abort:
    # the queue answers "lost" at once, so the record is not held up.
    result = await app.abort_engine_request(attempt.worker, attempt.engine_id)
    attempt.abort_acked = result == ACKED
    if result == LOST:
        attempt.outcome = attempt.outcome or "worker_lost"
    elif attempt.outcome is None:
        attempt.outcome = "aborted"
