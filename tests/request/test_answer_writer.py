"""The client's answer (asgi_generate/request/answer.py) in process:
the exact ASGI messages of an SSE stream and of a unary answer, what counts
as delivered, errors after the first byte, a client that hangs up, and the
guard's timers (keep-alive comments, the slow-client cut-off)."""

from __future__ import annotations

import anyio
import orjson
import pytest

from asgi_generate.request.answer import AnswerWriter, send_in_band_error
from asgi_generate.request.framing import KEEPALIVE, SSE_HEADERS
from asgi_generate.tracing.state import LegRecord
from asgi_generate.sdk._codec import RequestError
from asgi_generate.tracing.state import RequestState
from asgi_generate_sglang import SGLangCodec
from fakes import FakeContext
from test_context import _router
from test_legs import answer, anyio_backend  # noqa: F401  (the fixture: both backends)


class Answer:
    """An :class:`AnswerWriter` for an SGLang ``body``, its ASGI sends in
    :attr:`out`, fed worker chunks of one aggregated attempt."""

    def __init__(self, body: dict, gone_after: int | None = None, **settings) -> None:
        codec = SGLangCodec()
        self.codec = codec
        self.req = codec.decode(orjson.dumps(body), {})
        self.st = RequestState("r" * 32, codec.name, "/generate", "POST")
        self.ctx = FakeContext(_router(), **settings)
        self.out: list[dict] = []
        self.gone_after = gone_after
        self.stream = AnswerWriter(self.ctx, codec, codec.exchange(self.req, self.st.request_id), self.req,
                                   self.st, self.send)
        self.attempt = LegRecord("e0", "aggregated", "w0", {}, worker=self.ctx.router.workers[0])
        self.stream.codec_state.worker_request(self.attempt)

    async def send(self, message: dict) -> None:
        if self.gone_after is not None and len(self.out) >= self.gone_after:
            raise OSError("the client closed the connection")
        self.out.append(message)

    async def feed(self, chunk: dict) -> None:
        """One worker read of one chunk, as the leg runner hands it over:
        queued while the stream runs, else delivered; then flushed."""
        event = self.stream.codec_state.feed(self.attempt, orjson.dumps(chunk))
        if not self.stream.queue_without_await(event):
            await self.stream.deliver(event)
        if self.stream.outbox:
            await self.stream.flush()


def body(data: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


C1 = answer([5], None)
C2 = answer([5, 6], None)
C3 = answer([5, 6, 7], {"type": "length", "length": 3})


def event(chunk: dict) -> bytes:
    meta = {**chunk["meta_info"], "id": "mine"}
    return b"data: " + orjson.dumps({**chunk, "meta_info": meta}) + b"\n\n"


@pytest.mark.anyio
async def test_a_stream_is_one_sse_start_then_an_event_per_chunk_and_the_terminal_marker():
    a = Answer({"input_ids": [1, 2], "rid": "mine", "stream": True})
    for chunk in (C1, C2, C3):
        await a.feed(chunk)
    assert a.out == [{"type": "http.response.start", "status": 200, "headers": SSE_HEADERS},
                     body(event(C1)), body(event(C2)), body(event(C3) + b"data: [DONE]\n\n", more=False)]
    assert (a.st.status, a.st.http_status, a.st.output_tokens, a.st.finish_reason) == ("ok", 200, 3, "length")
    assert (a.st.response_started, a.st.response_complete) == (True, True)
    assert a.stream.sent_ids == [5, 6, 7]  # what a migration would resume from


@pytest.mark.anyio
async def test_a_unary_answer_is_one_start_with_its_length_and_one_body():
    a = Answer({"input_ids": [1, 2], "rid": "mine"})
    await a.feed(C3)
    whole = orjson.dumps({**C3, "meta_info": {**C3["meta_info"], "id": "mine"}})
    assert a.out == [{"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(whole)).encode())]},
        body(whole, more=False)]
    assert (a.st.status, a.st.output_tokens, a.stream.sent_ids) == ("ok", 3, None)


@pytest.mark.anyio
async def test_tokens_a_gone_client_never_took_are_not_counted():
    a = Answer({"input_ids": [1, 2], "rid": "mine", "stream": True}, gone_after=2)
    await a.feed(C1)
    await a.feed(C2)
    assert a.out == [{"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}, body(event(C1))]
    assert (a.stream.gone, a.st.status, a.st.output_tokens) == (True, "client_disconnect", 1)


@pytest.mark.anyio
async def test_an_engine_error_after_the_first_byte_goes_in_band_with_the_200_kept():
    a = Answer({"input_ids": [1, 2], "rid": "mine", "stream": True})
    await a.feed(C1)
    await a.stream.fail(RequestError(502, "worker w0 failed", "engine"), "engine_error")
    assert a.out[1:] == [body(event(C1)), body(
        b'data: {"error":{"message":"worker w0 failed","type":"502","code":502}}\n\ndata: [DONE]\n\n', more=False)]
    assert (a.st.status, a.st.http_status, a.st.error_type, a.st.output_tokens) == ("engine_error", 200, "engine", 1)


@pytest.mark.anyio
async def test_a_refused_stream_is_a_200_with_the_in_band_error():
    a = Answer({"input_ids": [1, 2], "rid": "mine", "stream": True})
    await send_in_band_error(a.codec, a.send, a.st, RequestError(400, "max_new_tokens is negative", "invalid"))
    assert a.out == [{"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}, body(
        b'data: {"error":{"message":"max_new_tokens is negative"}}\n\ndata: [DONE]\n\n', more=False)]
    assert (a.st.status, a.st.http_status, a.st.stream, a.st.response_complete) == ("rejected", 200, True, True)


def test_the_timers_keep_alive_an_idle_stream_and_cut_off_a_write_left_untaken():
    a = Answer({"input_ids": [1], "stream": True}, sse_keepalive=5, slow_client_timeout=30)
    s = a.stream
    s.last_send = 100.0
    assert s.timers(101.0) == (None, 105.0)
    assert s.timers(105.0) == (s._keepalive, 105.0)
    s.in_send, s.send_started = True, 200.0
    assert s.timers(229.0) == (None, 230.0)
    assert s.timers(230.0) == (s._cut_off_slow_client, 230.0)
    s.in_send, a.st.response_complete = False, True
    assert s.timers(300.0) == (None, 330.0)  # answered: only the slow-client watch is left


def test_a_unary_request_gets_no_keep_alive():
    a = Answer({"input_ids": [1]}, sse_keepalive=5, slow_client_timeout=30)
    a.stream.last_send = 100.0
    assert (a.stream.keepalive, a.stream.timers(200.0)) == (0.0, (None, 230.0))


@pytest.mark.anyio
async def test_a_keep_alive_comment_commits_to_the_200():
    a = Answer({"input_ids": [1], "stream": True}, sse_keepalive=5)
    with anyio.CancelScope() as a.stream.scope:
        await a.stream._keepalive()
    assert a.out == [{"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}, body(KEEPALIVE)]
    assert (a.st.response_started, a.st.output_tokens) == (True, 0)


@pytest.mark.anyio
async def test_the_guard_cancels_the_request_when_the_client_hangs_up():
    a = Answer({"input_ids": [1], "stream": True})
    messages = [{"type": "http.disconnect"}]

    async def receive() -> dict:
        return messages.pop()

    with anyio.fail_after(5), anyio.CancelScope() as a.stream.scope:
        await a.stream.guard(receive)
    assert a.stream.scope.cancel_called
    assert (a.st.status, a.out) == ("client_disconnect", [])
