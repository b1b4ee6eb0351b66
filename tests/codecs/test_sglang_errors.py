"""Bad input on the SGLang route: the exact status and SGLang-shaped body,
and the engine never called."""

from __future__ import annotations

import httpx
import orjson
import pytest

from support import post, sse, start_frontend, start_sim, stats, without_timing


def _received(sims) -> int:
    return sum(stats(s)["received"] for s in sims)


def _schema(message: str, status: int = 400, kind: str = "Bad Request") -> dict:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


BAD = [
    ("truncated-json", b'{"input_ids": [1, 2', 400,
     _schema("JSON decode error: unexpected end of data: line 1 column 20 (char 19)")),
    ("json-array", b"[1, 2, 3]", 400,
     _schema("Input should be a valid dictionary or object to extract fields from")),
    ("string-max-new-tokens", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "10"}}', 400,
     _schema('sampling_params.max_new_tokens: Input should be a valid integer, got str "10"')),
    ("bool-stream-as-int", b'{"input_ids": [1], "stream": 1}', 400,
     _schema("stream: Input should be a valid boolean, got int 1")),
    ("ids-not-ints", b'{"input_ids": [1, "2"]}', 400,
     _schema("input_ids: Input should be a valid list of integers")),
    ("ids-bool", b'{"input_ids": [5, true], "stream": false}', 400,
     _schema("input_ids: Input should be a valid list of integers")),
    ("ids-float", b'{"input_ids": [5, 1.0]}', 400,
     _schema("input_ids: Input should be a valid list of integers")),
    ("empty-input-ids", b'{"input_ids": []}', 400,
     {"error": {"message": "input_ids cannot be empty."}}),
    ("negative-id", b'{"input_ids": [3, -1]}', 400,
     {"error": {"message": "input_ids: token id -1 is negative."}}),
    ("no-input", b'{"sampling_params": {}}', 400,
     {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}),
    ("batch-rids", b'{"input_ids": [[1], [2]], "rid": ["a"]}', 400,
     {"error": {"message": "The specified rids length mismatch with the batch_size for batch processing."}}),
    ("batch-empty-item", b'{"input_ids": [[1], []]}', 400,
     {"error": {"message": "input_ids cannot be empty."}}),
    ("n-0", b'{"input_ids": [1], "sampling_params": {"n": 0}}', 400,
     {"error": {"message": "n must be at least 1, got 0."}}),
    ("bootstrap", b'{"input_ids": [1], "bootstrap_room": 7}', 400,
     {"error": {"message": "bootstrap_room is set by the frontend for prefill/decode routing; do not send it."}}),
    ("bootstrap-host", b'{"input_ids": [1], "bootstrap_host": "10.0.0.1"}', 400,
     {"error": {"message": "bootstrap_host is set by the frontend for prefill/decode routing; do not send it."}}),
    ("bootstrap-port", b'{"input_ids": [1], "bootstrap_port": 8998}', 400,
     {"error": {"message": "bootstrap_port is set by the frontend for prefill/decode routing; do not send it."}}),
    ("bootstrap-pair-key", b'{"input_ids": [1], "bootstrap_pair_key": "k"}', 400,
     {"error": {"message": "bootstrap_pair_key is set by the frontend for prefill/decode routing; "
                           "do not send it."}}),
    ("negative-max", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}', 400,
     {"error": {"message": "max_new_tokens must be at least 0, got -1."}}),
]


