"""A worker that answers 200 with a body that is not its protocol's answer:
the client gets the format's 502 naming what was wrong (in-band once a
stream's 200 went out), the request's record carries that message, and the
worker's connection is retired, never reused. SGLang and vLLM, unary and
stream, aggregated and P/D (the prefill leg's answer, and the decode
leg's), on both worker classes.
"""

from __future__ import annotations


import anyio
import anyio.abc
import anyio.from_thread
import h11
import orjson
import pytest

from fakes import LoopbackServer
from support import post, read_h11_request, send_h11_answer, start_frontend, trace_records, wait_until

GENERATE = {"sglang": b"/generate", "vllm": b"/inference/v1/generate"}
INFO = {
    b"/get_server_info": {"model_path": "fake"},
    b"/v1/models": {"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": 4096}]},
    b"/version": {"version": "0.33.0"},
}


class AnsweringWorker(LoopbackServer):
    """An SGLang or vLLM worker whose generate route answers 200 with the
    payloads it is given, whatever it was asked: a unary request gets
    ``payloads[0]`` as its body (with its length), a stream each payload as
    an SSE event then ``data: [DONE]``; either way a whole HTTP/1.1
    response, so the connection could be reused. Its other routes answer
    as an idle engine does.

    ``generates`` counts generate requests; of the connections a generate
    answer went out on while :attr:`bad` was set, ``closed`` counts those
    the frontend closed, ``reused`` those it sent another request on.
    """

    def __init__(self, payloads: list[bytes], bad: bool = True) -> None:
        self.payloads = payloads
        self.bad = bad
        #: ``(seconds, raw response)``: the generate answer instead, that late.
        self.late: tuple[float, bytes] | None = None
        self.generates = 0
        self.closed = 0
        self.reused = 0

    async def _handle(self, stream) -> None:
        conn = h11.Connection(h11.SERVER)
        answered = False  # a bad generate answer went out on this connection
        try:
            async with stream:
                while True:
                    request, body = await self._read(stream, conn)
                    if request is None:
                        self.closed += answered
                        return
                    self.reused += answered
                    answered = False
                    path = request.target.split(b"?")[0]
                    if path in GENERATE.values():
                        self.generates += 1
                        # Read before the answer goes out: a test may reset it
                        # as soon as its client has the answer.
                        bad = self.bad
                        await self._generate(stream, conn, orjson.loads(body).get("stream") is True)
                        answered = bad
                    elif path in INFO:
                        await self._reply(stream, conn, orjson.dumps(INFO[path]))
                    elif path in (b"/health", b"/abort_request", b"/abort_requests"):
                        await self._reply(stream, conn, b"")
                    else:
                        await self._reply(stream, conn, b'{"detail":"Not Found"}', 404)
                    conn.start_next_cycle()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, h11.RemoteProtocolError):
            self.closed += answered

    _read = staticmethod(read_h11_request)

    async def _reply(self, stream, conn, body: bytes, status: int = 200) -> None:
        await send_h11_answer(stream, conn, body, status, [("content-type", "application/json")])

    async def _generate(self, stream, conn, streamed: bool) -> None:
        if self.late is not None:
            delay, raw = self.late
            await anyio.sleep(delay)
            await stream.send(raw)
            return
        if not streamed:
            await self._reply(stream, conn, self.payloads[0])
            return
        data = b"".join(b"data: " + p + b"\n\n" for p in self.payloads) + b"data: [DONE]\n\n"
        head = h11.Response(status_code=200, headers=[("content-type", "text/event-stream"),
                                                      ("content-length", str(len(data)))])
        await stream.send(conn.send(head) + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))


@pytest.fixture(params=["trio", "asyncio"])
def worker_class(request):
    return request.param


SG_CHUNK = {"text": "a", "output_ids": [5],
            "meta_info": {"id": "x", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 1,
                          "cached_tokens": 0}}
SG_PREFILL = {"text": "", "output_ids": [5],
              "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3,
                            "completion_tokens": 1, "cached_tokens": 0}}
VL_CHUNK = {"request_id": "x", "choices": [{"index": 0, "logprobs": None, "finish_reason": None, "token_ids": [5],
                                            "routed_experts": None}], "usage": None}
