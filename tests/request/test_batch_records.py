"""What a request's records say about how it ended, in process (the fake
:class:`RequestContext` of tests/request/test_context.py): the HTTP status
each item's record carries, an answer the engine cut short by its own abort
(``engine_abort``, SGLang and vLLM, unary and SSE, batch items too), and a
request with several items refused as a whole before any of them ran, which
is one record whatever its ``n``."""

from __future__ import annotations

import anyio
import orjson
import pytest

from asgi_generate.request.answer import finish_record
from asgi_generate.tracing.record import build_record
from asgi_generate.tracing.state import RequestState
from asgi_generate.workers.router import Router
from asgi_generate_sglang.codec import SGLangCodec
from asgi_generate_vllm import VLLMCodec
from fakes import AnsweringPool, FakeContext
from test_context import SGLANG_URL, _router, _sse, anyio_backend, generation  # noqa: F401

ABORT_MESSAGE = "the engine aborted the request (finish_reason abort): its output is truncated"


def _vllm_router(answer) -> Router:
    """A router with one vLLM worker, up, answering with ``answer``."""
    router = Router([("vllm", SGLANG_URL)])
    worker = router.workers[0]
    worker.healthy = True
    worker.pool = AnsweringPool(answer)
    return router


async def _serve(ctx: FakeContext, body: dict, codec=None, request_id: str = "r" * 32):
    """Run one request through its :class:`Generation` on ``ctx``: the messages its
    client got, its finished state and the records it left (as JSON)."""
    codec = codec or SGLangCodec()
    req = codec.decode(orjson.dumps(body), {b"content-type": b"application/json"})
    st = RequestState(request_id, codec.name, "/generate", "POST")
    st.stream = req.stream
    st.public_id, st.input_ids = req.public_id, req.input_ids  # as the handler sets them
    st.input_length = len(req.input_ids) if req.input_ids is not None else None
    out: list[dict] = []

    async def send(message: dict) -> None:
        out.append(message)

    gen = generation(ctx, codec, req, st, send)
    with anyio.fail_after(5):
        await gen.run()
    st.t_done = None
    await finish_record(ctx, st)
    return out, st, [build_record(s, 64) for s in ctx.recorder.records]


def _outcome(rec: dict) -> tuple:
    return rec["status"], rec.get("http_status"), rec.get("error"), rec["output_tokens"], rec.get("finish")


# -- the HTTP status sent, on every item ------------------------------------------


def _error_200(sent: dict):
    """SGLang's error object as a unary batch's 200 answer: the engine's
    error ends the request; the batch answer it should have been is missing."""
    return 200, [b'{"error": {"message": "boom", "code": 500}}']


@pytest.mark.anyio
async def test_a_unary_batch_answered_502_after_its_engines_error_records_502_on_every_item():
    ctx = FakeContext(_router(_error_200))
    out, st, recs = await _serve(ctx, {"input_ids": [1, 2, 3], "sampling_params": {"n": 2}})
    assert (out[0]["status"], orjson.loads(out[1]["body"])) == (502, {
        "object": "error", "message": "worker ended the response without output", "type": "502", "param": None,
        "code": 502})
    assert [_outcome(r) for r in recs] == [
        ("engine_error", 502, {"type": "engine", "message": "boom"}, 0, None)] * 2


# -- the engine's abort -------------------------------------------------------------

#: SGLang's finish of a request its scheduler aborted (``FINISH_ABORT.to_json``
#: in sglang/srt/managers/schedule_batch.py; abort_all, a pause without hold).
SGLANG_ABORT = {"type": "abort", "message": "Abort in waiting queue", "status_code": None, "err_type": None}


