"""Handshakes: how one attempt of a request runs on the workers the router
planned, one strategy per kind of plan and worker protocol.

- :data:`AGGREGATED`: one worker, one leg (also a migration's ``resumed``
  leg and a unary request's ``replayed`` one).
- :data:`CONCURRENT_PAIR` (SGLang's, ``disaggregation/mini_lb.py``): the
  prefill and decode legs run concurrently, both with the client's body and
  the fields that join them (``WorkerProtocol.pair_join``: SGLang's
  bootstrap host, port and room; the prefill worker's host and bootstrap
  port, a room minted per pair). The legs race, and one rule
  settles it in every mode (unary and SSE, with or without what only the
  prefill computed): the client gets no decode event before the prefill
  leg answered successfully. The decode's first payload waits for the
  prefill's answer (SGLang's prefill answers once its KV went over, about
  when the decode computes its first token); a prefill that fails cancels
  and aborts the decode leg before any of its tokens went out, so a
  request whose prefill failed never ends ``ok``.
- :data:`SEQUENTIAL_PAIR` (vLLM's P/D proxies,
  ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``): the legs
  run one after the other under one engine id; the prefill leg (unary, one
  token) answers ``kv_transfer_params``, which the decode leg carries. A
  prefill that answered none fails the request, unless ``--pd-fallback``
  lets the decode worker prefill alone (``Pair.local_prefill``).

:func:`handshake` picks one for a plan, by the worker protocol's
``WorkerProtocol.pd``: the handshakes name no engine. A pair's engine state lives in its
handshake and in the :class:`~asgi_generate.sdk.Pair` both its
attempts carry; the codec builds the bytes from that.

One direction: the attempt loop calls :meth:`Handshake.run` once per
attempt and the handshake drives the loop's :class:`LegRunner` (builds
the worker requests, runs the legs) until the attempt is over or only its
client leg is left: it hands back the workers to leave out, or that last
leg as a :class:`ClientLeg` plan, which the loop runs in its own frame (an
open stream then holds no handshake frame: 0.5 KB less per stream, measured by bench_streams).
Each leg runs on the leg runner (:class:`~asgi_generate.request.legs.Leg`);
a leg whose events make the client's answer is concluded by the runner
(:meth:`LegRunner.run_client_leg`), a prefill leg here: a pair whose leg
fails before the client got anything is aborted, then the request runs on
another pair (a worker that could not be reached or was lost) or ends with
the format's error (the engine's error answer).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol
from urllib.parse import urlsplit

import anyio

from ..sdk import _ids as ids
from ..sdk._codec import NO_KV_TRANSFER, Event, Pair, RequestError
from ..tracing.state import LegRecord
from ..exceptions import WorkerError
from . import state
from .legs import Leg, LegEnd

if TYPE_CHECKING:
    from ..sdk._codec import Exchange, WorkerRequest
    from .state import Moves
    from ..workers.router import Worker
    from ..tracing.state import RequestState
    from .context import RequestContext

#: The bootstrap rooms of the pairs running in this process.
_live_rooms: set[int] = set()


class LegRunner(Protocol):
    """What a handshake drives: the request's attempt loop
    (:class:`~asgi_generate.request.generation.Generation`), which builds
    worker requests and runs and concludes the legs whose events make the
    client's answer. It never calls the handshake back."""

    ctx: "RequestContext"
    st: "RequestState"
    #: The codec's state of the request (its ``Exchange``).
    codec_state: "Exchange"
    #: Tokens of a unary answer counted but not sent yet.
    pending: int
    #: Every output token id sent so far (``None``: the request cannot resume).
    sent_ids: list[int] | None
    #: Where the answer goes on after a failure (``moves.continuing``: the
    #: request migrates).
    moves: "Moves"
    #: The request's routing key (``None`` before it is routed, or for
    #: legs spread least outstanding), carried by its legs.
    key: Any

    def give_items(self, attempt: LegRecord) -> None:
        """Give ``attempt`` the items it carries: a batch's, each under an
        id of its own (``Attempt.entries``, ``entry_ids``); nothing for a
        request of one item."""

    async def worker_requests(self, *attempts: LegRecord) -> "list[WorkerRequest] | None":
        """The attempts' worker requests; ``None`` once a refusal was answered."""

    def record_leg(self, attempt: LegRecord, wreq: "WorkerRequest") -> None:
        """Count ``attempt`` among the request's legs."""

    async def run_client_leg(
        self, worker: "Worker", attempt: LegRecord, wreq: "WorkerRequest", gate: anyio.Event | None = None
    ) -> bool:
        """Run a leg whose events make the client's answer and conclude it
        (failover, migration or the request's end); whether to try
        another worker."""

    async def fail(self, err: RequestError, status: str) -> None:
        """End the client's answer with ``err``."""

    async def answer_worker_error(self, status: int, body: bytes, retry_after: bytes | None = None) -> None:
        """Answer the client with a worker's own error answer (and its
        ``Retry-After``, if it sent one)."""

    async def abort_live_legs(self) -> None:
        """Abort every live leg of the request now."""


