"""The shared /generate handler: one anyio task group per request.

For every registered format::

    reserve room in the body budget (bounded wait, else 503)
    read body (size-capped, within the body-read deadline) -> codec.decode
        (large bodies in a worker thread) -> GenerateRequest
    pick a worker -> attempt -> stream worker events -> codec -> client
    watch the client the whole time: a guard task on receive() for
        http.disconnect, or (under our hypercorn) a disconnect callback
        and the app's shared watchdog for the timers
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
from typing import TYPE_CHECKING, Callable

import anyio

from ..sdk import _ids as ids
from . import state
from .budget import Lease
from .aborts import abort_live_legs
from .answer import finish_record, send_in_band_error
from ..sdk._codec import Codec, GenerateRequest, RequestError
from ..tracing.state import RequestState
from ..exceptions import BodyTimeout, BodyTooLarge, ClientDisconnected
from .framing import Receive, Send, read_body, send_unary
from .batches import Batch
from .admission import Entry
from .gate import Parking, cut_at_deadline
from .generation import Generation
from .watchdog import CONNECTION_RESET, DISCONNECT_WATCH, RECEIVE_NOWAIT

if TYPE_CHECKING:
    from .context import RequestContext

log = logging.getLogger(__name__)
#: Bodies from this size on are decoded in a worker thread (1 MiB: about
#: 10 ms of parsing; smaller ones cost less than the thread hop).
DECODE_THREAD_BYTES = 1 << 20
#: Sent with every answer given before the body was read: the unread body
#: makes the connection unusable for another request.
CLOSE = [(b"connection", b"close")]
RETRY_AFTER = b"1"


async def handle_generate(ctx: "RequestContext", codec: Codec, scope: dict, receive: Receive, send: Send) -> None:
    """Serve one request on a codec's route; always leaves one RequestState."""
    st = RequestState(ids.mint(), codec.name, scope["path"], scope["method"])
    ctx.recorder.request_started()
    ctx.open_requests[st.request_id] = st
    try:
        admitted = await _admit(ctx, codec, scope, receive, send, st)
        if admitted is not None:  # run from here: one coroutine frame fewer per open stream
            request, lease = admitted
            admitted = None
            _note_request(st, request)
            entry = parking = None
            try:
                if ctx.admission is not None:
                    go, entry = await _queue(ctx, codec, request, scope, receive, send, st, lease)
                    if not go:
                        return
                if entry is not None:
                    parking = ctx.admission.parking(entry, st, lambda: abort_live_legs(ctx, st))
                if entry is not None and entry.ask.deadline is not None:
                    await _generate_until(ctx, codec, request, scope, receive, send, st, lease, entry.ask.deadline,
                                          parking)
                else:
                    await _generate(ctx, codec, request, scope, receive, send, st, lease, parking)
            finally:
                lease.release()
                if parking is not None:  # a preempted stream holds the slot it was given back
                    parking.done()
                    ctx.admission.release(parking.entry, st, parking.output_before)
                elif entry is not None:  # every ending: finished, aborted, disconnected, migrated, shut down
                    ctx.admission.release(entry, st)
    except OSError:  # an error answer's write: the client is gone (ASGI send exception)
        state.client_left(st)
    except Exception as exc:  # a bug: answer 500 rather than drop the client
        log.exception("request %s failed", st.request_id)
        state.fail(st, "engine_error", 500, "internal", repr(exc))
        if not st.response_started:
            with anyio.CancelScope(shield=True):
                await _send_error(codec, send, st, RequestError(500, "internal error", "internal"))
    finally:
        if any(a.live for a in st.attempts):  # most requests end with none: no scope to enter
            with anyio.CancelScope(shield=True):
                await abort_live_legs(ctx, st)
        state.end(st, "shutdown")  # unless it ended: cancelled from outside, e.g. server shutdown
        await finish_record(ctx, st)
        ctx.body_budget.trim_if_idle()  # the request's body and objects are gone now


async def reject_method(ctx: "RequestContext", codec: Codec, scope: dict, allowed: list[str], send: Send) -> None:
    """405 on a registered path with the wrong method, in the format's shape."""
    st = RequestState(ids.mint(), codec.name, scope["path"], scope["method"])
    ctx.recorder.request_started()
    st.headers = dict(scope["headers"])
    err = RequestError(405, "Method Not Allowed", "method_not_allowed")
    try:
        await _send_error(codec, send, st, err, [(b"allow", ", ".join(allowed).encode())])
    except OSError:  # the client is gone (ASGI send exception)
        state.client_left(st)
    finally:
        await finish_record(ctx, st)


