"""The request package on its own: Generation, its AnswerWriter and
its Batch driven through a small fake :class:`RequestContext` (no
App, no server, no socket), and the narrow protocols checked against what
the process hands over."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Protocol

import anyio
import orjson
import pytest

from asgi_generate.config import Settings
from asgi_generate.tracing.state import RequestState
from asgi_generate.request.aborts import abort_live_legs
from asgi_generate.request.answer import AnswerWriter, finish_record
from asgi_generate.request.batches import Batch
from asgi_generate.request.budget import BodyBudget
from asgi_generate.request.context import RequestContext
from asgi_generate.request.generation import Generation
from asgi_generate.request.migrations import MigrationSlots
from asgi_generate.request.watchdog import Watchdog
from asgi_generate.tracing.state import LegRecord
from asgi_generate.sdk._codec import RequestError
from asgi_generate.workers.router import Router
from asgi_generate_sglang.codec import SGLangCodec
from fakes import AnsweringPool, FakeContext

SGLANG_URL = "http://127.0.0.1:9"  # never dialled: the fake pool answers


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _router(answer=None) -> Router:
    """A router with one SGLang worker: up with ``answer``'s pool, else
    down (never probed)."""
    router = Router([("sglang", SGLANG_URL)])
    if answer is not None:
        worker = router.workers[0]
        worker.healthy = True
        worker.pool = AnsweringPool(answer)
    return router


def _sse(chunks: list[dict]) -> list[bytes]:
    return [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


def _streamed(sent: dict) -> tuple[int, list[bytes]]:
    """SGLang's cumulative stream of three tokens for ``sent``'s ``rid``."""
    rid = sent["rid"]
    meta = {"id": rid, "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 0, "cached_tokens": 0}
    chunks = []
    for n in (1, 2, 3):
        done = {"type": "length", "length": 3} if n == 3 else None
        chunks.append({"text": "abc"[:n], "output_ids": [7, 8, 9][:n],
                       "meta_info": {**meta, "finish_reason": done, "completion_tokens": n}})
    return 200, _sse(chunks)


def generation(ctx, codec, req, st: RequestState, send) -> Generation:
    """The attempt loop of ``req``, given its :class:`Batch` when it has items (as the handler builds it)."""
    batch = None if req.items is None else Batch(req.items, st)
    return Generation(ctx, codec, codec.exchange(req, st.request_id), req, st, send, batch=batch)


async def _serve(ctx: FakeContext, body: dict, request_id: str = "r" * 32):
    """Run one request through its :class:`Generation` on ``ctx``: the
    messages its client got and its finished state."""
    codec = SGLangCodec()
    req = codec.decode(orjson.dumps(body), {b"content-type": b"application/json"})
    st = RequestState(request_id, codec.name, "/generate", "POST")
    st.stream = req.stream
    out: list[dict] = []

    async def send(message: dict) -> None:
        out.append(message)

    gen = generation(ctx, codec, req, st, send)
    with anyio.fail_after(5):
        await gen.run()
    await finish_record(ctx, st)
    return out, st


def _error_answer(status: int, message: bytes, length: int, headers: tuple = ()) -> list[dict]:
    """The ASGI messages of SGLang's unary error answer (its FastAPI shape),
    with ``headers`` after its own."""
    body = b'{"object":"error","message":"%s","type":"%d","param":null,"code":%d}' % (message, status, status)
    return [
        {"type": "http.response.start", "status": status,
         "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % length), *headers]},
        {"type": "http.response.body", "body": body, "more_body": False},
    ]


@pytest.mark.e2e
def test_the_request_modules_import_without_the_server_or_ops():
    code = ("import sys, asgi_generate.request.generation, asgi_generate.request.answer, "
            "asgi_generate.request.batches; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('asgi_generate.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["['config',", "'exceptions',", "'hashes',", "'protocols',", "'request',", "'sdk',", "'tracing',",
                                  "'worker_specs',", "'workers']"]


@pytest.mark.anyio
async def test_generation_with_no_healthy_worker_answers_503_saying_when_to_retry():
    ctx = FakeContext(_router(), health_interval=2.5)
    out, st = await _serve(ctx, {"input_ids": [1, 2, 3]})
    # The health probe interval, in whole seconds: when a worker may be back.
    assert out == _error_answer(503, b"no healthy worker for protocol 'sglang'", 107, ((b"retry-after", b"3"),))
    assert (st.status, st.http_status, st.error_type, st.attempts) == ("unavailable", 503, "unavailable", [])
    assert ctx.recorder.calls == ["ended", ("finished", "r" * 32, "unavailable", 0)]


@pytest.mark.anyio
async def test_generation_streams_a_workers_sse_and_counts_its_tokens():
    ctx = FakeContext(_router(_streamed))
    out, st = await _serve(ctx, {"input_ids": [1, 2, 3], "stream": True, "rid": "client-1"})
    assert out[0] == {"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]}
    assert b"".join(m["body"] for m in out[1:]) == (
        b'data: {"text":"a","output_ids":[7],"meta_info":{"id":"client-1","finish_reason":null,'
        b'"prompt_tokens":3,"completion_tokens":1,"cached_tokens":0}}\n\n'
        b'data: {"text":"ab","output_ids":[7,8],"meta_info":{"id":"client-1","finish_reason":null,'
        b'"prompt_tokens":3,"completion_tokens":2,"cached_tokens":0}}\n\n'
        b'data: {"text":"abc","output_ids":[7,8,9],"meta_info":{"id":"client-1","finish_reason":'
        b'{"type":"length","length":3},"prompt_tokens":3,"completion_tokens":3,"cached_tokens":0}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert [m["more_body"] for m in out[1:]] == [True, True, False]
    (attempt,) = st.attempts
    assert (st.status, st.http_status, st.output_tokens, st.finish_reason) == ("ok", 200, 3, "length")
    assert (attempt.role, attempt.outcome, attempt.tokens, attempt.live) == ("aggregated", "finished", 3, False)
    assert ctx.router.workers[0].pool.sent[0]["rid"] == attempt.engine_id != "client-1"
    assert ctx.aborted == [] and ctx.router.workers[0].inflight == set()


@pytest.mark.anyio
async def test_client_stream_ends_before_and_after_the_200_and_aborts_live_legs():
    codec = SGLangCodec()
    req = codec.decode(b'{"input_ids":[1],"stream":true}', {})
    ctx = FakeContext(_router())
    out: list[dict] = []

    async def send(message: dict) -> None:
        out.append(message)

    st = RequestState("s" * 32, codec.name, "/generate", "POST")
    stream = AnswerWriter(ctx, codec, codec.exchange(req, st.request_id), req, st, send)
    assert (stream.write_timeout, stream.keepalive, stream.sent_ids) == (30.0, 0.0, [])
    await stream.fail(RequestError(504, "worker w0 sent no token within 1 s", "timeout"), "timeout")
    assert out == _error_answer(504, b"worker w0 sent no token within 1 s", 102)
    assert (st.status, st.http_status, st.error_type) == ("timeout", 504, "timeout")

    out.clear()
    st = RequestState("t" * 32, codec.name, "/generate", "POST")
    stream = AnswerWriter(ctx, codec, codec.exchange(req, st.request_id), req, st, send)
    st.response_started, st.http_status = True, 200
    await stream.fail(RequestError(502, "worker w0 failed", "engine"), "engine_error")
    assert out == [{"type": "http.response.body", "more_body": False, "body":
                    b'data: {"error":{"message":"worker w0 failed","type":"502","code":502}}\n\ndata: [DONE]\n\n'}]
    assert (st.status, st.http_status, st.response_complete) == ("engine_error", 200, True)

    worker = ctx.router.workers[0]
    st.attempts = [LegRecord("a" * 32, "aggregated", "w0", worker=worker, live=True),
                   LegRecord("b" * 32, "decode", "w0", worker=worker, live=False)]
    ctx.open_requests[st.request_id] = st
    await abort_live_legs(ctx, st)
    await finish_record(ctx, st)
    await finish_record(ctx, st)  # once per request
    assert ctx.aborted == [("w0", "a" * 32)]
    assert [(a.live, a.abort_acked, a.outcome) for a in st.attempts] == [(False, True, "aborted"), (False, None, None)]
    assert ctx.open_requests == {}
    assert ctx.recorder.calls == ["ended", ("finished", "t" * 32, "engine_error", 0)]


def _batch_answer(sent: dict) -> tuple[int, list[bytes]]:
    """SGLang's unary answer to a batch of two prompts: two and one tokens."""
    answers = [{"text": "xy"[:n], "output_ids": [5, 6][:n], "meta_info": {
        "id": rid, "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 2,
        "completion_tokens": n, "cached_tokens": 0}} for rid, n in zip(sent["rid"], (2, 1))]
    return 200, [orjson.dumps(answers)]