VL_PREFILL = {"request_id": "x", "choices": [{"index": 0, "finish_reason": "length", "token_ids": [5]}],
              "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [1]}}

SG_BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "mine"}
VL_BODY = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}


def sglang_502(message: str) -> dict:
    return {"object": "error", "message": f"worker answer: {message}", "type": "502", "param": None, "code": 502}


def sglang_in_band(message: str) -> dict:
    return {"error": {"message": f"worker answer: {message}", "type": "502", "code": 502}}


def vllm_502(message: str) -> dict:
    return {"error": {"message": f"worker answer: {message}", "type": "Bad Gateway", "param": None, "code": 502}}


# (protocol, stream, the worker's payloads, what the client gets: status and
# body, or 200 and the SSE events' JSON, the record's HTTP status, the message)
CASES = {
    "sglang_unary_garbage": ("sglang", False, [b'{"garbage": true}'],
                             (502, sglang_502("meta_info is missing, expected an object")),
                             "meta_info is missing, expected an object"),
    "sglang_unary_wrong_types": ("sglang", False, [b'{"text": 5, "output_ids": "nope", "meta_info": []}'],
                                 (502, sglang_502("meta_info is a list, expected an object")),
                                 "meta_info is a list, expected an object"),
    "sglang_unary_not_json": ("sglang", False, [b"<html>oops</html>"],
                              (502, sglang_502("the body is not JSON")), "the body is not JSON"),
    "sglang_stream_first": ("sglang", True, [b"[1, 2]"],
                            (502, sglang_502("the chunk is a list, expected an object")),
                            "the chunk is a list, expected an object"),
    "sglang_stream_in_band": ("sglang", True, [orjson.dumps(SG_CHUNK), b'{"text": "ab", "output_ids": "nope", '
                                                                       b'"meta_info": {"finish_reason": null}}'],
                              (200, [{**SG_CHUNK, "meta_info": {**SG_CHUNK["meta_info"], "id": "mine"}},
                                     sglang_in_band("output_ids is a string, expected a list of integers")]),
                              "output_ids is a string, expected a list of integers"),
    "vllm_unary_garbage": ("vllm", False, [b'{"garbage": true}'],
                           (502, vllm_502("choices is missing, expected a list")), "choices is missing, expected a list"),
    "vllm_unary_wrong_types": ("vllm", False, [b'{"text": 5, "output_ids": "nope", "meta_info": []}'],
                               (502, vllm_502("choices is missing, expected a list")),
                               "choices is missing, expected a list"),
    "vllm_stream_in_band": ("vllm", True, [orjson.dumps(VL_CHUNK),
                                           b'{"choices": [{"index": 0, "token_ids": "nope"}]}'],
                            (200, [{**VL_CHUNK, "request_id": None},
                                   vllm_502("choices[0].token_ids is a string, expected a list of integers")]),
                            "choices[0].token_ids is a string, expected a list of integers"),
}


def ask(fe, protocol: str, stream: bool):
    """The client's answer: ``(status, body JSON)`` or ``(200, [event JSON, ...])`` without ``[DONE]``."""
    path = GENERATE[protocol].decode()
    body = SG_BODY if protocol == "sglang" else VL_BODY
    resp = post(fe.url, {**body, "stream": True} if stream else body, path)
    if resp.status_code != 200 or not stream:
        return resp.status_code, resp.json()
    events = [block[len(b"data: "):] for block in resp.content.split(b"\n\n") if block]
    assert events[-1] == b"[DONE]"
    return resp.status_code, [orjson.loads(e) for e in events[:-1]]


def check_answer(got, want, fe_request_id: bool) -> None:
    status, body = got
    if status == 200 and type(body) is list and fe_request_id:
        # vLLM stream chunks carry generate-tokens-<the frontend's id>: any one.
        assert body[0]["request_id"].startswith("generate-tokens-")
        body = [{**body[0], "request_id": None}, *body[1:]]
    assert (status, body) == want


