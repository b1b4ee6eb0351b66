"""Running a prefill/decode (P/D) pair: the legs of one attempt.

The router plans a pair (:meth:`~asgi_generate.workers.router.Router.plan`);
this module runs it inside the handler's request scope.

vLLM's legs run one after the other (``WorkerProtocol.pd_legs ==
"sequential"``, vLLM's P/D proxies): the prefill leg (unary, one token, with
``kv_transfer_params`` asking for a remote decode) is read whole into the
codec, then the decode leg carries the ``kv_transfer_params`` it answered
and is an ordinary attempt whose events go to the client. A prefill leg that
answered none fails the request, unless ``--pd-fallback`` lets the decode
worker prefill alone (the decode attempt's ``local_prefill``).

SGLang's legs run concurrently (``pd_legs == "concurrent"``): both get the
client's body with a bootstrap room minted per attempt, the prefill worker's
host and its bootstrap port (SGLang ``disaggregation/mini_lb.py``), and

- the decode leg is an ordinary streamed (or unary) attempt whose events go
  to the client, so framing, accounting and timeouts are the handler's own;
- the prefill leg's answer is read whole and fed to the codec, which keeps
  what the client's answer needs from it (prompt logprobs); when the codec
  says the decode's first event needs it (``Exchange.waits_for_prefill``),
  that event waits for it;
- a leg that fails before the client got anything fails the pair: the other
  leg is cancelled and aborted, then the request is retried on another pair
  with a new room (a worker that could not be reached or broke off), or ends
  with the format's error (an engine's error answer).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import anyio

from ..sdk import ids
from ..sdk.codec import NO_KV_TRANSFER, Attempt, Event, Exchange, RequestError, WorkerRequest
from .client_stream import abort_live_legs
from .framing import SSEDecoder
from .legs import Leg
from ..workers.http import ConnectFailed, TimedOut, WorkerError
from ..workers.router import InFlight, Worker

if TYPE_CHECKING:
    from .accounting import RequestState
    from .context import RequestContext

#: ``bootstrap_room`` is below 2^63 (SGLang ``io_struct.GenerateReqInput``).
ROOM_LIMIT = 1 << 63
DONE = b"[DONE]"
_live_rooms: set[int] = set()


class AttemptLoop(InFlight, Protocol):
    """What running a pair needs of the request's attempt loop
    (:class:`~asgi_generate.request.generation.Generation`, which calls
    :func:`run_pair`): its state, its client's answer, and one attempt run
    on a worker (the decode leg)."""

    ctx: RequestContext
    ex: Exchange
    st: RequestState
    #: Set while the decode leg's first event waits for the prefill's answer.
    prefill_gate: anyio.Event | None
    #: Tokens of a unary answer received and not yet sent.
    pending: int
    #: The last attempt died mid-answer and the request migrates.
    resuming: bool
    #: The output ids the client was sent, what a resumed pair continues from.
    sent_ids: list[int] | None

    def release_body(self) -> None:
        """Give the request's share of the body budget back."""

    def stamp(self, attempt: Attempt, wreq: WorkerRequest) -> None:
        """With OpenTelemetry export on, give the leg its ``traceparent``."""

    async def refuse(self, exc: RequestError) -> None:
        """Answer a request the codec refused before any engine saw it."""

    async def fail(self, err: RequestError, status: str) -> None:
        """End the answer with ``err``."""

    async def _attempt(self, worker: Worker, attempt: Attempt, wreq: WorkerRequest) -> bool:
        """Run one streamed or unary leg to the client; whether to retry."""

    async def _unary(self, status: int, body: bytes) -> None:
        """Answer the client with one body."""


def mint_room() -> int:
    """A random bootstrap room in [0, 2^63) that no live attempt of this
    process holds."""
    while True:
        room = secrets.randbits(63)
        if room not in _live_rooms:
            return room


def bootstrap_host(worker: Worker) -> str:
    """The host a decode engine reaches ``worker``'s bootstrap server on:
    its URL's host, an IPv6 address in brackets (as SGLang's routers send it)."""
    host = urlsplit(worker.url).hostname or ""
    return f"[{host}]" if ":" in host else host


