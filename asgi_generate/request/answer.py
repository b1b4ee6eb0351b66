"""The answer writer of one /generate request: its response writes and
the watch on its connection.

:class:`AnswerWriter` turns the normalized events of whatever legs serve a
request into the client's answer (unary body or SSE events, counted as
delivered once the server took them), ends an answer with the format's
error (its own status before the 200, in-band after it), and in
:meth:`AnswerWriter.guard` watches the client for disconnects, slow reads
and idle SSE (keep-alive comments). The attempt loop that feeds it, and
owns it, lives in :mod:`asgi_generate.request.generation`. A request with
items gives its writer its :class:`ItemShares` (a
:class:`~asgi_generate.request.batches.Batch`), which keeps each item's
share of what was written.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

import anyio
import orjson

from . import state
from .aborts import abort_live_legs
from ..sdk._codec import Codec, Event, Exchange, GenerateRequest, RequestError
from ..tracing.state import RequestState
from .framing import KEEPALIVE, SSE_HEADERS, Headers, Receive, Send, send_unary, sse_event, sse_parts

if TYPE_CHECKING:
    from .context import RequestContext


async def finish_record(ctx: "RequestContext", st: RequestState) -> None:
    """Hand ``st`` to the recorder exactly once per request (a request with
    items: each item's state, together, see :mod:`asgi_generate.request.batches`)."""
    if st.t_done is None:
        st.t_done = time.monotonic()
        ctx.open_requests.pop(st.request_id, None)
        ctx.recorder.request_ended(st)
        if st.expand is None:
            ctx.recorder.request_finished(st)
        else:
            await ctx.recorder.items_finished(st.expand())


async def send_in_band_error(codec: Codec, send: Send, st: RequestState, err: RequestError) -> None:
    """A refused streamed request, answered as the format's engine answers
    it: 200, then the in-band error event and the terminal marker."""
    st.stream = True
    state.fail(st, "rejected", 200, err.kind, err.message)
    st.response_started = True
    st.response_complete = True
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    body = sse_event(codec.in_band_error(err)) + codec.sse_terminal
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ItemShares(Protocol):
    """Each item's share of the answer of a request with items, kept as
    it is written (:class:`~asgi_generate.request.batches.Batch`)."""

    #: Held across each write: legs run at once share the client.
    write_lock: anyio.Lock
    #: An engine answered the request with its own error (not 200).
    refused: bool

    def tally(self, event: Event, timed: bool, gap: Callable[[float], None], stream: bool) -> None:
        """Each item's share of ``event``, credited once written."""

    def take_queued(self) -> Any:
        """The shares of the events about to be written, for :meth:`credit`."""

    def credit(self, taken: Any) -> None:
        """The write carrying ``taken`` was taken by the server."""

    def credit_unary(self) -> None:
        """The unary answer was written whole."""


class AnswerWriter:
    """One request's answer to its client, written from normalized events.

    Args:
        ctx: the process as the request sees it.
        codec: the request's format.
        codec_state: the codec's state of this request (its
            :class:`~asgi_generate.sdk.Exchange`), which renders the
            client's bytes.
        req: the decoded request.
        st: the request's state, whose answer fields this writer keeps.
        send: the ASGI send.
        items: for a request with items, the per-item accounting every
            write goes through; ``None`` for one prompt.
        scope: the cancel scope of the request's run, cancelled when its
            client goes away or is cut off (``None``: nothing to cancel).
        reset: the server's reset of the client's connection (the scope
            extension :data:`asgi_generate.request.watchdog.CONNECTION_RESET`),
            or ``None``.
    """

    __slots__ = (
        "ctx", "codec", "codec_state", "req", "st", "send", "pending", "in_send", "last_send",
        "scope", "shutdown", "write_timeout", "send_started", "timed", "outbox", "outbox_tokens",
        "gone", "sent_ids", "keepalive", "cutting_off", "gap", "reset", "items",
    )

    def __init__(
        self, ctx: "RequestContext", codec: Codec, codec_state: Exchange, req: GenerateRequest, st: RequestState,
        send: Send, items: ItemShares | None = None, scope: anyio.CancelScope | None = None,
        reset: Callable[[], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.codec = codec
        self.codec_state = codec_state
        self.req = req
        self.st = st
        self.send = send
        self.pending = 0
        self.in_send = False
        self.last_send = self.send_started = time.monotonic()
        self.timed = True
        self.outbox: list[bytes] = []
        self.outbox_tokens = 0
        self.scope = scope
        #: The server is shutting down: the request was cancelled for it.
        self.shutdown = False
        self.write_timeout = ctx.settings.slow_client_timeout
        #: A write failed because the client is gone (see :meth:`_write`).
        self.gone = False
        #: Every output token id received for the client, what a resumed
        #: attempt continues from; ``None`` when migration is off or the
        #: answer is unary (its engine leg shows no tokens before the end),
        #: or the request has items (a batch never migrates).
        self.sent_ids: list[int] | None = (
            [] if req.stream and ctx.settings.migration_limit > 0 and items is None else None)
        #: Seconds of silence before an SSE keep-alive comment (0 = none).
        self.keepalive = ctx.settings.sse_keepalive if req.stream else 0.0
        #: Set once a slow-client cut-off started by the watchdog is done.
        self.cutting_off: anyio.Event | None = None
        #: Counts the seconds between two token events (the ITL metric).
        self.gap = ctx.recorder.inter_token_latency(st.format)
        self.reset = reset
        #: Each item's share of the answer, for a request with items.
        self.items = items

    async def _write(self, message: dict) -> None:
        """Hand ``message`` to the server. A client is only ever owed the
        events of one worker read (at most 64 KiB of worker bytes);
        :meth:`guard` cuts off a client that leaves a write untaken too
        long."""
        if self.items is None:
            await self._write_now(message)
            return
        async with self.items.write_lock:  # legs run at once share the client
            await self._write_now(message)

    async def _write_now(self, message: dict) -> None:
        self.in_send = True
        self.send_started = time.monotonic()
        try:
            await self.send(message)
        except OSError:
            # ASGI: the server raises on a send to a closed connection (our
            # hypercorn does, asgi_generate.server.hypercorn.fixes): nothing of
            # ``message`` went out, so its tokens are not counted.
            self.gone = True
            state.end(self.st, "client_disconnect")
            if self.scope is not None:
                self.scope.cancel()
        finally:
            self.in_send = False
            self.last_send = time.monotonic()

    async def _send(self, body: bytes, more: bool) -> None:
        await self._write({"type": "http.response.body", "body": body, "more_body": more})

    async def _start_stream(self) -> None:
        if not self.st.response_started:
            self.st.response_started = True
            self.st.http_status = 200
            await self._write({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def _unary(self, status: int, body: bytes, headers: Headers = ()) -> None:
        st = self.st
        st.response_started = True
        st.http_status = status
        st.response_complete = True
        await send_unary(self._write, status, body, self.codec.content_type, headers)

    def _count(self, event: Event) -> bool:
        """The request's accounting of ``event`` (times, ids, usage, finish);
        whether it ends the answer."""
        st = self.st
        n = len(event.token_ids)
        if n:
            if self.timed:
                now = time.monotonic()
                if st.t_first_token is None:
                    st.t_first_token = now
                else:  # across legs too: a migration's stall is a gap
                    self.gap(now - st.t_last_token)
                st.t_last_token = now
            if self.sent_ids is not None:
                self.sent_ids += event.token_ids
            if self.ctx.recorder.trace_output_ids:  # only for a trace parser; default path skips it
                if st.output_ids is None:
                    st.output_ids = []
                st.output_ids.extend(event.token_ids)
        if event.completion_tokens is not None:
            st.engine_completion_tokens = event.completion_tokens
        if event.prompt_tokens is not None:
            st.prompt_tokens = event.prompt_tokens
        if event.cached_tokens is not None:
            st.cached_tokens = event.cached_tokens
        if event.error is not None:
            state.fail(st, "engine_error", None, "engine", event.error.message)
            return True
        if event.finish_reason is not None:
            st.finish_reason = event.finish_reason
            st.finish_matched = event.matched
            # A batch's finish is its leg's: each item's own is decided in its record (item_state).
            if event.finish_reason == state.ABORT and event.entries is None:
                state.engine_abort(st)
            return True
        return False

    def _queue(self, event: Event) -> None:
        """A streamed event's bytes into the outbox (sent by :meth:`flush`)."""
        data = self.codec_state.client_event(event)
        if type(data) is bytes:
            self.outbox.extend(sse_parts(data))
        elif data is not None:  # several payloads (Exchange.client_event)
            for part in data:
                self.outbox.extend(sse_parts(part))
        self.outbox_tokens += len(event.token_ids)

    def queue_without_await(self, event: Event) -> bool:
        """Count and queue a running stream's event that does not end it,
        with no await (O(1), the common case); ``False``: :meth:`deliver`
        must write it. Every event of a request with items goes through
        :meth:`deliver` (its items' tallies)."""
        if not self.st.response_started or not self.req.stream or event.error is not None \
                or event.finish_reason is not None or self.items is not None:
            return False
        self._count(event)
        self._queue(event)
        return True

    async def deliver(self, event: Event) -> None:
        """Count ``event`` and write it: a stream starts with its first
        event; its last one (a finish or an error) ends the answer, as does
        a unary answer's one event."""
        st = self.st
        items = self.items
        if items is not None:
            items.tally(event, self.timed, self.gap, self.req.stream)
        done = self._count(event)
        if self.req.stream:
            if not st.response_started:
                await self._start_stream()
            self._queue(event)
            if done:
                self.outbox.append(self.codec.sse_terminal)
                # Complete once the last bytes are handed over: a client that
                # hangs up as they arrive has not disconnected early.
                st.response_complete = True
                await self.flush(more=False)
        else:
            self.pending += len(event.token_ids)
            if done:
                status, body = self.codec_state.unary_body()
                if st.http_status is None:
                    st.http_status = status
                await self._unary(status, body)
                if not self.gone:
                    st.output_tokens = self.pending
        if done:
            state.finish_ok(st)
        if items is not None and not self.req.stream and st.response_complete and not self.gone \
                and st.http_status == 200:
            items.credit_unary()

    async def flush(self, more: bool = True) -> None:
        """Send every event decoded from one worker read in one write; count
        their tokens as delivered once the server took them (a write to a
        client that is gone raises in the server, see :meth:`_write`)."""
        body = b"".join(self.outbox) if len(self.outbox) > 1 else self.outbox[0]
        tokens = self.outbox_tokens
        self.outbox.clear()
        self.outbox_tokens = 0
        items = self.items
        queued = items.take_queued() if items is not None else None
        await self._send(body, more)
        if not self.gone:
            self.st.output_tokens += tokens
            if queued is not None:
                items.credit(queued)

    async def answer_worker_error(self, status: int, body: bytes, retry_after: bytes | None = None) -> None:
        """Answer the client with a worker's own non-200 answer (``status``,
        ``body``), as the codec renders it (:meth:`Exchange.worker_error`),
        with the worker's ``Retry-After`` when it sent one (an engine that
        is full says when to come back; the client's answer says it too)."""
        if self.items is not None:
            self.items.refused = True  # the engine refused the request as a whole
        if not 400 <= status < 600:  # a 1xx, 2xx or 3xx is no answer to a generate request (a 204 has no body)
            await self.fail(RequestError(502, f"worker answered {status} to a generate request", "bad_worker_answer"),
                            "engine_error")
            return
        status, body = self.codec_state.worker_error(status, body)
        ending = "engine_error" if status >= 500 else "rejected"
        if self.st.response_started:
            # A stream's keep-alive went out while the engine's head was due:
            # its error comes in-band, as any error after the 200.
            await self.fail(RequestError(status, _error_message(body), "engine"), ending)
            return
        state.fail(self.st, ending, status, "engine", body[:512].decode("utf-8", "replace"))
        await self._unary(status, body, () if retry_after is None else ((b"retry-after", retry_after),))

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

    async def fail(self, err: RequestError, status: str, cut: bool = False, headers: Headers = ()) -> None:
        """End the response with ``err``: its own status before the 200
        (with ``headers``, e.g. ``retry-after``), in-band after it; the
        request's ending is ``status``, the first failure recorded unless
        ``cut`` (:func:`asgi_generate.request.state.cut`). The record's
        ``http_status`` is the status sent."""
        st = self.st
        st.response_complete = True
        record = state.cut if cut else state.fail
        if not st.response_started:
            record(st, status, err.status, err.kind, err.message)
            # The one sent, also when an earlier failure (e.g. an engine's
            # error event in a unary answer) is the request's ending.
            st.http_status = err.status
            st.response_started = True
            await send_unary(self._write, err.status, self.codec.error_body(err), headers=headers)
        else:
            record(st, status, st.http_status, err.kind, err.message)
            self.outbox.append(sse_event(self.codec.in_band_error(err)) + self.codec.sse_terminal)
            await self.flush(more=False)

    async def guard(self, receive: Receive) -> None:
        """Watch the client for the whole request, in one task.

        - ``http.disconnect`` before the answer is complete makes the request
          a ``client_disconnect`` and cancels it (the handler then aborts
          every live engine leg): :meth:`client_gone`.
        - A write the client has left untaken for ``slow_client_timeout``
          seconds makes it a ``slow_client``: its connection is reset (with
          :attr:`reset`: the stuck write ends and what was queued for the
          client is dropped; without it, on hypercorn's trio worker, which
          shields its socket writes, the write ends only when the client
          reads or hangs up), the engine legs are aborted and the record
          handed over at once, then the request is cancelled.
        - With :attr:`keepalive` > 0, an SSE comment goes out after that
          many seconds of silence, committing to the 200 if nothing was
          sent yet.

        Waiting on ``receive()`` under a timeout loses nothing: ASGI servers
        hand messages over through cancellation-safe queues. Served by our
        hypercorn, the app's :class:`asgi_generate.request.watchdog.Watchdog` and a
        disconnect callback do the same without this task (:meth:`due`).
        """
        timeout = self.write_timeout
        while True:
            now = time.monotonic()
            action, wake = self.timers(now)
            if action is not None:
                await action()
                if action == self._cut_off_slow_client:
                    return
                continue
            # A write may start while we wait: look again within `timeout`.
            with anyio.move_on_after(max(0.01, min(wake - now, timeout))):
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.client_gone()
                    return

    def timers(self, now: float):
        """``(action due now or None, when to look again)`` for the
        slow-client cut-off and the keep-alive comments."""
        timeout = self.write_timeout
        if self.in_send:
            wake = self.send_started + timeout
            return (self._cut_off_slow_client if now >= wake else None), wake
        if self.keepalive > 0 and not self.st.response_complete:
            wake = self.last_send + self.keepalive
            return (self._keepalive if now >= wake else None), min(wake, now + timeout)
        return None, now + timeout

    def due(self, now: float, spawn) -> float | None:
        """The guard's timers, for :class:`asgi_generate.request.watchdog.Watchdog`:
        starts what is due at ``now`` with ``spawn``; when to look again,
        ``None`` once cut off."""
        action, wake = self.timers(now)
        if action is None:
            return wake
        if action == self._cut_off_slow_client:
            self.cutting_off = anyio.Event()
            spawn(action)
            return None
        spawn(action)
        # The comment's write starts within a turn of the loop; a stuck one
        # is found by the in-send check at most `write_timeout` later.
        return now + min(self.keepalive, self.write_timeout)

    def client_gone(self) -> None:
        """The client's connection closed: before the answer is complete,
        the request is a ``client_disconnect`` (a slow client stays one: the
        cut-off's reset closes its connection) and is cancelled."""
        if not self.st.response_complete:
            if self.st.status != "slow_client":  # else closed by the cut-off's own reset
                state.client_left(self.st)
            if self.scope is not None:
                self.scope.cancel()

    async def _keepalive(self) -> None:
        # Started by the watchdog a turn of the loop ago: the answer may
        # have ended or a write begun since.
        if self.in_send or self.scope is None or self.scope.cancel_called:
            return
        if not self.st.response_complete:
            await self._start_stream()
        if not self.st.response_complete:
            await self._send(KEEPALIVE, True)

    async def _cut_off_slow_client(self) -> None:
        st = self.st
        state.cut(st, "slow_client", st.http_status, "slow_client",
                  f"client left a write untaken for {self.write_timeout:g} s")
        if self.reset is not None:
            self.reset()  # the stuck write ends now, and with it the leg's hold on its worker
        try:
            with anyio.CancelScope(shield=True):
                await abort_live_legs(self.ctx, st)
            await finish_record(self.ctx, st)
            if self.scope is not None:
                self.scope.cancel()
        finally:
            if self.cutting_off is not None:
                self.cutting_off.set()


def _error_message(body: bytes) -> str:
    """The message of an error body in a format's shape (SGLang's
    ``{"message": ...}``, vLLM's ``{"error": {"message": ...}}``), else
    its first 512 bytes as text."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        inner = doc.get("error")
        message = inner.get("message") if isinstance(inner, dict) else doc.get("message")
        if isinstance(message, str):
            return message
    return body[:512].decode("utf-8", "replace")