def records(tmp_path, n: int) -> list[dict]:
    def read():
        recs = trace_records(f"{tmp_path / 't'}.*.jsonl")
        return recs if len(recs) >= n else None
    return wait_until(read, timeout=30)


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_malformed_answers_of_an_aggregated_worker(worker_class, protocol, tmp_path):
    cases = [c for c in CASES.values() if c[0] == protocol]
    with AnsweringWorker([]) as fake:
        fe = start_frontend([f"{protocol}={fake.url}"], worker_class=worker_class,
                            extra=["--trace-file", str(tmp_path / "t.jsonl"), "--migration-limit", "0"])
        try:
            for n, (_, stream, payloads, want, message) in enumerate(cases, 1):
                fake.payloads = payloads
                check_answer(ask(fe, protocol, stream), want, protocol == "vllm")
                # The connection the answer came on is closed, never reused.
                wait_until(lambda: fake.closed == n, timeout=30)
                assert (fake.generates, fake.reused) == (n, 0)
            recs = records(tmp_path, len(cases))
            assert [(r["status"], r["http_status"], r["error"]) for r in recs] == [
                ("engine_error", want[0], {"type": "bad_worker_answer", "message": f"worker answer: {message}"})
                for _, _, _, want, message in cases]
            assert [[a["outcome"] for a in r["attempts"]] for r in recs] == [["error"]] * len(cases)
        finally:
            fe.stop()