async def _send_error(
    codec: Codec, send: Send, st: RequestState, err: RequestError, headers: list | None = None,
    outcome: str | None = None,
) -> None:
    if outcome is None:
        outcome = "shutdown" if err.kind == "shutdown" else "unavailable" if err.status == 503 else "rejected"
    state.fail(st, outcome, err.status, err.kind, err.message)
    st.http_status = err.status  # the one sent, whichever failure came first
    st.response_started = True
    st.response_complete = True
    await send_unary(send, err.status, codec.error_body(err), headers=headers or ())


async def _admit(
    ctx: "RequestContext", codec: Codec, scope: dict, receive: Receive, send: Send, st: RequestState
) -> tuple[GenerateRequest, Lease] | None:
    """The decoded request and its share of the body budget; ``None`` once
    the client was answered (or left)."""
    headers = dict(scope["headers"])
    st.headers = headers
    settings = ctx.settings
    try:
        declared = headers.get(b"content-length")
        length = int(declared) if declared is not None else None
    except ValueError:
        await _send_error(codec, send, st, RequestError(400, "invalid content-length header"), CLOSE)
        return None
    if length is not None and length > settings.max_body_bytes:
        # Refused before the first receive(), unread: the connection cannot
        # be reused, so say it closes.
        err = RequestError(413, str(BodyTooLarge(settings.max_body_bytes)), "too_large")
        await _send_error(codec, send, st, err, CLOSE)
        return None
    lease = await ctx.body_budget.reserve(
        settings.max_body_bytes if length is None else length, settings.body_budget_wait
    )
    if lease is None:
        err = RequestError(503, "too many request bodies in flight; retry later", "busy")
        await _send_error(codec, send, st, err, [(b"retry-after", RETRY_AFTER), *CLOSE])
        return None
    request = None
    try:
        nowait = scope.get("extensions", {}).get(RECEIVE_NOWAIT)
        request = await _read_and_decode(ctx, codec, receive, send, st, headers, length, nowait)
    finally:
        if request is None:
            lease.release()
    return None if request is None else (request, lease)


def _note_request(st: RequestState, request: GenerateRequest) -> None:
    """What the record keeps of the decoded request."""
    st.public_id = request.public_id
    st.stream = request.stream
    # The packed ids, when the codec made them: no list of ints kept for the trace.
    packed = request.input_ids_packed
    st.input_ids = request.input_ids if packed is None else packed.u32
    st.input_length = len(request.input_ids) if request.input_ids is not None else None
    st.replay_excluded = request.replay_excluded
    st.model = request.model


