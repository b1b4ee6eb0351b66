"""The vLLM codec, sans IO: request checks, worker bodies, chunk handling,
unary answers passed through, streams without a usage chunk, error shapes."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from asgi_generate.sdk._codec import Attempt, EngineError, Event, RequestError, WorkerAnswerError
from asgi_generate.protocols import PROTOCOLS
from asgi_generate_vllm import VLLMCodec
from asgi_generate_vllm.request import restore_echo
from asgi_generate_vllm.validation import MAX_ERROR_SITES
from vllm_refusals import MALFORMED, malformed_body

CODEC = VLLMCodec()
ENGINE_ID = "0123456789abcdef0000000000000001"
ATTEMPT = Attempt(ENGINE_ID)


def decode(obj, **headers):
    raw = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    headers = {"content_type": "application/json", **headers}
    return CODEC.decode(raw, {k.replace("_", "-").encode(): v.encode() for k, v in headers.items()})


def exchange(obj, request_id="f" * 32, **headers):
    return CODEC.exchange(decode(obj, **headers), request_id)


def chunk(ids, finish=None, rid=f"generate-tokens-{ENGINE_ID}", logprobs=None) -> bytes:
    return orjson.dumps({
        "request_id": rid,
        "choices": [
            {"index": 0, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids, "routed_experts": None}
        ],
        "usage": None,
    })


def usage_chunk(prompt, completion) -> bytes:
    return orjson.dumps({
        "request_id": f"generate-tokens-{ENGINE_ID}",
        "choices": [],
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion},
    })


def entry(tok, lp):
    return {"token": f"token_id:{tok}", "logprob": lp, "bytes": None,
            "top_logprobs": [{"token": f"token_id:{tok}", "logprob": lp, "bytes": None}]}


def test_codec_identity():
    assert (CODEC.name, CODEC.worker_protocol) == ("vllm", "vllm")
    assert [(r.method, r.path) for r in CODEC.routes] == [("POST", "/inference/v1/generate")]


def test_decode_normalizes():
    req = decode({"token_ids": [5, 6], "request_id": "b", "model": "m", "stream": True,
                  "sampling_params": {"max_tokens": 7}})
    assert (req.stream, req.public_id, req.input_ids, req.max_new_tokens, req.model, req.replay_excluded) == (
        True, "b", [5, 6], 7, "m", None)


@pytest.mark.parametrize(
    "body_id, header, public",
    [("b", "h", "h"), ("b", None, "b"), (None, "h", "h"), (None, None, None), ("b", "", "")],
)
def test_x_request_id_overrides_body_id(body_id, header, public):
    body = {"token_ids": [1], "sampling_params": {}}
    if body_id is not None:
        body["request_id"] = body_id
    headers = {"x_request_id": header} if header is not None else {}
    assert decode(body, **headers).public_id == public
    ex = exchange({**body, "stream": True}, "9" * 32, **headers)
    ex.feed(ATTEMPT, chunk([3]))
    shown = public if public is not None else "9" * 32
    assert orjson.loads(ex.client_event(None))["request_id"] == f"generate-tokens-{shown}"


def test_multimodal_is_excluded_from_replay():
    features = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 2}]},
                "kwargs_data": None}
    req = decode({"token_ids": [1, 9, 9, 4], "features": features, "sampling_params": {}})
    assert (req.input_ids, req.replay_excluded) == (None, "multimodal")


WIDE_BODY = {
    "token_ids": [1, 2], "request_id": "client", "model": "m", "cache_salt": "s", "priority": 3,
    "ec_transfer_params": {"do_remote_prefill": True}, "kv_transfer_params": None, "custom": [1],
    "features": {"mm_hashes": {}, "mm_placeholders": {}},
    "stream_options": {"include_usage": False, "continuous_usage_stats": True, "extra": 1},
    "sampling_params": {"max_tokens": 3, "temperature": 0.5, "seed": 1, "prompt_logprobs": 2},
}


@pytest.mark.parametrize("stream", [False, None, "absent"])
def test_unary_worker_request_is_the_clients_body_and_the_minted_id_header(stream):
    body = dict(WIDE_BODY) if stream == "absent" else {**WIDE_BODY, "stream": stream}
    wreq = exchange(body).worker_request(ATTEMPT)
    assert (wreq.path, wreq.stream) == (b"/inference/v1/generate", False)
    assert wreq.headers == [(b"content-type", b"application/json"), (b"x-request-id", ENGINE_ID.encode())]
    sent = orjson.loads(wreq.body)
    assert sent == body and list(sent) == list(body)  # the minted id rides in the header alone
    # The engine runs it as generate-tokens-<id>, which is what the abort names.
    assert orjson.loads(PROTOCOLS["vllm"].abort_body([ENGINE_ID])) == {"request_ids": [f"generate-tokens-{ENGINE_ID}"]}


def test_unary_worker_request_adds_no_request_id():
    # vLLM takes X-Request-Id over the body's request_id: the body stays the
    # client's, so an engine refusal echoes nothing the frontend made.
    wreq = exchange({"token_ids": [1], "sampling_params": {}}).worker_request(ATTEMPT)
    assert wreq.body == b'{"token_ids":[1],"sampling_params":{}}'


def test_stream_worker_request_mints_the_engine_id_and_asks_for_usage():
    body = {**WIDE_BODY, "stream": True}
    wreq = exchange(body).worker_request(ATTEMPT)
    assert (wreq.path, wreq.stream) == (b"/inference/v1/generate", True)
    assert wreq.headers == [(b"content-type", b"application/json"), (b"x-request-id", ENGINE_ID.encode())]
    assert orjson.loads(wreq.body) == {
        **body, "stream_options": {"include_usage": True, "continuous_usage_stats": False, "extra": 1},
    }


@pytest.mark.parametrize(
    "options, continuous",
    [(None, False), ({}, False), ({"include_usage": True, "continuous_usage_stats": True}, True),
     ({"include_usage": None, "continuous_usage_stats": True}, False)],
)
def test_worker_continuous_usage_only_as_vllm_would(options, continuous):
    body = {"token_ids": [1], "stream": True, "sampling_params": {}}
    if options is not None:
        body["stream_options"] = options
    sent = orjson.loads(exchange(body).worker_request(ATTEMPT).body)["stream_options"]
    assert sent["include_usage"] is True and sent["continuous_usage_stats"] is continuous


@pytest.mark.parametrize("include_usage", [True, False])
def test_stream_holds_finish_until_the_usage_chunk(include_usage):
    ex = exchange({"token_ids": [1, 2], "request_id": "c", "stream": True,
                   "stream_options": {"include_usage": include_usage}, "sampling_params": {}})
    assert ex.feed(ATTEMPT, chunk([7])) == Event([7])
    assert orjson.loads(ex.client_event(None)) == orjson.loads(chunk([7], rid="generate-tokens-c"))
    event = ex.feed(ATTEMPT, chunk([8], "stop"))
    assert (event.token_ids, event.finish_reason) == ([8], None)
    assert orjson.loads(ex.client_event(event))["choices"][0]["finish_reason"] == "stop"
    last = ex.feed(ATTEMPT, usage_chunk(2, 2))
    assert (last.token_ids, last.finish_reason, last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (
        [], "stop", 2, 2, None)
    if include_usage:
        assert ex.client_event(last) == (
            b'{"request_id":"generate-tokens-c","choices":[],'
            b'"usage":{"prompt_tokens":2,"total_tokens":4,"completion_tokens":2}}'
        )
    else:
        assert ex.client_event(last) is None


def unary_answer(ids, finish, usage, **extra) -> bytes:
    return orjson.dumps({
        "request_id": "9f2c0000000000000000000000000000", "model": "sim", "created": 1767000000,
        "choices": [{"index": 0, "finish_reason": finish, "token_ids": ids, "routed_experts": "k05VTVBZ",
                     "logprobs": {"content": [entry(t, -0.5) for t in ids]}}],
        "usage": usage,
        "prompt_logprobs": [None, {"2": {"logprob": -3.25, "rank": 4, "decoded_token": None}}],
        "kv_transfer_params": None, "ec_transfer_params": None, **extra,
    })


def test_unary_answer_is_the_workers_own():
    ex = exchange({"token_ids": [1, 2], "model": "sim", "sampling_params": {"logprobs": 0, "prompt_logprobs": 0}})
    answer = unary_answer([7, 8, 9], "length", {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3,
                                                "prompt_tokens_details": {"cached_tokens": 1}})
    assert ex.feed(ATTEMPT, answer) == Event([7, 8, 9], "length", prompt_tokens=2, completion_tokens=3, cached_tokens=1)
    assert ex.unary_body() == (200, answer)


@pytest.mark.parametrize(
    "shown, headers, body_id",
    [("generate-tokens-mine", {}, "mine"), ("generate-tokens-hdr", {"x_request_id": "hdr"}, "mine"),
     ("generate-tokens-" + "f" * 32, {}, None)],
)
def test_unary_answer_shows_the_clients_id_for_the_engine_id(shown, headers, body_id):
    # vLLM 0.25+ answers with the engine id; the client sees its own, as it
    # would from vLLM directly (else the frontend's id standing in for vLLM's uuid).
    body = {"token_ids": [1], "sampling_params": {}, **({"request_id": body_id} if body_id else {})}
    ex = exchange(body, **headers)
    answer = {"request_id": f"generate-tokens-{ENGINE_ID}", "model": "sim",
              "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [2]}], "usage": None}
    ex.feed(ATTEMPT, orjson.dumps(answer))
    assert ex.unary_body() == (200, orjson.dumps({**answer, "request_id": shown}))


def test_unary_answer_with_a_random_uuid_passes_untouched():
    # Before 0.25 vLLM answers with a fresh uuid whatever it was sent.
    ex = exchange({"token_ids": [1], "request_id": "mine", "sampling_params": {}})
    answer = unary_answer([2], "stop", None)
    ex.feed(ATTEMPT, answer)
    assert ex.unary_body() == (200, answer)


@pytest.mark.parametrize(
    "usage, counts",
    [(None, (None, None, None)),
     ({"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": None}, (2, 1, None)),
     ({"prompt_tokens": 2, "completion_tokens": None, "prompt_tokens_details": {"cached_tokens": None}},
      (2, None, None))],
    ids=["no_usage", "no_details", "null_counts"],
)
def test_unary_answer_usage_only_where_it_is_counted(usage, counts):
    ex = exchange({"token_ids": [1, 2], "sampling_params": {}})
    answer = unary_answer([2], "stop", usage)
    prompt, completion, cached = counts
    assert ex.feed(ATTEMPT, answer) == Event(
        [2], "stop", prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
    assert ex.unary_body() == (200, answer)


@pytest.mark.parametrize("stream", [False, True])
def test_client_kv_transfer_params_are_refused(stream):
    body = {"token_ids": [1, 2], "stream": stream, "sampling_params": {"max_tokens": 1},
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    with pytest.raises(RequestError) as exc:
        decode(body)
    assert (exc.value.status, orjson.loads(CODEC.error_body(exc.value))) == (400, {"error": {
        "message": "kv_transfer_params is set by the frontend for prefill/decode routing; do not send it.",
        "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}})


def test_stream_without_finish_reason_ended_by_abort():
    ex = exchange({"token_ids": [1], "stream": True, "sampling_params": {}})
    assert ex.feed(ATTEMPT, chunk([4])) == Event([4])
    assert ex.feed(ATTEMPT, usage_chunk(1, 1)) == Event([], "abort", prompt_tokens=1, completion_tokens=1)
    assert ex.client_event(None) is None


@pytest.mark.parametrize("include_usage", [True, False])
def test_stream_without_usage_chunk_finishes_with_the_held_reason(include_usage):
    ex = exchange({"token_ids": [1], "stream": True, "request_id": "c",
                   "stream_options": {"include_usage": include_usage}, "sampling_params": {}})
    ex.feed(ATTEMPT, chunk([4]))
    assert ex.end_of_stream(ATTEMPT) is None  # no finish reason yet: cut short
    assert ex.feed(ATTEMPT, chunk([5], "length")) == Event([5])
    assert ex.client_event(None) == (
        b'{"request_id":"generate-tokens-c","choices":[{"index":0,"logprobs":null,"finish_reason":"length",'
        b'"token_ids":[5],"routed_experts":null}],"usage":null}'
    )
    assert ex.end_of_stream(ATTEMPT) == Event([], "length")
    assert ex.client_event(None) is None


def test_unary_end_of_stream_is_never_a_finish():
    ex = exchange({"token_ids": [1], "sampling_params": {}})
    assert ex.end_of_stream(ATTEMPT) is None


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    "error, status",
    [({"message": "engine died", "type": "InternalServerError", "param": None, "code": 500}, 500),
     ({"message": "bad", "type": "BadRequestError", "param": "x", "code": 400}, 400),
     ({"message": "odd", "code": 200}, 500), ({"message": "odd"}, 500)],
    ids=["500", "400", "code_200", "no_code"],
)
def test_engine_error_payload(stream, error, status):
    ex = exchange({"token_ids": [1], "stream": stream, "sampling_params": {}})
    payload = orjson.dumps({"error": error})
    event = ex.feed(ATTEMPT, payload)
    assert event == Event([], error=EngineError(status, error["message"]))
    if stream:
        assert ex.client_event(event) == payload
    else:
        assert ex.unary_body() == (status, payload)


@pytest.mark.parametrize(
    "stream, payload, why",
    [(True, b"{", "the chunk is not JSON"), (True, b"[1]", "the chunk is a list, expected an object"),
     (True, b'{"request_id":"x"}', "choices is missing, expected a list"),
     (True, b'{"choices":[]}', "usage is missing, expected an object in a chunk without choices"),
     (True, b'{"choices":[{"index":0,"token_ids":["a"]}]}', "choices[0].token_ids[0] is a string, expected an integer"),
     (True, b'{"choices":[{"index":0,"token_ids":[1],"finish_reason":1}]}',
      "choices[0].finish_reason is an integer, expected a string"),
     (True, b'{"error":{"message":"odd","code":"400"}}', "error.code is a string, expected an integer"),
     (True, b'{"error":"flat text"}', "error is a string, expected an object"),
     (False, b"", "the body is not JSON"), (False, b'"x"', "the body is a string, expected an object"),
     (False, b'{"choices":null}', "choices is null, expected a list"),
     (False, b'{"choices":[]}', "choices is empty, expected at least one choice"),
     (False, b'{"choices":[{"index":0,"token_ids":null,"finish_reason":"stop"}]}',
      "choices[0].token_ids is null, expected a list of integers"),
     (False, b'{"choices":[{"index":0,"token_ids":[1],"finish_reason":null}]}',
      "choices[0].finish_reason is null, expected a string"),
     (False, b'{"choices":[{"token_ids":[1],"finish_reason":"stop"}]}', "choices[0].index is missing, expected an integer"),
     (False, b'{"error":{"code":500}}', "error.message is missing, expected a string")],
)
def test_worker_protocol_breaks_are_502(stream, payload, why):
    with pytest.raises(WorkerAnswerError) as err:
        exchange({"token_ids": [1], "stream": stream, "sampling_params": {}}).feed(ATTEMPT, payload)
    assert (err.value.status, err.value.kind, err.value.message) == (502, "bad_worker_answer", f"worker answer: {why}")


def test_worker_errors_pass_through():
    body = b'{"error":{"message":"m","type":"NotFoundError","param":"model","code":404}}'
    assert exchange({"token_ids": [1], "sampling_params": {}}).worker_error(404, body) == (404, body)


@pytest.mark.parametrize(
    "error, shape",
    [
        (RequestError(413, "too big", "too_large"), ("Request Entity Too Large", 413)),
        (RequestError(503, "no healthy worker", "unavailable"), ("Service Unavailable", 503)),
        (RequestError(500, "internal error", "internal"), ("InternalServerError", 500)),
        (RequestError(502, "worker w0 failed", "engine"), ("Bad Gateway", 502)),
        (RequestError(405, "Method Not Allowed", "method_not_allowed"), ("Method Not Allowed", 405)),
        (RequestError(400, "invalid content-length header"), ("BadRequestError", 400)),
    ],
)
def test_frontend_errors_in_vllm_shape(error, shape):
    want = {"error": {"message": error.message, "type": shape[0], "param": None, "code": shape[1]}}
    assert orjson.loads(CODEC.error_body(error)) == want
    assert orjson.loads(CODEC.in_band_error(error)) == want


@pytest.mark.parametrize(
    "body, message, param",
    [
        (b"", "{'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': 'None'}", "body"),
        (b"[1]", "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or "
                 "object to extract fields from', 'input': '<list of 1 items>'}", "body"),
        ({"token_ids": [1], "stream": {}, "sampling_params": {}}, "{'type': 'bool_type', 'loc': 'body.stream', "
         "'msg': 'Input should be a valid boolean', 'input': '<dict of 0 items>'}", "body.stream"),
        ({"token_ids": [1], "stream": 5, "sampling_params": {}}, "{'type': 'bool_parsing', 'loc': 'body.stream', "
         "'msg': 'Input should be a valid boolean, unable to interpret input', 'input': '5'}", "body.stream"),
        ({"token_ids": [1], "priority": None, "sampling_params": {}}, "{'type': 'int_type', 'loc': 'body.priority', "
         "'msg': 'Input should be a valid integer', 'input': 'None'}", "body.priority"),
        ({"token_ids": [1], "sampling_params": {}, "features": {"mm_hashes": {}, "mm_placeholders": {},
          "kwargs_data": {"image": [1]}}}, "{'type': 'string_type', 'loc': 'body.features.kwargs_data.image.0', "
         "'msg': 'Input should be a valid string', 'input': '1'}", "body.features.kwargs_data.image.0"),
        ({"token_ids": ["x" * 300], "sampling_params": {}}, "{'type': 'int_parsing', 'loc': 'body.token_ids.0', "
         f"'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': '{'x' * 200}"
         "...[truncated]'}", "body.token_ids.0"),
        ({"token_ids": [1], "stream": "maybe", "sampling_params": {}}, "{'type': 'bool_parsing', 'loc': 'body.stream', "
         "'msg': 'Input should be a valid boolean, unable to interpret input', 'input': 'maybe'}", "body.stream"),
    ],
)
def test_schema_errors_in_vllm_validation_shape(body, message, param):
    with pytest.raises(RequestError) as err:
        decode(body)
    assert err.value.status == 400
    assert orjson.loads(CODEC.error_body(err.value)) == {
        "error": {"message": f"1 validation error:\n  {message}", "type": "Bad Request", "param": param, "code": 400}}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_sampling_params_are_refused_as_vllm_refuses_them(case):
    """vLLM lists every error: the ``is-instance`` branch of the
    ``SamplingParams`` union first, then each field's in vLLM's order."""
    with pytest.raises(RequestError) as err:
        decode(malformed_body(case))
    status, body = MALFORMED[case][1]
    assert (err.value.status, orjson.loads(CODEC.error_body(err.value))) == (status, body)


@pytest.mark.parametrize("salt, why", [
    (5, "must be a non-empty string if provided."),
    ("", "must be a non-empty string if provided."),
    ("a/b", "must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."),
])
def test_cache_salt_is_refused_before_any_field(salt, why):
    """vLLM's ``_validate_cache_salt`` runs before pydantic reads a field
    and raises a ``VLLMValidationError`` (no ``ValueError``), so a refused
    body with a bad salt gets that ``BadRequestError`` alone."""
    with pytest.raises(RequestError) as err:
        decode({"token_ids": "x", "sampling_params": None, "cache_salt": salt})
    assert orjson.loads(CODEC.error_body(err.value)) == {"error": {
        "message": f"Parameter 'cache_salt' {why} (parameter=cache_salt)", "type": "BadRequestError",
        "param": "cache_salt", "code": 400}}


def test_refusals_list_ten_errors_then_count_the_rest():
    with pytest.raises(RequestError) as err:
        decode({"token_ids": [str(i) + "x" for i in range(12)], "sampling_params": {}})
    message = orjson.loads(CODEC.error_body(err.value))["error"]["message"]
    lines = message.split("\n")
    assert (lines[0], len(lines), lines[-1]) == ("12 validation errors:", 12, "  ...and 2 more errors")
    assert lines[10] == ("  {'type': 'int_parsing', 'loc': 'body.token_ids.9', 'msg': 'Input should be a valid "
                         "integer, unable to parse string as an integer', 'input': '9x'}")


def test_values_pydantic_reads_laxly_are_served_converted():
    """vLLM's pydantic models read ``"8"``/``8.0`` as 8 and ``1``/``"yes"``
    as true: the frontend must not refuse them, and forwards them converted."""
    body = {"token_ids": ["5", 6.0], "stream": 1, "priority": "1",
            "stream_options": {"include_usage": "yes"}, "sampling_params": {"max_tokens": "8", "n": 1.0}}
    req = decode(body)
    assert (req.stream, req.input_ids, req.max_new_tokens) == (True, [5, 6], 8)
    assert req.native.body == {"token_ids": [5, 6], "stream": True, "priority": 1,
                               "stream_options": {"include_usage": True}, "sampling_params": {"max_tokens": 8, "n": 1}}
    assert req.native.include_usage is True


ENGINE_JUDGES = {
    "no_sampling_params": {"token_ids": [1, 2, 3]},
    "n2": {"token_ids": [1], "sampling_params": {"n": 2}},
    "n0": {"token_ids": [1], "sampling_params": {"n": 0}},
    "max_tokens0": {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
    "logprobs_negative": {"token_ids": [1], "sampling_params": {"logprobs": -2}},
    "logprobs_not_an_int": {"token_ids": [1], "sampling_params": {"logprobs": "2"}},
    "temperature_negative": {"token_ids": [1], "sampling_params": {"temperature": -1}},
    "stop_without_detokenize": {"token_ids": [1], "sampling_params": {"stop": ["x"], "detokenize": False}},
    "unknown_fields": {"token_ids": [1], "sampling_params": {"future_knob": 1}, "output_mode": "tokens"},
    "features_outside_prompt": {"token_ids": [1, 2, 3], "sampling_params": {}, "features": {
        "mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 9}]}}},
    "features_modalities_differ": {"token_ids": [1, 2, 3], "features": {
        "mm_hashes": {"image": ["h"]}, "mm_placeholders": {"audio": [{"offset": 0, "length": 1}]}}},
}


@pytest.mark.parametrize("case", list(ENGINE_JUDGES))
def test_values_only_the_engine_judges_pass_through_untouched(case):
    # The frontend relies on none of these; the worker's vLLM version answers.
    body = ENGINE_JUDGES[case]
    wreq = exchange(body).worker_request(ATTEMPT)
    assert orjson.loads(wreq.body) == body


@pytest.mark.parametrize(
    "body, kind",
    [(b'{"token_ids": [1,', "invalid_json"), ({"token_ids": "1"}, "invalid_request"),
     ({"token_ids": [1], "sampling_params": {"n": "two"}}, "invalid_request"),
     ({"token_ids": [1], "stream": 2}, "invalid_request"), ({"token_ids": []}, "invalid_request")],
)
def test_a_wrongly_typed_field_is_an_invalid_request_not_invalid_json(body, kind):
    with pytest.raises(RequestError) as err:
        decode(body)
    assert (err.value.status, err.value.kind) == (400, kind)


OLD, NEW = Attempt(ENGINE_ID, worker_info={"version": "0.31.0"}), Attempt(ENGINE_ID, worker_info={"version": "0.32.0"})
UNKNOWN = Attempt(ENGINE_ID, worker_info={"version": None})


def answer(choices, completion) -> bytes:
    return orjson.dumps({"request_id": "u", "choices": choices,
                         "usage": {"prompt_tokens": 1, "total_tokens": 1 + completion, "completion_tokens": completion}})


@pytest.mark.parametrize("attempt, matched", [(NEW, 978), (OLD, None), (UNKNOWN, None)])
def test_stop_reason_is_read_only_from_a_version_that_sends_it(attempt, matched):
    choice = {"index": 0, "finish_reason": "stop", "stop_reason": 978, "token_ids": [5, 978]}
    event = exchange({"token_ids": [1]}).feed(attempt, answer([choice], 2))
    assert (event.token_ids, event.finish_reason, event.matched) == ([5, 978], "stop", matched)
    ex = exchange({"token_ids": [1], "stream": True})
    ex.feed(attempt, orjson.dumps({"request_id": "x", "choices": [choice], "usage": None}))
    assert ex.feed(attempt, usage_chunk(1, 2)).matched == matched


def test_unary_n_choices_count_every_choices_tokens():
    choices = [{"index": i, "finish_reason": "length", "token_ids": [7, 8, 9]} for i in range(3)]
    payload = answer(choices, 9)
    ex = exchange({"token_ids": [1], "sampling_params": {"n": 3, "max_tokens": 3}})
    event = ex.feed(NEW, payload)
    assert (event.token_ids, event.finish_reason, event.completion_tokens) == ([7, 8, 9] * 3, "length", 9)
    assert ex.unary_body() == (200, payload)


def n_chunk(index, ids, finish=None) -> bytes:
    return orjson.dumps({"request_id": "x", "usage": None, "choices": [
        {"index": index, "logprobs": None, "finish_reason": finish, "token_ids": ids, "routed_experts": None}]})


@pytest.mark.parametrize("usage", [True, False])
def test_stream_n_choices_finish_when_every_choice_did(usage):
    ex = exchange({"token_ids": [1], "stream": True, "sampling_params": {"n": 2}})
    counted = 0
    for step in range(2):
        for index in range(2):
            event = ex.feed(NEW, n_chunk(index, [40 + step], "length" if step == 1 else None))
            counted += len(event.token_ids)
            assert event.finish_reason is None
            if step == 0 and index == 0:
                assert ex.end_of_stream(NEW) is None  # choice 1 has not finished
    assert counted == 4
    if usage:
        assert ex.feed(NEW, usage_chunk(1, 4)).finish_reason == "length"
    else:
        assert ex.end_of_stream(NEW).finish_reason == "length"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(["token_ids", "sampling_params", "features", "stream", "stream_options", "request_id",
                          "model", "priority", "kv_transfer_params", "cache_salt"])
nearly_valid = st.fixed_dictionaries(
    {"token_ids": st.lists(st.integers(-3, 9), max_size=4),
     "sampling_params": st.dictionaries(st.sampled_from(["n", "max_tokens", "logprobs", "prompt_logprobs",
                                                         "stop_token_ids", "ignore_eos"]), json_values, max_size=3)},
).flatmap(lambda base: st.dictionaries(fields, json_values, max_size=3).map(lambda extra: {**base, **extra}))


ACCEPTED: list[bool] = []


plausible = st.fixed_dictionaries(
    {"token_ids": st.lists(st.integers(0, 9), min_size=1, max_size=4)},
    optional={
        "sampling_params": st.fixed_dictionaries(
            {}, optional={"n": st.integers(-1, 4), "max_tokens": st.none() | st.integers(-1, 9),
                          "logprobs": json_values, "temperature": json_values, "stop": json_values}),
        "stream": st.none() | st.booleans(),
        "stream_options": st.none() | st.fixed_dictionaries({}, optional={"include_usage": st.none() | st.booleans()}),
        "request_id": st.text(max_size=4), "model": st.none() | st.text(max_size=3),
        "priority": st.integers(-3, 3), "future_field": json_values,
    },
)


@settings(max_examples=300, deadline=None, database=None)
@given(body=json_values | nearly_valid | plausible, header=st.none() | st.text("abc", max_size=3))
def decode_law(body, header):
    """Decode rejects only with a vLLM error; what it accepts reaches the
    worker as the client sent it."""
    headers = {"x_request_id": header} if header is not None else {}
    try:
        req = decode(body, **headers)
    except RequestError as err:
        ACCEPTED.append(False)
        event("rejected")
        assert err.status == 400
        assert set(orjson.loads(CODEC.error_body(err))["error"]) == {"message", "type", "param", "code"}
        return
    ACCEPTED.append(True)
    event("accepted")
    assert req.input_ids is None or (req.input_ids and min(req.input_ids) >= 0)
    wreq = exchange(body, **headers).worker_request(ATTEMPT)
    sent = orjson.loads(wreq.body)
    assert wreq.stream is req.stream
    if not req.stream:  # a unary leg is the client's body (the minted id in the header)
        assert sent == body


def test_decode_only_ever_rejects_with_a_vllm_error_and_accepts_a_fair_share():
    ACCEPTED.clear()
    decode_law()
    # Bodies near the schema must get through often enough for the accepted
    # branch (the pass-through law) to be exercised, not only the rejects.
    assert len(ACCEPTED) == 300
    assert sum(ACCEPTED) >= 60, f"only {sum(ACCEPTED)} of 300 bodies were accepted"


def _usage_payload(rid: str, prompt: int, completion: int, cached: int | None, ids=()) -> bytes:
    details = None if cached is None else {"cached_tokens": cached}
    choices = [{"index": 0, "logprobs": None, "finish_reason": None, "token_ids": list(ids)}] if ids else []
    return orjson.dumps({"request_id": rid, "choices": choices, "usage": {
        "prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
        "prompt_tokens_details": details}})


@pytest.mark.parametrize("first_cached,resumed_cached,shown", [
    (2, 7, {"cached_tokens": 2}),   # the first leg's, from its continuous usage
    (None, 7, {"cached_tokens": 3}),  # unknown: the resumed leg's, capped at the original prompt
    (None, 1, {"cached_tokens": 1}),
])
def test_resumed_usage_reads_as_the_uninterrupted_requests(first_cached, resumed_cached, shown):
    """A resumed stream's usage: prompt_tokens the original prompt (3),
    completion_tokens all output, total unchanged, and cached tokens the
    first leg's when a continuous-usage chunk showed them, else the resumed
    leg's capped at the original prompt (what it found cached past it is
    re-fed output, which the uninterrupted request computed)."""
    ex = exchange({"token_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_tokens": 6},
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    first = Attempt("a" * 32, "aggregated")
    ex.worker_request(first)
    rid = "generate-tokens-" + "a" * 32
    if first_cached is not None:
        ex.feed(first, _usage_payload(rid, 3, 1, first_cached, [10]))
    resumed = Attempt("b" * 32, "resumed", resumes=[10, 11])
    body = orjson.loads(ex.worker_request(resumed).body)
    assert (body["token_ids"], body["sampling_params"]["max_tokens"]) == ([1, 2, 3, 10, 11], 4)
    event = ex.feed(resumed, _usage_payload("generate-tokens-" + "b" * 32, 5, 4, resumed_cached))
    usage = orjson.loads(ex.client_event(event))["usage"]
    assert usage == {"prompt_tokens": 3, "total_tokens": 9, "completion_tokens": 6, "prompt_tokens_details": shown}
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (3, 6, shown["cached_tokens"])


def test_n_past_max_items_is_refused_in_vllms_shape():
    codec = VLLMCodec()
    codec.max_items = 4
    raw = orjson.dumps({"token_ids": [1], "sampling_params": {"max_tokens": 1, "n": 4}})
    assert len(codec.decode(raw, {b"content-type": b"application/json"}).items) == 4
    with pytest.raises(RequestError) as err:
        decode({"token_ids": [1], "sampling_params": {"max_tokens": 1, "n": 100000}})
    message = "sampling_params.n must be at most 16384 on this server (--max-request-items), got 100000."
    assert (err.value.status, CODEC.error_body(err.value)) == (400, orjson.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}))


def _refusal(*lines: str) -> bytes:
    message = f"{len(lines)} validation error{'s' if len(lines) > 1 else ''}:\n" + "\n".join(f"  {x}" for x in lines)
    return orjson.dumps({"error": {"message": message, "type": "Bad Request", "param": "body.sampling_params",
                                   "code": 400}})


def test_restore_echo_shows_the_clients_body_by_size_and_by_repr():
    client = {"token_ids": [1], "stream": True, "sampling_params": {"max_tokens": "3", "temperature": "hot"}}
    sent = {"token_ids": [1], "stream": True, "sampling_params": {"max_tokens": 3, "temperature": "hot"},
            "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    missing = "{'type': 'missing', 'loc': 'body.x', 'msg': 'Field required', 'input': '<dict of %d items>'}"
    inner = ("{'type': 'is_instance_of', 'loc': 'body.sampling_params', 'msg': 'Input should be an instance of "
             "SamplingParams', 'input': '<dict of 2 items>', 'ctx': {'class': 'SamplingParams'}}")
    assert restore_echo(_refusal(missing % 4, inner), sent, orjson.dumps(client)) == _refusal(missing % 3, inner)
    # Before 0.30: the whole repr, the body's and sampling_params' own.
    old = "{'type': 'missing', 'loc': ('body', 'x'), 'msg': 'Field required', 'input': %r}"
    old_inner = "{'type': 'is_instance_of', 'loc': ('body', 'sampling_params', 'is-instance[SamplingParams]'), " \
                "'msg': 'Input should be an instance of SamplingParams', 'input': %r}"
    got = restore_echo(_refusal(old % sent, old_inner % sent["sampling_params"]), sent, client)
    assert got == _refusal(old % client, old_inner % client["sampling_params"])
    # Anything else passes byte for byte.
    for payload in (_refusal(inner), b'{"error":{"message":"max_tokens must be at least 1, got 0.","code":400}}',
                    b"not json"):
        assert restore_echo(payload, sent, client) is payload


def test_a_body_with_more_error_sites_than_the_bound_gets_the_first_error():
    # pydantic builds every error it finds: past MAX_ERROR_SITES the
    # refusal is the fast check's first error, not millions of them.
    ids = ["x"] * (MAX_ERROR_SITES + 1)
    with pytest.raises(RequestError) as err:
        decode({"token_ids": ids, "sampling_params": {}})
    assert orjson.loads(CODEC.error_body(err.value)) == {"error": {
        "message": "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.token_ids.0', 'msg': 'Input should "
                   "be a valid integer, unable to parse string as an integer', 'input': 'x'}",
        "type": "Bad Request", "param": "body.token_ids.0", "code": 400}}
    with pytest.raises(RequestError) as err:
        decode({"token_ids": ids[1:], "sampling_params": {}})
    assert orjson.loads(CODEC.error_body(err.value))["error"]["message"].startswith("10000 validation errors:\n")


def _finishing(rid: str, ids: list[int], finish: str, spans) -> bytes:
    return orjson.dumps({"request_id": rid, "choices": [
        {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": ids, "routed_experts": None,
         "sampling_mask": None, "weight_versions": spans, "logprobs": None}], "usage": None})


def _span(v, a, b):
    return {"version": v, "start": a, "end": b}


@pytest.mark.parametrize("first_spans,expected", [
    # The held leg's abort reported its tokens' versions.
    ([_span("v0", 0, 2)], [_span("v0", 0, 2), _span("v1", 2, 5)]),
    # A lost leg reported none: its worker's version when it was sent.
    (None, [_span("w0", 0, 2), _span("v1", 2, 5)]),
])
def test_a_resumed_streams_finished_choice_gives_weight_versions_over_the_whole_answer(first_spans, expected):
    ex = exchange({"token_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_tokens": 5}})
    first = Attempt("a" * 32, "aggregated", worker_info={"weight_version": "w0"})
    ex.worker_request(first)
    rid = "generate-tokens-" + "a" * 32
    assert ex.feed(first, _finishing(rid, [10], None, None)).weight_spans is None
    if first_spans is not None:
        event = ex.feed(first, _finishing(rid, [11], "abort", first_spans))
        assert event.weight_spans == [("v0", 0, 2)]
    else:
        ex.feed(first, _finishing(rid, [11], None, None))
    resumed = Attempt("b" * 32, "resumed", worker_info={"weight_version": "v1"}, resumes=[10, 11])
    ex.worker_request(resumed)
    event = ex.feed(resumed, _finishing("generate-tokens-" + "b" * 32, [12, 13, 14], "length", [_span("v1", 0, 3)]))
    # The leg's own spans for the record; the whole answer's for the client.
    assert event.weight_spans == [("v1", 0, 3)]
    assert orjson.loads(ex.client_event(event))["choices"][0]["weight_versions"] == expected


def test_weight_versions_of_the_wrong_shape_are_a_worker_answer_error():
    ex = exchange({"token_ids": [1], "stream": True, "sampling_params": {"max_tokens": 1}})
    ex.worker_request(ATTEMPT)
    with pytest.raises(WorkerAnswerError) as err:
        ex.feed(ATTEMPT, _finishing(f"generate-tokens-{ENGINE_ID}", [5], "length", [{"version": 1, "start": 0}]))
    assert err.value.message == ("worker answer: choices[0].weight_versions[0] is an object, "
                                 "expected an object with a string version and integer start and end")


def _aborting(ids: list[int], rid: str = f"generate-tokens-{ENGINE_ID}") -> dict:
    """vLLM 0.33's chunk that ends a choice with ``abort`` (``serve_tokens``'
    choice fields; the version spans its output processor reports)."""
    return {"request_id": rid, "choices": [
        {"index": 0, "logprobs": None, "finish_reason": "abort", "stop_reason": None, "token_ids": ids,
         "routed_experts": None, "sampling_mask": None, "weight_versions": [_span("v0", 0, 2 + len(ids))]}],
        "usage": None}


def _stream(include_usage: bool) -> "object":
    body = {"token_ids": [1, 2], "request_id": "c", "stream": True, "sampling_params": {}}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    ex = exchange(body)
    ex.worker_request(ATTEMPT)
    assert ex.feed(ATTEMPT, chunk([7, 8])) == Event([7, 8])
    assert ex.client_event(None) is not None
    return ex


@pytest.mark.parametrize("ids", [[9], []], ids=["tokens", "finish-only"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_an_aborting_chunk_is_withheld_until_the_end_and_rendered_as_vllm_sent_it(ids, include_usage):
    ex = _stream(include_usage)
    withheld = ex.feed(ATTEMPT, orjson.dumps(_aborting(ids)))
    # Nothing of it yet: its tokens go with the end event; its versions count for the leg now.
    assert (withheld.token_ids, withheld.finish_reason, withheld.weight_spans) == ([], None, [("v0", 0, 2 + len(ids))])
    assert ex.client_event(withheld) is None
    end = ex.feed(ATTEMPT, usage_chunk(2, 2 + len(ids)))
    assert (end.token_ids, end.finish_reason, end.completion_tokens) == (ids, "abort", 2 + len(ids))
    shown = orjson.dumps(_aborting(ids, "generate-tokens-c"))
    usage = (b'{"request_id":"generate-tokens-c","choices":[],'
             b'"usage":{"prompt_tokens":2,"total_tokens":%d,"completion_tokens":%d}}' % (4 + len(ids), 2 + len(ids)))
    # Not held: vLLM's own chunk, abort and all, then the usage chunk when asked.
    assert ex.client_event(end) == ((shown, usage) if include_usage else shown)


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_held_streams_aborting_chunk_shows_its_tokens_as_a_running_chunk(include_usage):
    ex = _stream(include_usage)
    ex.feed(ATTEMPT, orjson.dumps(_aborting([9, 10])))
    end = ex.feed(ATTEMPT, usage_chunk(2, 4))
    end.finish_reason, end.held = None, True  # the handler holds the stream across the pause
    assert ex.client_event(end) == (
        b'{"request_id":"generate-tokens-c","choices":[{"index":0,"logprobs":null,"finish_reason":null,'
        b'"stop_reason":null,"token_ids":[9,10],"routed_experts":null,"sampling_mask":null,'
        b'"weight_versions":null}],"usage":null}'
    )


def test_a_held_streams_finish_only_abort_shows_nothing_and_the_next_leg_starts_clean():
    ex = _stream(True)
    ex.feed(ATTEMPT, orjson.dumps(_aborting([])))
    end = ex.feed(ATTEMPT, usage_chunk(2, 2))
    end.finish_reason, end.held = None, True
    assert ex.client_event(end) is None
    # A hold whose end event had no tokens is never rendered: the resumed leg drops it.
    ex2 = _stream(True)
    ex2.feed(ATTEMPT, orjson.dumps(_aborting([])))
    ex2.feed(ATTEMPT, usage_chunk(2, 2))
    resumed = Attempt("b" * 32, "resumed", worker_info={}, resumes=[7, 8])
    ex2.worker_request(resumed)
    event = ex2.feed(resumed, chunk([11], "length", rid="generate-tokens-" + "b" * 32))
    assert event == Event([11]) and orjson.loads(ex2.client_event(event))["choices"][0]["finish_reason"] == "length"
    last = ex2.feed(resumed, usage_chunk(4, 1))
    assert (last.token_ids, last.finish_reason, last.completion_tokens) == ([], "length", 3)
    assert orjson.loads(ex2.client_event(last))["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("held", [True, False])
def test_a_build_without_the_usage_chunk_releases_the_aborting_chunk_at_the_streams_end(held):
    ex = _stream(True)
    ex.feed(ATTEMPT, orjson.dumps(_aborting([9])))
    end = ex.end_of_stream(ATTEMPT)
    assert (end.token_ids, end.finish_reason) == ([9], "abort")
    if held:
        end.finish_reason, end.held = None, True
    shown = orjson.loads(ex.client_event(end))["choices"][0]
    assert (shown["token_ids"], shown["finish_reason"]) == ([9], None if held else "abort")


def test_n_choices_pass_an_aborting_chunk_through_at_once():
    ex = exchange({"token_ids": [1], "stream": True, "sampling_params": {"n": 2}})
    event = ex.feed(ATTEMPT, n_chunk(1, [5], "abort"))
    assert event.token_ids == [5] and orjson.loads(ex.client_event(event))["choices"][0]["finish_reason"] == "abort"