@pytest.mark.anyio
async def test_batch_generation_answers_in_item_order_and_records_each_item():
    ctx = FakeContext(_router(_batch_answer))
    body = {"input_ids": [[1, 2], [3, 4]], "rid": ["first", "second"]}
    out, st = await _serve(ctx, body, request_id="b" * 32)
    (sent,) = ctx.router.workers[0].pool.sent
    assert out[0]["status"] == 200
    assert orjson.loads(out[1]["body"]) == [
        {"text": "xy", "output_ids": [5, 6], "meta_info": {"id": "first", "finish_reason": {
            "type": "length", "length": 2}, "prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 0}},
        {"text": "x", "output_ids": [5], "meta_info": {"id": "second", "finish_reason": {
            "type": "length", "length": 1}, "prompt_tokens": 2, "completion_tokens": 1, "cached_tokens": 0}},
    ]
    items = ctx.recorder.records
    assert [(s.batch_id, s.batch_index, s.batch_size, s.public_id) for s in items] == [
        ("b" * 32, 0, 2, "first"), ("b" * 32, 1, 2, "second")]
    assert [(s.status, s.http_status, s.output_tokens, s.finish_reason, s.prompt_tokens) for s in items] == [
        ("ok", 200, 2, "length", 2), ("ok", 200, 1, "length", 2)]
    assert [[(a.engine_id, a.outcome, a.tokens) for a in s.attempts] for s in items] == [
        [(sent["rid"][0], "finished", 2)], [(sent["rid"][1], "finished", 1)]]
    assert ctx.recorder.calls[0] == "ended" and len(ctx.recorder.calls) == 3


def _members(protocol: type) -> set[str]:
    """The attributes and methods ``protocol`` declares, its protocol bases' included."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
            continue
        names |= set(cls.__dict__.get("__annotations__", {}))
        names |= {n for n, v in vars(cls).items()
                  if (inspect.isfunction(v) or isinstance(v, property)) and not n.startswith("__")}
    return names


def _protocols_and_their_implementations():
    from asgi_generate.ops.fanout import AdminContext
    from asgi_generate.request.context import Recorder, Running
    from asgi_generate.request.answer import ItemShares
    from asgi_generate.request.batches import BatchLoop
    from asgi_generate.request.handshakes import LegRunner
    from asgi_generate.request.legs import LegReader
    from asgi_generate.server.app import App
    from asgi_generate.sim.app import SimApp
    from asgi_generate.sim.sglang_batch import BatchHost
    from asgi_generate.workers.policies import Candidate

    app = App(Settings(embedded_workers=0), codecs=[])
    return [
        (RequestContext, app), (AdminContext, app), (Recorder, app.recorder),
        (Running, Generation), (LegRunner, Generation), (LegReader, Generation), (BatchLoop, Generation),
        (ItemShares, Batch), (Candidate, _router().workers[0]),
        (BatchHost, SimApp("sglang").protocol),
    ]


def test_what_the_process_hands_over_has_every_member_of_its_protocol():
    for protocol, implementation in _protocols_and_their_implementations():
        missing = {n for n in _members(protocol) if not hasattr(implementation, n)}
        assert (protocol.__name__, missing) == (protocol.__name__, set())