class ClientLeg(NamedTuple):
    """An attempt's last leg, the one whose events make the client's
    answer, for the attempt loop to run and conclude
    (:meth:`LegRunner.run_client_leg`'s arguments)."""

    worker: "Worker"
    attempt: LegRecord
    wreq: "WorkerRequest"


class Handshake(Protocol):
    """One attempt's strategy (see the module docstring)."""

    async def run(
        self, runner: LegRunner, workers: "tuple[Worker, ...]", role: str, backoff: float
    ) -> "list[Worker] | ClientLeg":
        """Run one attempt of ``runner``'s request on ``workers``: ``role``
        is ``aggregated``, ``resumed`` (its legs carry the output sent so
        far after the prompt) or ``replayed``; ``backoff`` the seconds
        waited before it.

        Returns the workers to leave out of the next attempt (empty: the
        request is answered, successfully or with its error; a leg that
        died mid-answer gives its worker with ``runner.moves.continuing``
        when the request migrates), or the attempt's client leg, for the
        loop to run and conclude as :meth:`LegRunner.run_client_leg` does.
        """


def _attempt(engine_id: str, role: str, worker: "Worker", backoff: float, resumes: list[int] | None,
             pair: Pair | None = None) -> LegRecord:
    return LegRecord(engine_id, role, worker.id, worker.info, pair=pair, resumes=resumes,
                     backoff_ms=round(backoff * 1000), worker=worker)


class Aggregated:
    """One worker, one leg."""

    async def run(
        self, runner: LegRunner, workers: "tuple[Worker, ...]", role: str, backoff: float
    ) -> "list[Worker] | ClientLeg":
        """See :meth:`Handshake.run`: the one leg, for the loop to run."""
        (worker,) = workers
        resumes = list(runner.sent_ids) if role == "resumed" else None  # where the client's answer stands
        attempt = _attempt(ids.mint(), role, worker, backoff, resumes)
        runner.give_items(attempt)
        built = await runner.worker_requests(attempt)
        if built is None:
            return []
        runner.record_leg(attempt, built[0])
        return ClientLeg(worker, attempt, built[0])


class _Prefill:
    """A prefill leg's reader: its answer goes to the codec, never to the
    client; keeps how the leg ended for the pair."""

    __slots__ = ("codec_state", "leg", "retry", "error", "error_answer")
    outbox: tuple = ()

    def __init__(self, codec_state: "Exchange") -> None:
        self.codec_state = codec_state
        self.leg: Leg | None = None
        #: The pair failed on this worker: the request may run on another pair.
        self.retry = False
        #: The pair failed with this error for the client.
        self.error: RequestError | None = None
        #: The worker's own non-200 answer, for the client.
        self.error_answer: tuple[int, bytes, bytes | None] | None = None

    def answered(self, attempt: LegRecord) -> bool:
        return not attempt.live

    def read_payload(self, attempt: LegRecord, payload: bytes) -> Event | None:
        return self.codec_state.feed(attempt, payload) if attempt.live else None

    async def deliver_event(self, attempt: LegRecord, event: Event) -> None:
        if event.error is not None:
            attempt.live = False
            state.end_leg(attempt, "error")
            self.error = RequestError(event.error.status, event.error.message, "engine")
        elif event.finish_reason is not None:
            attempt.live = False
            state.end_leg(attempt, "finished")
            attempt.usage = event.reported()

    async def flush(self) -> None:  # nothing is queued for the client
        pass

    async def cut_short(self, attempt: LegRecord) -> None:
        raise WorkerError("prefill worker ended its answer without a finish reason")

    def note_end(self, leg: Leg, end: LegEnd) -> None:
        """How the pair fares after its prefill leg ended ``end``."""
        if end is LegEnd.ERROR_ANSWER:
            self.error_answer = leg.error_answer
            self.error = RequestError(leg.error_answer[0], "prefill leg failed", "engine")
        elif end in (LegEnd.CONNECT_FAILED, LegEnd.WORKER_LOST, LegEnd.UNANSWERED, LegEnd.CANCELLED):
            self.retry = True
        elif end is not LegEnd.FINISHED:  # timed out (the leg stays live), engine or protocol error
            self.error = leg.error