def _sglang_chunk(rid: str, ids: list[int], finish) -> dict:
    return {"text": "", "output_ids": ids, "meta_info": {
        "id": rid, "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(ids)}}


def _sglang_aborted(sent: dict):
    """Two tokens, then the engine's abort: one unary answer or a stream."""
    rid = sent["rid"]
    if sent.get("stream"):
        return 200, _sse([_sglang_chunk(rid, [5], None), _sglang_chunk(rid, [5, 6], SGLANG_ABORT)])
    return 200, [orjson.dumps(_sglang_chunk(rid, [5, 6], SGLANG_ABORT))]


def _vllm_aborted(sent: dict):
    """Two tokens, then vLLM's ``finish_reason: "abort"``: the minted id
    reaches the engine in ``X-Request-Id``, not the body, so the answer's id
    is one the fake makes up."""
    rid = "generate-tokens-e0"
    if sent.get("stream"):
        return 200, _sse([
            {"request_id": rid, "choices": [{"index": 0, "token_ids": [5], "finish_reason": None}]},
            {"request_id": rid, "choices": [{"index": 0, "token_ids": [6], "finish_reason": "abort"}]},
            {"request_id": rid, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
        ])
    choice = {"index": 0, "token_ids": [5, 6], "finish_reason": "abort"}
    return 200, [orjson.dumps({"request_id": rid, "choices": [choice],
                               "usage": {"prompt_tokens": 3, "completion_tokens": 2}})]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.anyio
async def test_an_answer_the_engine_cut_by_its_abort_is_engine_abort_not_ok(engine, stream):
    if engine == "sglang":
        ctx, codec = FakeContext(_router(_sglang_aborted)), SGLangCodec()
        body = {"input_ids": [1, 2, 3], "stream": stream}
    else:
        ctx, codec = FakeContext(_vllm_router(_vllm_aborted)), VLLMCodec()
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8}, "stream": stream}
    out, st, (rec,) = await _serve(ctx, body, codec)
    assert out[0]["status"] == 200
    assert _outcome(rec) == ("engine_abort", 200, {"type": "engine_abort", "message": ABORT_MESSAGE}, 2,
                             {"finish_reason": "abort", "backend_finish_reason": "abort"})
    assert [a["outcome"] for a in rec["attempts"]] == ["finished"]


def _sglang_batch_one_aborted(sent: dict):
    """A unary SGLang batch of two samples: the first finished, the second aborted."""
    first, second = sent["rid"]
    return 200, [orjson.dumps([_sglang_chunk(first, [5, 6], {"type": "length", "length": 2}),
                               _sglang_chunk(second, [7], SGLANG_ABORT)])]


@pytest.mark.anyio
async def test_a_batch_item_the_engine_aborted_is_engine_abort_beside_its_ok_sibling():
    ctx = FakeContext(_router(_sglang_batch_one_aborted))
    out, st, recs = await _serve(ctx, {"input_ids": [1, 2, 3], "sampling_params": {"n": 2}})
    assert out[0]["status"] == 200
    assert [_outcome(r) for r in recs] == [
        ("ok", 200, None, 2, {"finish_reason": "length", "backend_finish_reason": "length"}),
        ("engine_abort", 200, {"type": "engine_abort", "message": ABORT_MESSAGE}, 1,
         {"finish_reason": "abort", "backend_finish_reason": "abort"}),
    ]


# -- a request refused as a whole: one record -----------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.anyio
async def test_a_batch_no_worker_can_take_is_one_unavailable_record_with_its_item_count(stream):
    ctx = FakeContext(_router())  # its one worker is down
    body = {"input_ids": [1, 2, 3], "rid": "wide", "sampling_params": {"n": 1000}, "stream": stream}
    out, st, recs = await _serve(ctx, body)
    assert out[0]["status"] == 503
    assert [(r["request_id"], r.get("public_id"), r.get("item_count"), r.get("batch_id")) for r in recs] == [
        ("r" * 32, "wide", 1000, None)]
    assert [_outcome(r) for r in recs] == [
        ("unavailable", 503, {"type": "unavailable", "message": "no healthy worker for protocol 'sglang'"}, 0, None)]
    assert ctx.recorder.calls == ["ended", ("finished", "r" * 32, "unavailable", 0)]


def _vllm_refuses_n(sent: dict):
    """vLLM's 400 to ``n`` above its ``max_num_seqs``
    (vllm/entrypoints/scale_out/token_in_token_out/serving.py)."""
    n = sent["sampling_params"]["n"]
    return 400, [orjson.dumps({"error": {
        "message": f"sampling_params.n must be at most the server's max_num_seqs (256), got {n}.",
        "type": "BadRequestError", "param": None, "code": 400}})]


@pytest.mark.anyio
async def test_a_vllm_n_its_engine_refuses_is_one_rejected_record_whatever_n():
    ctx = FakeContext(_vllm_router(_vllm_refuses_n))
    body = {"token_ids": [1, 2, 3], "request_id": "wide", "sampling_params": {"max_tokens": 1, "n": 16384}}
    out, st, recs = await _serve(ctx, body, VLLMCodec())
    assert out[0]["status"] == 400
    assert [(r.get("public_id"), r.get("item_count"), r.get("batch_id"), r["status"], r["http_status"],
             r["input_tokens"], [a["outcome"] for a in r["attempts"]]) for r in recs] == [
        ("wide", 16384, None, "rejected", 400, 3, ["error"])]


def _sglang_batch_refused(sent: dict):
    """An SGLang batch answered 400 by its engine after one item's chunk
    went out: not refused as a whole (an item ran)."""
    first, second = sent["rid"]
    return 200, _sse([_sglang_chunk(first, [5], None) | {"index": 0},
                      {"error": {"message": "boom", "code": 400}}])


@pytest.mark.anyio
async def test_a_batch_whose_items_ran_before_its_error_keeps_a_record_per_item():
    ctx = FakeContext(_router(_sglang_batch_refused))
    body = {"input_ids": [1, 2, 3], "sampling_params": {"n": 2}, "stream": True}
    out, st, recs = await _serve(ctx, body)
    assert [(r.get("batch_index"), r.get("item_count"), r["status"], r["output_tokens"]) for r in recs] == [
        (0, None, "engine_error", 1), (1, None, "engine_error", 0)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.anyio
async def test_a_batch_refused_before_any_engine_saw_it_is_one_rejected_record(stream):
    """A prompt longer than the worker's context length, sent with ``n``
    50: refused as SGLang refuses it (400; a stream: in-band after a 200),
    one record."""
    router = _router(_sglang_aborted)
    router.workers[0].info["max_model_len"] = 4
    ctx = FakeContext(router)
    body = {"input_ids": [1, 2, 3, 4, 5], "rid": "long", "sampling_params": {"n": 50}, "stream": stream}
    out, st, recs = await _serve(ctx, body)
    message = "The input (5 tokens) is longer than the model's context length (4 tokens)."
    assert out[0]["status"] == (200 if stream else 400)
    assert router.workers[0].pool.sent == []
    assert [(r.get("public_id"), r.get("item_count"), r.get("batch_id"), r["status"], r["http_status"],
             r["error"]["message"], r["attempts"], r["replay"]) for r in recs] == [
        ("long", 50, None, "rejected", 200 if stream else 400, message, [], {"excluded": "rejected"})]