async def _queue(
    ctx: "RequestContext", codec: Codec, request: GenerateRequest, scope: dict, receive: Receive, send: Send,
    st: RequestState, lease: Lease,
) -> tuple[bool, Entry | None]:
    """Wait for admission (:mod:`asgi_generate.request.gate`): whether the
    request goes on, and its slot (``None``: it holds none, its protocol
    having no worker up). A shed request is answered in its format's error
    shape (429 with ``Retry-After``, or 503), a client that leaves while
    queued is recorded as gone; neither holds anything after."""
    admission = ctx.admission
    protocol = codec.worker_protocol
    if admission.bypass(protocol):
        return True, None
    try:
        ask = admission.ask(protocol, request, st)
    except RequestError as exc:
        await _send_error(codec, send, st, exc)
        return False, None
    # The decoded request waits under the queue's own byte bound from here.
    lease.release()
    watch = scope.get("extensions", {}).get(DISCONNECT_WATCH)
    with anyio.CancelScope() as gone:
        if watch is not None:
            watch(gone.cancel)
            try:
                entry = await admission.admit(ask)
            finally:
                watch(None)
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_disconnect, receive, gone)
                entry = await admission.admit(ask)
                tg.cancel_scope.cancel()
    if gone.cancelled_caught:
        state.client_left(st)
        return False, None
    if entry.unit is not None:
        st.queue_s = entry.waited if entry.granted else admission.clock() - entry.arrived
    refusal = entry.refusal
    if refusal is None:
        return True, entry
    if refusal.reason == "shutdown":
        await _send_error(codec, send, st, RequestError(503, refusal.message, "shutdown"))
        return False, None
    st.shed_reason = refusal.reason
    headers = [(b"retry-after", b"%d" % refusal.retry_after)] if refusal.retry_after is not None else []
    await _send_error(codec, send, st, RequestError(refusal.status, refusal.message, refusal.reason), headers,
                      outcome="shed")
    return False, None


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` when the client leaves (its body was read: the next
    message is its disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _generate_until(
    ctx: "RequestContext", codec: Codec, request: GenerateRequest, scope: dict, receive: Receive, send: Send,
    st: RequestState, lease: Lease, deadline: float, parking: Parking | None = None,
) -> None:
    """:func:`_generate`, cut at ``deadline`` if still running (:func:`cut_at_deadline`)."""
    async with anyio.create_task_group() as tg:
        def cut() -> None:
            ctx.admission.deadline_cuts += 1

        tg.start_soon(cut_at_deadline, st, deadline, lambda: abort_live_legs(ctx, st), cut)
        await _generate(ctx, codec, request, scope, receive, send, st, lease, parking)
        tg.cancel_scope.cancel()


async def _read_and_decode(
    ctx: "RequestContext", codec: Codec, receive: Receive, send: Send, st: RequestState, headers: dict,
    length: int | None, receive_nowait: Callable[[], dict | None] | None = None,
) -> GenerateRequest | None:
    """The decoded request, or ``None`` once the client was answered (or left)."""
    settings = ctx.settings
    ctx.body_budget.reading += 1
    try:
        body = await read_body(receive, settings.max_body_bytes, length, settings.body_read_timeout, receive_nowait)
    except BodyTooLarge as exc:
        await _send_error(codec, send, st, RequestError(413, str(exc), "too_large"), CLOSE)
        return None
    except BodyTimeout:
        err = RequestError(408, f"request body not received within {settings.body_read_timeout:g} s", "body_timeout")
        await _send_error(codec, send, st, err, CLOSE)
        return None
    except ClientDisconnected:
        state.client_left(st)
        return None
    finally:
        ctx.body_budget.reading -= 1
    st.body_bytes = len(body)
    if ctx.shutting_down:
        await _send_error(codec, send, st, RequestError(503, "server is shutting down", "shutdown"))
        return None
    try:
        if len(body) < DECODE_THREAD_BYTES:
            return codec.decode(body, headers)
        # orjson holds the GIL while it parses, but the codec's checks after
        # it are Python and let the event loop in; one big decode at a time
        # keeps every stall of the loop to one parse.
        return await anyio.to_thread.run_sync(codec.decode, body, headers, limiter=ctx.body_budget.decode_limiter)
    except RequestError as exc:
        if exc.in_band:
            await send_in_band_error(codec, send, st, exc)
        else:
            await _send_error(codec, send, st, exc)
        return None


async def _generate(
    ctx: "RequestContext", codec: Codec, request: GenerateRequest, scope: dict, receive: Receive, send: Send,
    st: RequestState, lease: Lease, parking: Parking | None = None,
) -> None:
    extensions = scope.get("extensions", {})
    watch = extensions.get(DISCONNECT_WATCH)
    inline = watch is not None and ctx.watchdog.running
    # Under our hypercorn the request runs in a scope of its own; else in
    # its guard's task group, inside this scope (_run_guarded).
    run_scope = anyio.CancelScope()
    batch = None if request.items is None else Batch(request.items, st)
    gen = Generation(ctx, codec, codec.exchange(request, st.request_id), request, st, send,
                     batch=batch, lease=lease, scope=run_scope, reset=extensions.get(CONNECTION_RESET))
    gen.parking = parking
    writer = gen.writer
    if inline:
        # No task of its own (inline here: one coroutine frame fewer per open
        # stream): the server calls AnswerWriter.client_gone when the
        # client's connection closes, and the app's watchdog keeps its
        # timers (see asgi_generate.request.watchdog).
        with run_scope:
            ctx.inflight[st.request_id] = gen
            key = ctx.watchdog.watch(writer, writer.timers(time.monotonic())[1])
            try:
                watch(writer.client_gone)
                await gen.run()
            finally:
                watch(None)
                ctx.watchdog.forget(key)
                del ctx.inflight[st.request_id]
        if writer.cutting_off is not None:  # the record is the cut-off's to write
            with anyio.CancelScope(shield=True):
                await writer.cutting_off.wait()
    else:
        await _run_guarded(ctx, gen, receive)
    if writer.shutdown and not st.response_complete:
        # The grace period ran out: end the answer cleanly, in-band if begun.
        await writer.fail(RequestError(503, "server is shutting down", "shutdown"), "shutdown", cut=True)


async def _run_guarded(ctx: "RequestContext", gen: Generation, receive: Receive) -> None:
    """Run ``gen`` beside its guard task, which watches ``receive()``; the
    writer's scope cancels both."""
    with gen.writer.scope:
        async with anyio.create_task_group() as tg:
            ctx.inflight[gen.st.request_id] = gen
            try:
                tg.start_soon(gen.writer.guard, receive)
                await gen.run()
                tg.cancel_scope.cancel()
            finally:
                del ctx.inflight[gen.st.request_id]