@dataclass(slots=True, eq=False)
class _PrefillLeg:
    """The prefill leg as its worker's in-flight set holds it: counted as
    outstanding, and told when the health probe gives the worker up (which
    cancels the leg if it still runs). Also how the leg ended."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    lost: str | None = None
    retry: bool = False
    error: RequestError | None = None
    page: tuple[int, bytes] | None = None  # the worker's own non-200 answer, for the client

    def worker_lost(self, worker: Worker, reason: str) -> None:
        """See :meth:`asgi_generate.workers.router.InFlight.worker_lost`."""
        if self.lost is None:
            self.lost = reason
            self.scope.cancel()


async def run_pair(
    gen: AttemptLoop, prefill: Worker, decode: Worker, role: str = "aggregated", backoff: float = 0.0
) -> list[Worker]:
    """Run one P/D attempt of ``gen``'s request on ``prefill`` and ``decode``;
    ``role`` ``resumed`` makes it a migration (both legs carry the prompt
    plus the output sent so far), ``backoff`` the seconds waited before it.

    Returns the workers to leave out of the next attempt (empty: the request
    is answered, successfully or with its error). A decode leg that dies
    mid-answer returns its worker with ``gen.resuming`` set: the request
    migrates (:meth:`~asgi_generate.request.generation.Generation._migrate`).
    """
    resumes = list(gen.sent_ids) if role == "resumed" else None
    if prefill.protocol.pd_legs == "sequential":
        return await _run_sequential(gen, prefill, decode, resumes, backoff)
    room = mint_room()
    _live_rooms.add(room)
    try:
        return await _run_pair(gen, prefill, decode, room, resumes, backoff)
    finally:
        _live_rooms.discard(room)


def _legs(engine_ids: tuple[str, str], prefill: Worker, decode: Worker, resumes: list[int] | None,
          backoff: float, bootstrap: tuple[str, int, int] | None = None) -> tuple[Attempt, Attempt]:
    p_att = Attempt(engine_ids[0], "prefill", prefill.id, prefill.info, prefill, bootstrap=bootstrap, resumes=resumes)
    d_att = Attempt(engine_ids[1], "decode", decode.id, decode.info, decode, bootstrap=bootstrap, resumes=resumes)
    p_att.backoff_ms = d_att.backoff_ms = round(backoff * 1000)
    return p_att, d_att


async def _run_pair(gen: AttemptLoop, prefill: Worker, decode: Worker, room: int, resumes: list[int] | None,
                    backoff: float) -> list[Worker]:
    st, ex = gen.st, gen.ex
    bootstrap = (bootstrap_host(prefill), prefill.bootstrap_port, room)
    p_att, d_att = _legs((ids.mint(), ids.mint()), prefill, decode, resumes, backoff, bootstrap)
    try:
        p_req = ex.worker_request(p_att)
        d_req = ex.worker_request(d_att)
    except RequestError as exc:  # nothing was sent to any engine
        await gen.refuse(exc)
        return []
    finally:
        gen.release_body()
    st.attempts += (p_att, d_att)
    gen.stamp(p_att, p_req)
    gen.stamp(d_att, d_req)
    result = _PrefillLeg()
    gate = anyio.Event()
    gen.prefill_gate = gate if ex.waits_for_prefill else None
    retry_decode = False
    prefill.inflight.add(result)
    decode.inflight.add(gen)
    try:
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as decode_scope:
                tg.start_soon(_prefill_leg, gen, prefill, p_att, p_req, result, gate, decode_scope)
                retry_decode = await gen._attempt(decode, d_att, d_req)
            if p_att.live and (d_att.outcome != "finished" or st.finish_reason == "abort"):
                # No decode will take the prefill's KV: stop waiting for it
                # (the leg stays live, so it is aborted).
                tg.cancel_scope.cancel()
    finally:
        gen.prefill_gate = None
        prefill.inflight.discard(result)
        decode.inflight.discard(gen)
    if retry_decode or result.retry:
        if st.response_started or gen.pending:
            if retry_decode and gen.resuming:  # the decode leg died mid-answer: migrate
                await _abort_pair(gen)
                return [decode]
            # The decode leg already answered the client (in part): no retry.
            if not st.response_complete:
                await gen.fail(RequestError(502, "a P/D leg failed mid-answer", "engine"), "engine_error")
            return []
        await _abort_pair(gen)
        return [w for w, failed in ((prefill, result.retry), (decode, retry_decode)) if failed]
    if result.error is not None and not st.response_started and not gen.pending:
        await _abort_pair(gen)
        await _answer_prefill_error(gen, result)
    return []


async def _run_sequential(gen: AttemptLoop, prefill: Worker, decode: Worker, resumes: list[int] | None,
                          backoff: float) -> list[Worker]:
    st, ex = gen.st, gen.ex
    engine_id = ids.mint()  # one id on both legs, as vLLM's proxies send it
    p_att, d_att = _legs((engine_id, engine_id), prefill, decode, resumes, backoff)
    try:
        p_req = ex.worker_request(p_att)
    except RequestError as exc:  # nothing was sent to any engine
        await gen.refuse(exc)
        return []
    finally:
        gen.release_body()
    st.attempts.append(p_att)
    gen.stamp(p_att, p_req)
    result = _PrefillLeg()
    prefill.inflight.add(result)
    try:
        await _prefill_leg(gen, prefill, p_att, p_req, result, anyio.Event(), anyio.CancelScope())
    finally:
        prefill.inflight.discard(result)
    if result.retry or result.error is not None:
        await _abort_pair(gen)
        if result.retry:
            return [prefill]
        await _answer_prefill_error(gen, result)
        return []
    try:
        try:
            d_req = ex.worker_request(d_att)
        except RequestError as exc:
            if exc.kind != NO_KV_TRANSFER or not gen.ctx.settings.pd_fallback:
                raise
            d_att.local_prefill = True  # recorded: the decode worker prefills alone
            d_req = ex.worker_request(d_att)
    except RequestError as exc:  # the prefill's answer cannot start a decode
        await gen.fail(exc, "engine_error")
        return []
    st.attempts.append(d_att)
    gen.stamp(d_att, d_req)
    decode.inflight.add(gen)
    try:
        retry = await gen._attempt(decode, d_att, d_req)
    finally:
        decode.inflight.discard(gen)
    return [decode] if retry else []


async def _answer_prefill_error(gen: AttemptLoop, result: _PrefillLeg) -> None:
    """The client's answer when the prefill leg failed before it got
    anything: the worker's own error page, or the error in the format's shape."""
    st = gen.st
    if result.page is not None:
        status, body = result.page
        st.fail("engine_error" if status >= 500 else "rejected", status, "engine",
                body[:512].decode("utf-8", "replace"))
        await gen._unary(status, body)
    else:
        await gen.fail(result.error, "timeout" if result.error.kind == "timeout" else "engine_error")


async def _abort_pair(gen: AttemptLoop) -> None:
    """Abort the failed pair's live legs now, before another pair runs."""
    with anyio.CancelScope(shield=True):
        await abort_live_legs(gen.ctx, gen.st)