# (protocol, which leg answers badly, stream, its payloads, the client's
# status and body, the record's message)
PD_CASES = {
    "sglang_prefill": ("sglang", "prefill", False, [b'{"garbage": true}'],
                       (502, sglang_502("meta_info is missing, expected an object")),
                       "meta_info is missing, expected an object"),
    "sglang_decode": ("sglang", "decode", False, [b'{"text": 5, "output_ids": "nope", "meta_info": []}'],
                      (502, sglang_502("meta_info is a list, expected an object")),
                      "meta_info is a list, expected an object"),
    "vllm_prefill": ("vllm", "prefill", False, [b'{"garbage": true}'],
                     (502, vllm_502("choices is missing, expected a list")), "choices is missing, expected a list"),
    "vllm_prefill_kv": ("vllm", "prefill", False, [orjson.dumps({**VL_PREFILL, "kv_transfer_params": []})],
                        (502, vllm_502("kv_transfer_params is a list, expected an object")),
                        "kv_transfer_params is a list, expected an object"),
    "vllm_decode_stream": ("vllm", "decode", True, [b'{"choices": [{"index": "0", "token_ids": [5]}]}'],
                           (502, vllm_502("choices[0].index is a string, expected an integer")),
                           "choices[0].index is a string, expected an integer"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_malformed_answers_of_a_pd_leg(worker_class, protocol, tmp_path):
    cases = [c for c in PD_CASES.values() if c[0] == protocol]
    good = {"sglang": [orjson.dumps(SG_PREFILL)], "vllm": [orjson.dumps(VL_PREFILL)]}[protocol]
    with AnsweringWorker(good, bad=False) as prefill, AnsweringWorker(good, bad=False) as decode:
        spec = f"{protocol}={prefill.url}" + ("?bootstrap_port=1" if protocol == "sglang" else "")
        fe = start_frontend([], worker_class=worker_class, extra=[
            "--disaggregation", "always", "--prefill", spec, "--decode", f"{protocol}={decode.url}",
            "--trace-file", str(tmp_path / "t.jsonl"), "--migration-limit", "0"])
        try:
            for n, (_, role, stream, payloads, want, message) in enumerate(cases, 1):
                bad = prefill if role == "prefill" else decode
                bad.payloads, bad.bad = payloads, True
                check_answer(ask(fe, protocol, stream), want, protocol == "vllm")
                bad.payloads, bad.bad = good, False
            # Each connection a bad answer came on is closed, never reused.
            wait_until(lambda: (prefill.closed + decode.closed, prefill.reused + decode.reused) == (len(cases), 0),
                       timeout=30)
            recs = records(tmp_path, len(cases))
            assert [(r["status"], r["http_status"], r["error"]) for r in recs] == [
                ("engine_error", want[0], {"type": "bad_worker_answer", "message": f"worker answer: {message}"})
                for _, _, _, _, want, message in cases]
        finally:
            fe.stop()


@pytest.mark.e2e
def test_malformed_answers_of_a_batch(worker_class, tmp_path):
    """An SGLang batch (two prompts, one leg): a unary answer that is not
    the list of the entries' objects, and a stream chunk whose entry index
    is not one of the leg's after the 200: the batch's 502, one record per
    item with the message, the connections closed."""
    batch = {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 4}}
    chunk = {**SG_CHUNK, "index": 0}
    with AnsweringWorker([b'{"garbage": true}']) as fake:
        fe = start_frontend([f"sglang={fake.url}"], worker_class=worker_class,
                            extra=["--trace-file", str(tmp_path / "t.jsonl")])
        try:
            resp = post(fe.url, batch)
            assert (resp.status_code, resp.json()) == (
                502, sglang_502("the body is an object, expected a list of one answer per entry"))
            fake.payloads = [orjson.dumps(chunk), orjson.dumps({**chunk, "index": 2})]
            resp = post(fe.url, {**batch, "stream": True})
            *data, done = [b[len(b"data: "):] for b in resp.content.split(b"\n\n") if b]
            assert (resp.status_code, done) == (200, b"[DONE]")
            events = [orjson.loads(d) for d in data]
            assert events[1:] == [sglang_in_band("index is 2, expected an entry of the leg's 2")]
            assert (events[0]["index"], events[0]["output_ids"]) == (0, [5])
            wait_until(lambda: fake.closed == 2, timeout=30)
            assert (fake.generates, fake.reused) == (2, 0)
            recs = records(tmp_path, 4)
            assert sorted((r["batch_index"], r["status"], r["error"]["message"]) for r in recs) == sorted(
                (i, "engine_error", f"worker answer: {why}") for i in (0, 1)
                for why in ("the body is an object, expected a list of one answer per entry",
                            "index is 2, expected an entry of the leg's 2"))
        finally:
            fe.stop()


HTML_504 = (b"HTTP/1.1 504 Gateway Time-out\r\ncontent-type: text/html\r\ncontent-length: 46\r\n\r\n"
            b"<html><body>504 Gateway Time-out</body></html>")
NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_an_error_head_after_a_streams_keepalive_comes_in_band(worker_class, protocol, tmp_path):
    # The engine's head comes after the stream's first keep-alive went out
    # (the 200 with it): its error is an in-band event, then [DONE].
    with AnsweringWorker([]) as fake:
        fe = start_frontend([f"{protocol}={fake.url}"], worker_class=worker_class,
                            extra=["--trace-file", str(tmp_path / "t.jsonl"), "--migration-limit", "0",
                                   "--sse-keepalive", "0.2"])
        try:
            fake.late = (1.5, HTML_504)
            body = SG_BODY if protocol == "sglang" else VL_BODY
            resp = post(fe.url, {**body, "stream": True}, GENERATE[protocol].decode())
            blocks = [b for b in resp.content.split(b"\n\n") if b]
            assert resp.status_code == 200 and blocks[0] == b": keep-alive"
            events = [b[len(b"data: "):] for b in blocks if b.startswith(b"data: ")]
            message = "worker answered 504: <html><body>504 Gateway Time-out</body></html>"
            want = ({"error": {"message": message, "type": "504", "code": 504}} if protocol == "sglang" else
                    {"error": {"message": message, "type": "Gateway Timeout", "param": None, "code": 504}})
            assert [orjson.loads(events[0]), events[1:]] == [want, [b"[DONE]"]]
            (rec,) = records(tmp_path, 1)
            assert (rec["status"], rec["http_status"], rec["error"]) == (
                "engine_error", 200, {"type": "engine", "message": message})
        finally:
            fe.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_204_to_a_generate_request_is_a_502(worker_class, protocol, tmp_path):
    with AnsweringWorker([]) as fake:
        fe = start_frontend([f"{protocol}={fake.url}"], worker_class=worker_class,
                            extra=["--trace-file", str(tmp_path / "t.jsonl"), "--migration-limit", "0"])
        try:
            fake.late = (0.0, NO_CONTENT)
            body = SG_BODY if protocol == "sglang" else VL_BODY
            resp = post(fe.url, body, GENERATE[protocol].decode())
            message = "worker answered 204 to a generate request"
            want = ({"object": "error", "message": message, "type": "502", "param": None, "code": 502}
                    if protocol == "sglang" else
                    {"error": {"message": message, "type": "Bad Gateway", "param": None, "code": 502}})
            assert (resp.status_code, resp.json()) == (502, want)
            (rec,) = records(tmp_path, 1)
            assert (rec["status"], rec["http_status"], rec["error"]) == (
                "engine_error", 502, {"type": "bad_worker_answer", "message": message})
        finally:
            fe.stop()