async def _run_prefill(
    runner: LegRunner, prefill: _Prefill, worker: "Worker", attempt: LegRecord, wreq: "WorkerRequest",
    gate: anyio.Event | None = None, decode_scope: anyio.CancelScope | None = None,
) -> None:
    """Run a prefill leg, its whole answer into the codec (it answers once
    the decode took its KV: a streamed leg's one event is its first token),
    how it ended into ``prefill``. A failure cancels ``decode_scope``
    before ``gate`` opens, so the decode leg waiting on it sends the client
    nothing (the pair is then aborted); ``gate`` opens however the leg ends."""
    try:
        leg = Leg(runner.st, runner.ctx.settings, worker, attempt, wreq, route_key=runner.key)
        prefill.note_end(leg, await leg.run(prefill, runner.ctx.router))
    finally:
        if (prefill.retry or prefill.error is not None) and decode_scope is not None:
            decode_scope.cancel()
        if gate is not None:
            gate.set()


async def _prefill_failed(runner: LegRunner, prefill: _Prefill) -> None:
    """The client's answer when the prefill leg failed before it got
    anything: the worker's own error answer, or the error in the format's shape."""
    if prefill.error_answer is not None:
        await runner.answer_worker_error(*prefill.error_answer)
    else:
        await runner.fail(prefill.error, "timeout" if prefill.error.kind == "timeout" else "engine_error")


def mint_room() -> int:
    """A random bootstrap room in [0, 2^63) (SGLang ``io_struct.GenerateReqInput``
    takes ``bootstrap_room`` below 2^63) that no live pair of this process holds."""
    while True:
        room = secrets.randbits(63)
        if room not in _live_rooms:
            return room


def bootstrap_host(worker: "Worker") -> str:
    """The host a decode engine reaches ``worker``'s bootstrap server on:
    its URL's host, an IPv6 address in brackets (as SGLang's routers send it)."""
    host = urlsplit(worker.url).hostname or ""
    return f"[{host}]" if ":" in host else host


class ConcurrentPair:
    """Concurrent legs joined by a room (see the module docstring). A batch
    (or ``n`` > 1, sent expanded) runs on one pair, both legs with every
    entry and a room per entry, in the order of the body's entries (SGLang:
    ``bootstrap_room`` as a list, ``io_struct.GenerateReqInput.
    _normalize_bootstrap_params``)."""

    async def run(self, runner: LegRunner, workers: "tuple[Worker, ...]", role: str,
                  backoff: float) -> "list[Worker]":
        """See :meth:`Handshake.run`."""
        prefill, decode = workers
        pair = Pair()
        resumes = list(runner.sent_ids) if role == "resumed" else None
        p_att = _attempt(ids.mint(), "prefill", prefill, backoff, resumes, pair)
        d_att = _attempt(ids.mint(), "decode", decode, backoff, resumes, pair)
        runner.give_items(p_att)
        runner.give_items(d_att)
        rooms = []
        for _ in d_att.entries or (None,):
            rooms.append(mint_room())
            _live_rooms.add(rooms[-1])
        pair.fields.update(prefill.protocol.pair_join(
            bootstrap_host(prefill), prefill.bootstrap_port, rooms if d_att.entries is not None else rooms[0]))
        try:
            built = await runner.worker_requests(p_att, d_att)
            if built is None:
                return []
            p_req, d_req = built
            runner.record_leg(p_att, p_req)
            runner.record_leg(d_att, d_req)
            # The decode's first event waits for the prefill's answer (the
            # legs' race, see the module docstring).
            gate = anyio.Event()
            result = _Prefill(runner.codec_state)
            retry_decode = False
            async with anyio.create_task_group() as tg:
                with anyio.CancelScope() as decode_scope:
                    tg.start_soon(_run_prefill, runner, result, prefill, p_att, p_req, gate, decode_scope)
                    retry_decode = await runner.run_client_leg(decode, d_att, d_req, gate)
                if p_att.live and (d_att.outcome != "finished" or runner.st.finish_reason == "abort"):
                    # No decode will take the prefill's KV: stop waiting for it
                    # (the leg stays live, so it is aborted).
                    tg.cancel_scope.cancel()
            return await _after_pair(runner, prefill, decode, result, retry_decode)
        finally:
            _live_rooms.difference_update(rooms)