@pytest.mark.e2e
@pytest.mark.parametrize("name,body,status,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_input_never_reaches_the_engine(frontend, sims, name, body, status, expected):
    before = _received(sims)
    resp = post(frontend.url, body)
    assert resp.status_code == status
    assert resp.json() == expected
    assert _received(sims) == before


# Bad values the frontend itself refuses, where SGLang has the same check.
SHARED = {"empty-input-ids": {"input_ids": []}, "no-input": {"sampling_params": {}},
          "negative-max": {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}}
IN_BAND = [(name, orjson.loads(body) | {"stream": True}, expected) for name, body, status, expected in BAD
           if name in ("empty-input-ids", "negative-id", "no-input", "batch", "n-2", "bootstrap", "bootstrap-pair-key",
                        "negative-max")]


@pytest.mark.e2e
@pytest.mark.parametrize("name,body,expected", IN_BAND, ids=[b[0] for b in IN_BAND])
def test_streamed_bad_value_is_in_band_as_sglang_streams_it(frontend, sims, name, body, expected):
    """A streamed request the frontend refuses for a bad value gets SGLang's
    streamed answer: 200, one ``data: {"error": {"message"}}``, ``[DONE]``."""
    before = _received(sims)
    with httpx.stream("POST", frontend.url + "/generate", content=orjson.dumps(body), timeout=10) as resp:
        raw = b"".join(resp.iter_bytes())
    assert (resp.status_code, resp.headers["content-type"]) == (200, "text/event-stream; charset=utf-8")
    assert raw == b"data: " + orjson.dumps(expected) + b"\n\ndata: [DONE]\n\n"
    assert _received(sims) == before


@pytest.mark.e2e
@pytest.mark.parametrize("name", SHARED)
@pytest.mark.parametrize("stream", [False, True])
def test_frontend_refusal_is_the_engines_own_answer(frontend, sims, name, stream):
    """Where SGLang has the check, the frontend's refusal is byte for byte
    the engine's answer, unary and streamed."""
    body = SHARED[name] | ({"stream": True} if stream else {})
    direct = httpx.post(sims[0].url + "/generate", content=orjson.dumps(body), timeout=10)
    through = httpx.post(frontend.url + "/generate", content=orjson.dumps(body), timeout=10)
    assert (through.status_code, through.content) == (direct.status_code, direct.content)
    assert through.status_code == (200 if stream else 400)
    assert through.headers["content-type"].split(";")[0] == direct.headers["content-type"].split(";")[0]


PASS_THROUGH = [
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
     "temperature must be a non-negative finite number, got -1."),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}, "top_p must be in (0, 1], got 1.5."),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"input_ids": [1, 2], "sampling_params": {"logit_bias": {"4096": 1.0}}},
     "logit_bias must has keys in [0, 4095], got 4096."),
    ({"input_ids": [1, 2], "token_ids_logprob": [1, 9999]},
     "token_ids_logprob contains out-of-vocabulary token id 9999; valid range is [0, 4096)."),
]


@pytest.mark.e2e
@pytest.mark.parametrize("body,message", PASS_THROUGH, ids=[m.split(" ")[0] for _, m in PASS_THROUGH])
def test_fields_the_frontend_does_not_read_reach_the_engine(frontend, sims, body, message):
    """Validate only what the frontend relies on: the engine judges the rest,
    and its answer reaches the client unchanged (unary and in-band). The
    messages are the engine's: the frontend has no such check."""
    resp = post(frontend.url, body)
    assert (resp.status_code, resp.json()) == (400, {"error": {"message": message}})
    status, events = sse(frontend.url, body | {"stream": True})
    assert (status, events) == (200, [orjson.dumps({"error": {"message": message}}), b"[DONE]"])


@pytest.mark.e2e
def test_text_and_input_ids_is_served_from_text_as_sglang_does(frontend, sims):
    body = {"text": "hello there", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}
    direct, through = post(sims[0].url, body), post(frontend.url, body)
    assert through.status_code == direct.status_code == 200
    assert without_timing(through.json())["output_ids"] == without_timing(direct.json())["output_ids"]
    assert through.json()["meta_info"]["prompt_tokens"] == direct.json()["meta_info"]["prompt_tokens"] == 4  # the text's, not the ids'


@pytest.mark.e2e
def test_unknown_path_is_404(frontend):
    resp = post(frontend.url, {"input_ids": [1]}, path="/generat")
    assert resp.status_code == 404
    assert resp.json() == {"detail": "Not Found"}


@pytest.mark.e2e
def test_wrong_method_is_405_with_allow(frontend, sims):
    before = _received(sims)
    resp = httpx.get(frontend.url + "/generate", timeout=10)
    assert resp.status_code == 405
    assert resp.headers["allow"] == "POST, PUT"
    assert resp.json() == _schema("Method Not Allowed", 405, "Method Not Allowed")
    assert _received(sims) == before


@pytest.mark.e2e
def test_engine_value_error_is_passed_through(frontend, sims):
    """An id the engine refuses: the engine's own status and body (unary),
    SGLang's in-band error after the 200 (stream)."""
    body = {"input_ids": [5000], "rid": "oov"}
    direct = post(sims[0].url, body)
    through = post(frontend.url, body)
    assert through.status_code == direct.status_code == 400
    assert through.json() == direct.json() == {"error": {"message": "Token id out of range [0, 4096)."}}
    status, events = sse(frontend.url, {**body, "stream": True})
    assert status == 200
    assert events == [b'{"error":{"message":"Token id out of range [0, 4096)."}}', b"[DONE]"]


@pytest.fixture(scope="module")
def capped():
    sim = start_sim("sglang")
    fe = start_frontend([f"sglang={sim.url}"], extra=["--max-body-bytes", "1024"])
    yield fe, sim
    fe.stop()
    sim.stop()