async def _prefill_leg(
    gen: AttemptLoop,
    worker: Worker,
    attempt: Attempt,
    wreq: WorkerRequest,
    result: _PrefillLeg,
    gate: anyio.Event,
    decode_scope: anyio.CancelScope,
) -> None:
    """Run the prefill leg: read its whole answer into the codec, within
    the handler's phase deadlines (it answers once the decode took its KV,
    so a streamed leg's one event is its first token). A failure before the
    client got anything cancels the decode leg (which the pair runner then
    aborts); the gate opens however the leg ends."""
    ex = gen.ex
    leg = Leg(gen.st, gen.ctx.settings, worker, attempt, wreq)
    try:
        with result.scope:
            async with leg as resp:
                if leg.page is not None:
                    result.page = ex.worker_error(*leg.page)
                    result.error = RequestError(result.page[0], "prefill leg failed", "engine")
                elif not wreq.stream:
                    _settle(attempt, ex.feed(attempt, await resp.read(leg.deadline)), result)
                else:
                    decoder = SSEDecoder()
                    while (data := await resp.read_some(leg.deadline)) is not None:
                        for payload in decoder.feed(data):
                            if payload != DONE and attempt.live:
                                _settle(attempt, ex.feed(attempt, payload), result)
                    if attempt.live:
                        raise WorkerError("prefill worker ended its answer without a finish reason")
        if result.scope.cancelled_caught:  # the health probe gave the worker up
            attempt.outcome = "worker_lost"
            result.retry = True
    except TimedOut:  # slow is not dead: the leg stays live, so it is aborted
        result.error = RequestError(504, leg.timeout_message(), "timeout")
    except ConnectFailed as exc:
        attempt.live = False
        attempt.outcome = "connect_failed"
        gen.ctx.router.mark_down(worker, str(exc))
        result.retry = True
    except WorkerError as exc:
        # As the handler does: ask the worker itself before taking it out
        # (the broken connection may be this request's doing).
        if await gen.ctx.router.probe(worker):
            attempt.outcome = "error"
            result.error = RequestError(502, f"worker {worker.id} broke the connection mid-answer: {exc}", "engine")
        else:
            attempt.outcome = "worker_lost"
            result.retry = True
    except RequestError as exc:  # the worker broke its protocol
        attempt.outcome = "error"
        result.error = exc
    finally:
        if (result.retry or result.error is not None) and not gen.st.response_started and not gen.pending:
            decode_scope.cancel()
        gate.set()
        if attempt.span_id:
            attempt.t_ended = time.monotonic()


def _settle(attempt: Attempt, event: Event, result: _PrefillLeg) -> None:
    if event.error is not None:
        attempt.live = False
        attempt.outcome = "error"
        result.error = RequestError(event.error.status, event.error.message, "engine")
    elif event.finish_reason is not None:
        attempt.live = False
        attempt.outcome = "finished"