async def _after_pair(runner: LegRunner, prefill: "Worker", decode: "Worker", result: _Prefill,
                      retry_decode: bool) -> "list[Worker]":
    """What a concurrent pair's end means for the request (see :meth:`Handshake.run`)."""
    st = runner.st
    if result.retry or result.error is not None:  # the decode leg sent nothing of this pair's
        await runner.abort_live_legs()
        if not st.response_started and not runner.pending:
            if result.retry:
                return [w for w, failed in ((prefill, True), (decode, retry_decode)) if failed]
            await _prefill_failed(runner, result)
        elif not st.response_complete:  # a resumed pair: the client has earlier attempts' tokens
            err = result.error or RequestError(502, "the prefill leg of a resumed pair failed", "engine")
            await runner.fail(err, "engine_error")
        return []
    if retry_decode:
        if st.response_started or runner.pending:
            if runner.moves.continuing:  # the decode leg died mid-answer: migrate
                await runner.abort_live_legs()
                return [decode]
            # The decode leg already answered the client (in part): no retry.
            if not st.response_complete:
                await runner.fail(RequestError(502, "a P/D leg failed mid-answer", "engine"), "engine_error")
            return []
        await runner.abort_live_legs()
        return [decode]
    return []


class SequentialPair:
    """Sequential legs under one engine id, joined by what the prefill leg
    answered (vLLM: ``kv_transfer_params``; see the module docstring)."""

    async def run(
        self, runner: LegRunner, workers: "tuple[Worker, ...]", role: str, backoff: float
    ) -> "list[Worker] | ClientLeg":
        """See :meth:`Handshake.run`: once the prefill leg answered, the
        decode leg, for the loop to run."""
        prefill, decode = workers
        resumes = list(runner.sent_ids) if role == "resumed" else None
        pair = Pair()
        engine_id = ids.mint()  # one id on both legs, as vLLM's proxies send it
        p_att = _attempt(engine_id, "prefill", prefill, backoff, resumes, pair)
        d_att = _attempt(engine_id, "decode", decode, backoff, resumes, pair)
        built = await runner.worker_requests(p_att)
        if built is None:
            return []
        runner.record_leg(p_att, built[0])
        result = _Prefill(runner.codec_state)
        await _run_prefill(runner, result, prefill, p_att, built[0])
        if result.retry or result.error is not None:
            await runner.abort_live_legs()
            if result.retry:
                return [prefill]
            await _prefill_failed(runner, result)
            return []
        try:
            try:
                d_req = runner.codec_state.worker_request(d_att)
            except RequestError as exc:
                if exc.kind != NO_KV_TRANSFER or not runner.ctx.settings.pd_fallback:
                    raise
                pair.local_prefill = True  # recorded: the decode worker prefills alone
                d_req = runner.codec_state.worker_request(d_att)
        except RequestError as exc:  # the prefill's answer cannot start a decode
            await runner.fail(exc, "engine_error")
            return []
        runner.record_leg(d_att, d_req)
        return ClientLeg(decode, d_att, d_req)


AGGREGATED = Aggregated()
CONCURRENT_PAIR = ConcurrentPair()
SEQUENTIAL_PAIR = SequentialPair()
#: The P/D handshakes, by ``WorkerProtocol.pd``.
PAIRS: dict[str, Handshake] = {"concurrent": CONCURRENT_PAIR, "sequential": SEQUENTIAL_PAIR}


def handshake(plan: "tuple[Worker, ...]") -> Handshake:
    """The handshake of a plan: :data:`AGGREGATED` for one worker, the
    protocol's pair handshake (``WorkerProtocol.pd``) for a prefill/decode pair."""
    return AGGREGATED if len(plan) == 1 else PAIRS[plan[0].protocol.pd]