@pytest.mark.e2e
def test_body_over_cap_is_413(capped):
    fe, sim = capped
    big = orjson.dumps({"input_ids": list(range(1, 400))})
    assert len(big) > 1024
    received = stats(sim)["received"]  # the module's other tests may have run first
    resp = post(fe.url, big)
    assert resp.status_code == 413
    assert resp.json() == _schema("request body exceeds the limit of 1024 bytes", 413, "Request Entity Too Large")
    assert stats(sim)["received"] == received


@pytest.mark.e2e
def test_chunked_body_over_cap_is_413(capped):
    fe, sim = capped

    def chunks():
        yield b'{"input_ids": ['
        for _ in range(200):
            yield b"1000, "
        yield b"1]}"

    received = stats(sim)["received"]  # the module's other tests may have run first
    resp = httpx.post(fe.url + "/generate", content=chunks(), timeout=10)
    assert resp.status_code == 413
    assert resp.json()["message"] == "request body exceeds the limit of 1024 bytes"
    assert stats(sim)["received"] == received


@pytest.mark.e2e
def test_body_at_cap_is_served(capped):
    fe, sim = capped
    body = orjson.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    body = body[:-1] + b" " * (1024 - len(body)) + b"}"
    assert len(body) == 1024
    resp = post(fe.url, body)
    assert resp.status_code == 200
    assert len(resp.json()["output_ids"]) == 2


@pytest.mark.e2e
def test_too_deeply_nested_pass_through_is_400(frontend, sims):
    """orjson reads 1024 levels but writes 254: a field the frontend cannot
    forward is bad input, not an internal error."""
    before = _received(sims)
    deep = b'{"input_ids": [1], "x": ' + b"[" * 300 + b"]" * 300 + b"}"
    resp = post(frontend.url, deep)
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "the request cannot be forwarded: Recursion limit reached"}}
    assert _received(sims) == before


def test_engine_error_pages_that_are_not_json_get_sglang_shape():
    from asgi_generate.sdk._codec import GenerateRequest
    from asgi_generate_sglang import SGLangCodec

    ex = SGLangCodec().exchange(GenerateRequest(stream=False, native={}), "r")
    assert ex.worker_error(500, b"Internal Server Error") == (500, orjson.dumps(
        {"object": "error", "message": "worker answered 500: Internal Server Error", "type": "500",
         "param": None, "code": 500}))
    assert ex.worker_error(400, b'{"error": {"message": "x"}}') == (400, b'{"error": {"message": "x"}}')


@pytest.mark.e2e
def test_bad_logprob_start_len_is_the_engines_400(frontend, sims):
    body = {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -5}
    direct, through = post(sims[0].url, body), post(frontend.url, body)
    assert through.status_code == direct.status_code == 400
    assert through.json() == direct.json() == {
        "error": {"message": "logprob_start_len (-5) must be -1 or at least 0."}}


def test_a_unary_replay_reads_its_whole_answer_and_the_engines_weight_version():
    """A unary request the engine aborted (a pause's abort, held) is replayed
    from scratch: the replay's answer is the client's whole answer, not its
    tail past the aborted answer's tokens; each event carries the engine's
    ``meta_info.weight_version``."""
    from asgi_generate.sdk._codec import Attempt
    from asgi_generate_sglang.codec import SGLangCodec

    codec = SGLangCodec()
    ex = codec.exchange(codec.decode(orjson.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}),
                                     {}), "pub")
    first = Attempt("a" * 32, "aggregated")
    ex.worker_request(first)
    aborted = {"text": "", "output_ids": [7, 8], "meta_info": {
        "id": "a" * 32, "finish_reason": {"type": "abort", "message": "Abort before prefill"}, "prompt_tokens": 2,
        "weight_version": "default", "completion_tokens": 2, "cached_tokens": 0}}
    event = ex.feed(first, orjson.dumps(aborted))
    assert (event.token_ids, event.finish_reason, event.weight_version) == ([7, 8], "abort", "default")
    replayed = Attempt("b" * 32, "replayed")
    ex.worker_request(replayed)
    whole = {"text": "", "output_ids": [7, 8, 9, 10], "meta_info": {
        "id": "b" * 32, "finish_reason": {"type": "length", "length": 4}, "prompt_tokens": 2,
        "weight_version": "1", "completion_tokens": 4, "cached_tokens": 0}}
    event = ex.feed(replayed, orjson.dumps(whole))
    assert (event.token_ids, event.finish_reason, event.weight_version) == ([7, 8, 9, 10], "length", "1")
