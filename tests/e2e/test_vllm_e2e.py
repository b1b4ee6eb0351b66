"""End to end: the vLLM-native format through the frontend, against the
simulator in ``--protocol vllm`` mode asked directly.

The simulators here play vLLM 0.27.0 (``"token_id:N"`` logprob labels, no
``stop_reason``), whose answers these tests spell out in full; the newer
schema, and every fact checked for each version the simulator plays, is in
``test_vllm_endpoints.py``.

Every comparison is value for value (floats within two ULP). What may differ
is only what vLLM itself makes up per request: a unary answer's random
``request_id`` and its ``created`` second. Unary answers are the worker's own
(``prompt_logprobs`` and ``kv_transfer_params`` included); streams also end
right for a worker that sends no usage chunk (``sim --no-usage-chunk``).
"""

from __future__ import annotations

import re
import time

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import CONTINUATION, PROMPT, RawClient, same, start_frontend, start_sim, wait_until, trace_lines

pytestmark = pytest.mark.e2e

GEN = "/inference/v1/generate"
JSON = {"content-type": "application/json"}
OLD = ["--engine-version", "0.27.0"]
# One keep-alive client: a fresh httpx client per call costs ~25 ms.
HTTP = httpx.Client(timeout=30)


# Session scope: an xdist worker may come back to this module after another
# (--dist worksteal), and a module teardown would have closed what it reuses.
@pytest.fixture(scope="session", autouse=True)
def _close_http():
    yield
    HTTP.close()


def post(url: str, body: dict | bytes, path: str, **kw) -> httpx.Response:
    """POST a JSON object (or raw bytes) as ``application/json`` unless
    ``headers`` says otherwise; return the whole response."""
    headers = {**JSON, **kw.pop("headers", {})}
    return HTTP.post(url + path, content=body if isinstance(body, bytes) else orjson.dumps(body),
                     headers=headers, **kw)


def sse(url: str, body: dict, path: str, **kw) -> tuple[int, list[bytes]]:
    """POST ``body`` as JSON; the status and every SSE ``data`` payload."""
    headers = {**JSON, **kw.pop("headers", {})}
    with HTTP.stream("POST", url + path, content=orjson.dumps(body), headers=headers, **kw) as resp:
        raw = b"".join(resp.iter_bytes())
    blocks = [b.split(b"\n") for b in raw.split(b"\n\n")]
    return resp.status_code, [line[6:] for block in blocks for line in block if line.startswith(b"data: ")]


def stats(sim) -> dict:
    return HTTP.get(sim.url + "/sim/stats").json()


@pytest.fixture(scope="session")
def vsim():
    """One vLLM simulator without delays: the only vLLM worker behind ``vfront``."""
    proc = start_sim("vllm", extra=OLD)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def ssim():
    """One SGLang simulator, configured beside ``vsim``."""
    proc = start_sim("sglang")
    yield proc
    proc.stop()


@pytest.fixture(scope="session", params=["trio", "asyncio"])
def vfront(request, vsim, ssim):
    """The frontend in front of both simulators, once per worker class."""
    proc = start_frontend([f"vllm={vsim.url}", f"sglang={ssim.url}"], worker_class=request.param)
    yield proc
    proc.stop()


def direct(sim, body: dict, **headers) -> httpx.Response:
    """The simulator's own unary answer (vLLM requires a JSON content type)."""
    return post(sim.url, body, GEN, headers={**JSON, **headers})


def direct_sse(sim, body: dict, **headers) -> tuple[int, list[bytes]]:
    return sse(sim.url, body, GEN, headers={**JSON, **headers})


def made_up(answer: dict) -> dict:
    """A unary answer without its id (the engine id: vLLM's random uuid, or
    the frontend's request id standing in for it, when the client named
    none) and clock."""
    assert answer["request_id"].startswith("generate-tokens-"), answer["request_id"]
    assert isinstance(answer["created"], int)
    return {k: v for k, v in answer.items() if k not in ("request_id", "created")}


def events(payloads: list[bytes]) -> list:
    assert payloads[-1] == b"[DONE]"
    return [orjson.loads(p) for p in payloads[:-1]]


def check_parity(front, sim, body: dict) -> None:
    if body.get("stream"):
        body = {"request_id": "parity", **body}  # both answers then show one id
        status, got = sse(front.url, body, GEN)
        want_status, want = direct_sse(sim, body)
        assert (status, want_status) == (200, 200)
        same(events(got), events(want))
    else:
        got, want = post(front.url, body, GEN), direct(sim, body)
        assert (got.status_code, want.status_code) == (200, 200)
        if "request_id" in body:  # then both show the caller's id
            assert got.json()["request_id"] == want.json()["request_id"]
        same(made_up(got.json()), made_up(want.json()))


# -- answers -----------------------------------------------------------------


def test_unary_answer_exact(vfront):
    body = {"token_ids": PROMPT, "model": "sim", "sampling_params": {"max_tokens": 2, "logprobs": 1}}
    t0 = int(time.time())
    r = post(vfront.url, body, GEN)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert t0 <= r.json()["created"] <= int(time.time())  # the engine's clock
    assert made_up(r.json()) == {
        "model": "sim",
        "choices": [
            {
                "index": 0,
                "logprobs": {
                    "content": [
                        {
                            "token": "token_id:2358", "logprob": -0.2015838623046875, "bytes": None,
                            "top_logprobs": [{"token": "token_id:2358", "logprob": -0.2015838623046875, "bytes": None}],
                        },
                        {
                            "token": "token_id:1262", "logprob": -0.74224853515625, "bytes": None,
                            "top_logprobs": [{"token": "token_id:1262", "logprob": -0.74224853515625, "bytes": None}],
                        },
                    ]
                },
                "finish_reason": "length",
                "token_ids": [2358, 1262],
                "routed_experts": None,
            }
        ],
        "usage": {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2, "prompt_tokens_details": None},
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def test_stream_answer_exact(vfront):
    body = {"token_ids": PROMPT, "request_id": "r1", "stream": True,
            "stream_options": {"include_usage": True}, "sampling_params": {"max_tokens": 2}}
    status, payloads = sse(vfront.url, body, GEN)
    assert status == 200
    assert payloads == [
        b'{"request_id":"generate-tokens-r1","choices":[{"index":0,"logprobs":null,"finish_reason":null,'
        b'"token_ids":[2358],"routed_experts":null}],"usage":null}',
        b'{"request_id":"generate-tokens-r1","choices":[{"index":0,"logprobs":null,"finish_reason":"length",'
        b'"token_ids":[1262],"routed_experts":null}],"usage":null}',
        b'{"request_id":"generate-tokens-r1","choices":[],"usage":{"prompt_tokens":4,"total_tokens":6,'
        b'"completion_tokens":2}}',
        b"[DONE]",
    ]


def test_default_max_tokens_runs_to_eos(vfront):
    r = post(vfront.url, {"token_ids": PROMPT, "model": "sim", "sampling_params": {}}, GEN)
    choice = r.json()["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"]) == (CONTINUATION, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token(vfront, vsim, stream):
    body = {"token_ids": PROMPT, "model": "sim", "stream": stream,
            "sampling_params": {"max_tokens": 10, "stop_token_ids": [978]}}
    if stream:
        _, payloads = sse(vfront.url, body, GEN)
        chunks = events(payloads)
        assert [c["choices"][0]["token_ids"] for c in chunks] == [[2358], [1262], [978]]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    else:
        choice = post(vfront.url, body, GEN).json()["choices"][0]
        assert (choice["token_ids"], choice["finish_reason"]) == ([2358, 1262, 978], "stop")
    check_parity(vfront, vsim, body)


def test_ignore_eos_runs_past_eos(vfront, vsim):
    body = {"token_ids": PROMPT, "model": "sim", "sampling_params": {"max_tokens": 26, "ignore_eos": True}}
    choice = post(vfront.url, body, GEN).json()["choices"][0]
    assert choice["token_ids"][:24] == CONTINUATION and len(choice["token_ids"]) == 26
    assert choice["finish_reason"] == "length"
    check_parity(vfront, vsim, body)


UNARY_CASES = {
    "plain": {"max_tokens": 5},
    "logprobs0": {"max_tokens": 5, "logprobs": 0},
    "logprobs1": {"max_tokens": 5, "logprobs": 1},
    "logprobs5": {"max_tokens": 5, "logprobs": 5},
    "max_tokens1": {"max_tokens": 1, "logprobs": 5},
    "eos": {"logprobs": 2},
}


@pytest.mark.parametrize("prompt", [PROMPT, [7]], ids=["prompt4", "prompt1"])
@pytest.mark.parametrize("case", list(UNARY_CASES))
def test_unary_parity(vfront, vsim, case, prompt):
    check_parity(vfront, vsim, {"token_ids": prompt, "model": "sim", "sampling_params": UNARY_CASES[case]})


STREAM_CASES = {
    "no_options": ({"max_tokens": 5}, None),
    "usage": ({"max_tokens": 5}, {"include_usage": True}),
    "usage_default_true": ({"max_tokens": 5}, {}),
    "usage_off": ({"max_tokens": 5}, {"include_usage": False}),
    "continuous": ({"max_tokens": 5}, {"include_usage": True, "continuous_usage_stats": True}),
    "continuous_without_usage": ({"max_tokens": 5}, {"include_usage": False, "continuous_usage_stats": True}),
    "logprobs0": ({"max_tokens": 4, "logprobs": 0}, {"include_usage": True}),
    "logprobs1": ({"max_tokens": 4, "logprobs": 1}, None),
    "logprobs5": ({"max_tokens": 4, "logprobs": 5}, {"include_usage": True}),
    "prompt_logprobs1": ({"max_tokens": 3, "prompt_logprobs": 1}, {"include_usage": True}),
    "prompt_logprobs3": ({"max_tokens": 3, "prompt_logprobs": 3, "logprobs": 3}, None),
    "max_tokens1": ({"max_tokens": 1}, {"include_usage": True}),
    "eos": ({}, {"include_usage": True, "continuous_usage_stats": True}),
}


@pytest.mark.parametrize("prompt", [PROMPT, [7]], ids=["prompt4", "prompt1"])
@pytest.mark.parametrize("case", list(STREAM_CASES))
def test_stream_parity(vfront, vsim, case, prompt):
    sp, so = STREAM_CASES[case]
    body = {"token_ids": prompt, "request_id": f"s-{case}", "stream": True, "sampling_params": sp}
    if so is not None:
        body["stream_options"] = so
    check_parity(vfront, vsim, body)


def test_sim_prompt_logprobs_exact(vsim):
    r = direct(vsim, {"token_ids": [7, 9, 11], "sampling_params": {"max_tokens": 2, "prompt_logprobs": 2}})
    assert r.json()["prompt_logprobs"] == [
        None,
        {"9": {"logprob": -20.6217041015625, "rank": 534, "decoded_token": None},
         "100": {"logprob": -0.5819854736328125, "rank": 1, "decoded_token": None},
         "1312": {"logprob": -0.9393768310546875, "rank": 2, "decoded_token": None}},
        {"11": {"logprob": -19.022506713867188, "rank": 2537, "decoded_token": None},
         "3336": {"logprob": -0.9548187255859375, "rank": 1, "decoded_token": None},
         "1995": {"logprob": -1.2940521240234375, "rank": 2, "decoded_token": None}},
    ]


def test_sim_prompt_token_in_top_k_keeps_its_place(vsim):
    # After PROMPT the model's top two are 2358, then 2690: a prompt that
    # continues with 2358 lists it once, first, with rank 1.
    r = direct(vsim, {"token_ids": [*PROMPT, 2358], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 2}})
    last = r.json()["prompt_logprobs"][-1]
    assert last == {"2358": {"logprob": -0.2015838623046875, "rank": 1, "decoded_token": None},
                    "2690": {"logprob": -0.8335723876953125, "rank": 2, "decoded_token": None}}


# The simulator's prompt logprobs of PROMPT at k=3: per position the prompt
# token, then the top 3 (no prompt token is among them).
PROMPT_LOGPROBS3 = [
    None,
    {"2": {"logprob": -20.522659301757812, "rank": 79, "decoded_token": None},
     "2671": {"logprob": -0.2759552001953125, "rank": 1, "decoded_token": None},
     "2159": {"logprob": -1.447906494140625, "rank": 2, "decoded_token": None},
     "2964": {"logprob": -2.071044921875, "rank": 3, "decoded_token": None}},
    {"3": {"logprob": -18.865707397460938, "rank": 428, "decoded_token": None},
     "1487": {"logprob": -0.005584716796875, "rank": 1, "decoded_token": None},
     "2006": {"logprob": -0.7931365966796875, "rank": 2, "decoded_token": None},
     "3463": {"logprob": -1.67254638671875, "rank": 3, "decoded_token": None}},
    {"400": {"logprob": -20.571044921875, "rank": 1621, "decoded_token": None},
     "1437": {"logprob": -0.2828521728515625, "rank": 1, "decoded_token": None},
     "1763": {"logprob": -1.004119873046875, "rank": 2, "decoded_token": None},
     "889": {"logprob": -1.406280517578125, "rank": 3, "decoded_token": None}},
]


@pytest.mark.parametrize("k", [None, 0, 1, 3])
def test_unary_prompt_logprobs_through_the_frontend(vfront, vsim, k):
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "prompt_logprobs": k}}
    want = None if k is None else [None, *(dict(list(e.items())[: k + 1]) for e in PROMPT_LOGPROBS3[1:])]
    before = stats(vsim)["received"]
    got = post(vfront.url, body, GEN)
    assert stats(vsim)["received"] == before + 1
    assert got.status_code == 200
    assert got.json()["prompt_logprobs"] == want
    assert got.json()["choices"][0]["token_ids"] == CONTINUATION[:1]
    check_parity(vfront, vsim, body)


KV_REFUSED = {"error": {
    "message": "kv_transfer_params is set by the frontend for prefill/decode routing; do not send it.",
    "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_client_kv_transfer_params_are_refused(vfront, vsim, stream):
    # A P/D proxy's prefill leg (reference section 4) sent by a client: the
    # frontend owns the field (it could name another request's KV blocks),
    # so it is refused before any engine sees it, aggregated fleet or not.
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
          "remote_block_ids": None, "remote_host": None, "remote_port": None}
    body = {"token_ids": PROMPT, "kv_transfer_params": kv, "stream": stream, "sampling_params": {"max_tokens": 1}}
    before = stats(vsim)["received"]
    got = post(vfront.url, body, GEN)
    assert (got.status_code, got.json()) == (400, KV_REFUSED)
    assert stats(vsim)["received"] == before
    # null is no value (vLLM's render routes send it): answered as usual.
    check_parity(vfront, vsim, {**body, "kv_transfer_params": None})


def test_stream_usage_chunk_only_when_asked(vfront):
    base = {"token_ids": PROMPT, "request_id": "u", "stream": True, "sampling_params": {"max_tokens": 3}}
    _, without = sse(vfront.url, base, GEN)
    _, with_usage = sse(vfront.url, {**base, "stream_options": {"include_usage": True}}, GEN)
    assert len(events(without)) == 3 and all(e["choices"] for e in events(without))
    assert events(with_usage)[:3] == events(without)
    assert events(with_usage)[3] == {
        "request_id": "generate-tokens-u", "choices": [],
        "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3},
    }


def test_same_prefix_same_tokens_as_sglang(vfront):
    v = post(vfront.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 30}}, GEN).json()
    s = post(vfront.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30}}, "/generate").json()
    assert v["choices"][0]["token_ids"] == s["output_ids"] == CONTINUATION


def test_multimodal_features_are_forwarded_and_answered(vfront, vsim):
    features = {
        "mm_hashes": {"image": ["h0", "h1"]},
        "mm_placeholders": {"image": [{"offset": 1, "length": 2}, {"offset": 3, "length": 1}]},
        "kwargs_data": {"image": [None, "bXNncGFjaw=="]},
    }
    body = {"token_ids": PROMPT, "model": "sim", "features": features, "sampling_params": {"max_tokens": 3}}
    before = stats(vsim)["received"]
    r = post(vfront.url, body, GEN)
    assert r.status_code == 200
    assert r.json()["choices"][0]["token_ids"] == CONTINUATION[:3]
    assert stats(vsim)["received"] == before + 1
    check_parity(vfront, vsim, body)


def test_sim_control_routes(vsim):
    health = HTTP.get(vsim.url + "/health")
    assert (health.status_code, health.content) == (200, b"")
    (card,) = HTTP.get(vsim.url + "/v1/models").json()["data"]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == ("sim", "model", "vllm", 32768)
    assert HTTP.get(vsim.url + "/generate").status_code == 404


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_only_json_is_accepted_like_vllm(vfront, vsim, content_type):
    """vLLM's route takes JSON only; the frontend answers the same, before any engine."""
    headers = {} if content_type is None else {"content-type": content_type}
    content = orjson.dumps({"token_ids": [1], "sampling_params": {}})
    want = {"error": {"message": "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                      "type": "Bad Request", "param": None, "code": 400}}
    before = stats(vsim)["received"]
    for url in (vsim.url, vfront.url):
        r = httpx.post(url + GEN, content=content, headers=headers, timeout=10)
        assert (r.status_code, r.json()) == (400, want)
    assert stats(vsim)["received"] == before


# -- request ids -------------------------------------------------------------


def minted_rid(sim, before: list[str]) -> str:
    new = stats(sim)["seen_rids"][len(before):]
    assert len(new) == 1
    assert re.fullmatch(r"generate-tokens-[0-9a-f]{32}", new[0]), new[0]
    return new[0]


@pytest.mark.parametrize(
    "body_id, header_id, shown",
    [("body-id", "hdr-id", "generate-tokens-hdr-id"), ("body-id", None, "generate-tokens-body-id"), (None, None, None)],
)
def test_stream_shows_the_callers_id(vfront, vsim, body_id, header_id, shown):
    body = {"token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": 2}}
    if body_id is not None:
        body["request_id"] = body_id
    headers = {"x-request-id": header_id} if header_id is not None else {}
    before = stats(vsim)["seen_rids"]
    _, payloads = sse(vfront.url, body, GEN, headers=headers)
    ids = {e["request_id"] for e in events(payloads)}
    assert len(ids) == 1
    (got,) = ids
    engine_rid = minted_rid(vsim, before)
    if shown is None:
        assert re.fullmatch(r"generate-tokens-[0-9a-f]{32}", got) and got != engine_rid
    else:
        assert got == shown
        _, want = direct_sse(vsim, body, **headers)
        same(events(payloads), events(want))
    assert engine_rid not in (f"generate-tokens-{body_id}", f"generate-tokens-{header_id}")


@pytest.mark.parametrize(
    "body_id, header_id, shown",
    [("mine", "hdr", "generate-tokens-hdr"), ("mine", None, "generate-tokens-mine")],
)
def test_unary_shows_the_callers_id_as_vllm_does(vfront, vsim, body_id, header_id, shown):
    # vLLM 0.25+ answers with the engine id; through the frontend that is the
    # caller's id, as from the engine directly, never the minted one.
    headers = {"x-request-id": header_id} if header_id else {}
    body = {"token_ids": PROMPT, "request_id": body_id, "sampling_params": {"max_tokens": 1}}
    before = stats(vsim)["seen_rids"]
    r = post(vfront.url, body, GEN, headers=headers)
    minted = minted_rid(vsim, before)
    assert r.json()["request_id"] == direct(vsim, body, **headers).json()["request_id"] == shown != minted


# -- bad input -----------------------------------------------------------------


def schema_error(loc: str, detail: str) -> dict:
    return {"error": {"message": f"1 validation error:\n  {detail}", "type": "Bad Request", "param": loc, "code": 400}}


def value_error(message: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


OK_FEATURES = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 2}]}}
BAD_INPUT = {
    "empty_token_ids": (
        {"token_ids": [], "sampling_params": {}},
        schema_error("body.token_ids", "{'type': 'too_short', 'loc': 'body.token_ids', 'msg': 'List should have at "
                     "least 1 item after validation, not 0', 'input': '<list of 0 items>', 'ctx': {'field_type': "
                     "'List', 'min_length': 1, 'actual_length': 0}}"),
    ),
    "negative_token_id": (
        {"token_ids": [5, -1, 7], "sampling_params": {}},
        schema_error("body.token_ids", "{'type': 'value_error', 'loc': 'body.token_ids', 'msg': 'Value error, "
                     "token_ids must not contain negative values', 'input': '<list of 3 items>', 'ctx': {'error': "
                     "ValueError('token_ids must not contain negative values')}}"),
    ),
    "token_ids_not_a_list": (
        {"token_ids": "1 2 3", "sampling_params": {}},
        schema_error("body.token_ids", "{'type': 'list_type', 'loc': 'body.token_ids', 'msg': 'Input should be a "
                     "valid list', 'input': '1 2 3'}"),
    ),
    "token_id_not_an_int": (
        {"token_ids": [1, 2.5], "sampling_params": {}},
        schema_error("body.token_ids.1", "{'type': 'int_from_float', 'loc': 'body.token_ids.1', 'msg': 'Input "
                     "should be a valid integer, got a number with a fractional part', 'input': '2.5'}"),
    ),
    "no_token_ids": (
        {"sampling_params": {}},
        schema_error("body.token_ids", "{'type': 'missing', 'loc': 'body.token_ids', 'msg': 'Field required', "
                     "'input': '<dict of 1 items>'}"),
    ),
    "request_id_not_a_string": (
        {"token_ids": [1], "request_id": 7, "sampling_params": {}},
        schema_error("body.request_id", "{'type': 'string_type', 'loc': 'body.request_id', 'msg': 'Input should "
                     "be a valid string', 'input': '7'}"),
    ),
    "features_not_an_object": (
        {"token_ids": [1, 2], "features": ["h"], "sampling_params": {}},
        schema_error("body.features", "{'type': 'model_attributes_type', 'loc': 'body.features', 'msg': 'Input "
                     "should be a valid dictionary or object to extract fields from', 'input': '<list of 1 items>'}"),
    ),
    "features_without_placeholders": (
        {"token_ids": [1, 2], "features": {"mm_hashes": {"image": ["h"]}}, "sampling_params": {}},
        schema_error("body.features.mm_placeholders", "{'type': 'missing', 'loc': 'body.features.mm_placeholders', "
                     "'msg': 'Field required', 'input': '<dict of 1 items>'}"),
    ),
    "features_hash_not_a_string": (
        {"token_ids": [1, 2], "features": {**OK_FEATURES, "mm_hashes": {"image": [3]}}, "sampling_params": {}},
        schema_error("body.features.mm_hashes.image.0", "{'type': 'string_type', 'loc': "
                     "'body.features.mm_hashes.image.0', 'msg': 'Input should be a valid string', 'input': '3'}"),
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_never_reaches_the_engine(vfront, vsim, case):
    body, want = BAD_INPUT[case]
    before = stats(vsim)
    r = post(vfront.url, body, GEN)
    assert (r.status_code, r.json()) == (400, want)
    after = stats(vsim)
    assert (after["received"], after["seen_rids"]) == (before["received"], before["seen_rids"])


def test_bad_json_never_reaches_the_engine(vfront, vsim):
    before = stats(vsim)["received"]
    r = post(vfront.url, b'{"token_ids": [1,', GEN)
    assert r.status_code == 400
    assert r.json() == schema_error(
        "body.17", "{'type': 'json_invalid', 'loc': 'body.17', 'msg': 'JSON decode error', 'input': "
        "'<dict of 0 items>', 'ctx': {'error': 'unexpected end of data'}}"
    )
    assert stats(vsim)["received"] == before


ENGINE_JUDGES = {
    "too_many_logprobs": ({"token_ids": [1], "sampling_params": {"logprobs": 21}}, 400,
                          "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    "unknown_model": ({"token_ids": [1], "model": "other", "sampling_params": {}}, 404,
                      "The model `other` does not exist."),
    "out_of_vocabulary": ({"token_ids": [4096], "sampling_params": {}}, 400, "Token id 4096 is out of vocabulary"),
    "n0": ({"token_ids": [1], "sampling_params": {"n": 0}}, 400, "n must be at least 1, got 0."),
    "max_tokens0": ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, 400,
                    "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
    "logprobs_negative": ({"token_ids": [1], "sampling_params": {"logprobs": -2}}, 400,
                          "logprobs must be non-negative or -1, got -2. (parameter=logprobs, value=-2)"),
    "temperature_negative": ({"token_ids": [1], "sampling_params": {"temperature": -0.5}}, 400,
                             "temperature must be non-negative, got -0.5. (parameter=temperature, value=-0.5)"),
    "features_outside_prompt": ({"token_ids": [1], "features": OK_FEATURES, "sampling_params": {}}, 400,
                                "features: a 'image' placeholder lies outside the prompt."),
}


@pytest.mark.parametrize("case", list(ENGINE_JUDGES))
def test_engine_errors_pass_through(vfront, vsim, case):
    # The frontend relies on none of these values: the engine's answer is the client's.
    body, status, message = ENGINE_JUDGES[case]
    before = stats(vsim)["received"]
    got, want = post(vfront.url, body, GEN), direct(vsim, body)
    assert got.status_code == want.status_code == status
    assert got.json() == want.json()
    shown = got.json()["error"]["message"]
    assert shown == message or f"'msg': 'Value error, {message}'" in shown
    assert stats(vsim)["received"] == before  # refused before it ran


# -- routing -------------------------------------------------------------------


def test_each_format_reaches_only_its_protocol(vfront, vsim, ssim):
    v0, s0 = stats(vsim)["received"], stats(ssim)["received"]
    for _ in range(3):
        assert post(vfront.url, {"token_ids": [5], "sampling_params": {"max_tokens": 1}}, GEN).status_code == 200
    assert (stats(vsim)["received"], stats(ssim)["received"]) == (v0 + 3, s0)
    for _ in range(2):
        sglang = {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}
        assert post(vfront.url, sglang, "/generate").status_code == 200
    assert (stats(vsim)["received"], stats(ssim)["received"]) == (v0 + 3, s0 + 2)


# -- property --------------------------------------------------------------------

sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 12),
        "logprobs": st.none() | st.integers(0, 5),
        "stop_token_ids": st.lists(st.sampled_from([2, 978, 1262, 100, 3574]), max_size=2),
        "ignore_eos": st.booleans(),
        "temperature": st.floats(0, 2),
    },
).map(lambda sp: {"max_tokens": 12, **sp})
requests = st.fixed_dictionaries(
    {"token_ids": st.lists(st.integers(0, 4095), min_size=1, max_size=24), "sampling_params": sampling},
    optional={
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries(
            {}, optional={"include_usage": st.none() | st.booleans(), "continuous_usage_stats": st.booleans()}
        ),
        "request_id": st.text("abcxyz-0123456789", min_size=1, max_size=12),
        "cache_salt": st.text(max_size=8),
        "priority": st.integers(-5, 5),
    },
)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=requests)
def test_property_frontend_equals_direct(vfront, vsim, body):
    check_parity(vfront, vsim, {**body, "model": "sim"})


# -- aborts ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_sim():
    """A vLLM simulator at 20 ms per token."""
    proc = start_sim("vllm", itl_ms=20, extra=OLD)
    yield proc
    proc.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def slow_front(request, slow_sim):
    """The frontend in front of ``slow_sim`` alone, once per worker class."""
    proc = start_frontend([f"vllm={slow_sim.url}"], worker_class=request.param)
    yield proc
    proc.stop()


LONG = {"token_ids": PROMPT, "stream": True, "stream_options": {"include_usage": True},
        "sampling_params": {"max_tokens": 500, "ignore_eos": True}}


def test_sim_abort_requests_ends_stream_without_finish(slow_sim):
    client = RawClient(slow_sim.url)
    try:
        client.send(orjson.dumps({**LONG, "request_id": "ab1"}), path=GEN)
        first = client.events(2)
        assert [orjson.loads(p)["choices"][0]["token_ids"] for p in first] == [[2358], [1262]]
        r = post(slow_sim.url, {"request_ids": ["generate-tokens-ab1"]}, "/abort_requests")
        assert (r.status_code, r.content) == (200, b"")
        rest = client.events(1000)
    finally:
        client.close()
    assert rest[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in rest[:-1]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    n = 2 + len(chunks) - 1
    assert chunks[-1] == {"request_id": "generate-tokens-ab1", "choices": [],
                          "usage": {"prompt_tokens": 4, "total_tokens": 4 + n, "completion_tokens": n}}
    counted = stats(slow_sim)
    assert "generate-tokens-ab1" in counted["abort_named_ids"]
    assert "generate-tokens-ab1" in counted["aborted_rids"]
    assert "generate-tokens-ab1" not in counted["disconnect_aborted_rids"]


def test_sim_counts_its_own_disconnect_abort_apart_from_named_ids(slow_sim):
    client = RawClient(slow_sim.url)
    try:
        client.send(orjson.dumps({**LONG, "request_id": "gone1"}), path=GEN)
        assert len(client.events(1)) == 1
    finally:
        client.close()
    counted = wait_until(lambda: "generate-tokens-gone1" in (c := stats(slow_sim))["disconnect_aborted_rids"] and c)
    assert "generate-tokens-gone1" not in counted["abort_named_ids"] + counted["running_rids"]


def test_sim_abort_of_unary_finishes_abort(slow_sim):
    import threading

    result = {}

    def call():
        body = {"token_ids": PROMPT, "request_id": "ab2", "sampling_params": {"max_tokens": 500, "ignore_eos": True}}
        result["r"] = httpx.post(slow_sim.url + GEN, content=orjson.dumps(body), headers=JSON, timeout=30)

    worker = threading.Thread(target=call)
    worker.start()
    wait_until(lambda: "generate-tokens-ab2" in stats(slow_sim)["running_rids"])
    assert post(slow_sim.url, {"request_ids": "generate-tokens-ab2"}, "/abort_requests").status_code == 200
    worker.join(10)
    choice = result["r"].json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 500


def test_sim_abort_requests_rejects_bad_bodies(slow_sim):
    r = post(slow_sim.url, {"ids": []}, "/abort_requests")
    assert (r.status_code, r.json()) == (400, {"error": {
        "message": "Missing 'request_ids' in request body", "type": "Bad Request", "param": None, "code": 400}})
    assert post(slow_sim.url, b"{", "/abort_requests").status_code == 400


def test_client_disconnect_ends_the_engine_request(slow_sim, slow_front):
    before = stats(slow_sim)["seen_rids"]
    kinds = ("aborts_sent", "aborts_acknowledged", "aborts_unacknowledged", "aborts_worker_lost")
    counted = HTTP.get(slow_front.url + "/stats").json()
    client = RawClient(slow_front.url)
    try:
        client.send(orjson.dumps(LONG), path=GEN)
        assert len(client.events(2)) == 2
        rid = minted_rid(slow_sim, before)
    finally:
        client.close()
    wait_until(lambda: rid not in stats(slow_sim)["running_rids"])
    # Once its outcome is counted (when the answer came, however slowly):
    # one abort, acknowledged.
    counters = wait_until(lambda: (c := HTTP.get(slow_front.url + "/stats").json())
                          and sum(c[k] for k in kinds[1:]) > sum(counted[k] for k in kinds[1:]) and c, timeout=20)
    assert [counters[k] - counted[k] for k in kinds] == [1, 1, 0, 0]
    # The simulator cancels a disconnected request by itself, as vLLM does, so
    # only the ids named by /abort_requests show the frontend aborted the
    # engine request it minted, and no other.
    named = stats(slow_sim)["abort_named_ids"]
    assert rid in named and named.count(rid) == 1


def test_concurrent_duplicate_ids_do_not_collide(slow_sim, slow_front):
    # Sent straight to the simulator (or an older vLLM), the second would be
    # refused as already running; the frontend mints each engine id.
    body = {"token_ids": PROMPT, "request_id": "dup", "stream": True, "sampling_params": {"max_tokens": 5}}
    before = len(stats(slow_sim)["seen_rids"])
    clients = [RawClient(slow_front.url) for _ in range(2)]
    try:
        for c in clients:
            c.send(orjson.dumps(body), path=GEN)
        answers = [c.events(100) for c in clients]
    finally:
        for c in clients:
            c.close()
    for payloads in answers:
        chunks = events(payloads)
        assert [c["request_id"] for c in chunks] == ["generate-tokens-dup"] * 5
        assert [c["choices"][0]["token_ids"][0] for c in chunks] == CONTINUATION[:5]
    minted = stats(slow_sim)["seen_rids"][before:]
    assert len(set(minted)) == 2 and all(re.fullmatch(r"generate-tokens-[0-9a-f]{32}", r) for r in minted)


# -- workers that send no usage chunk -----------------------------------------------


@pytest.fixture(scope="module")
def quiet_sim():
    """A vLLM simulator that never sends the closing usage chunk."""
    proc = start_sim("vllm", extra=["--no-usage-chunk", *OLD])
    yield proc
    proc.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def quiet_front(request, quiet_sim):
    """The frontend in front of ``quiet_sim`` alone, once per worker class."""
    proc = start_frontend([f"vllm={quiet_sim.url}"], worker_class=request.param)
    yield proc
    proc.stop()


def test_sim_no_usage_chunk_ends_after_the_finishing_chunk(quiet_sim):
    body = {"token_ids": PROMPT, "request_id": "q", "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 2}}
    assert direct_sse(quiet_sim, body) == (200, [
        b'{"request_id":"generate-tokens-q","choices":[{"index":0,"logprobs":null,"finish_reason":null,'
        b'"token_ids":[2358],"routed_experts":null}],"usage":null}',
        b'{"request_id":"generate-tokens-q","choices":[{"index":0,"logprobs":null,"finish_reason":"length",'
        b'"token_ids":[1262],"routed_experts":null}],"usage":null}',
        b"[DONE]",
    ])


@pytest.mark.parametrize("case", ["no_options", "usage", "usage_off", "continuous", "logprobs5", "eos"])
def test_stream_without_usage_chunk_finishes_with_the_held_reason(quiet_front, quiet_sim, case):
    sp, so = STREAM_CASES[case]
    body = {"token_ids": PROMPT, "request_id": f"q-{case}", "stream": True, "sampling_params": sp}
    if so is not None:
        body["stream_options"] = so
    before = HTTP.get(quiet_front.url + "/stats").json()["by_status"]
    status, payloads = sse(quiet_front.url, body, GEN)
    chunks = events(payloads)
    want_ids = CONTINUATION if case == "eos" else CONTINUATION[: sp["max_tokens"]]
    assert (status, [c["choices"][0]["token_ids"][0] for c in chunks]) == (200, want_ids)
    assert chunks[-1]["choices"][0]["finish_reason"] == ("stop" if case == "eos" else "length")
    after = wait_until(lambda: (b := HTTP.get(quiet_front.url + "/stats").json()["by_status"]) != before and b)
    assert after == {**before, "ok": before.get("ok", 0) + 1}
    check_parity(quiet_front, quiet_sim, body)


def test_unary_unaffected_by_a_worker_without_usage_chunk(quiet_front, quiet_sim):
    check_parity(quiet_front, quiet_sim, {"token_ids": PROMPT, "model": "sim", "sampling_params": {"max_tokens": 3}})


# -- out of the box ----------------------------------------------------------------


def test_embedded_default_serves_both_formats():
    front = start_frontend([], extra=["--embedded-workers", "1"])
    try:
        v = post(front.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}}, GEN)
        s = post(front.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}, "/generate")
        assert v.json()["choices"][0]["token_ids"] == s.json()["output_ids"] == CONTINUATION[:3]
        workers = HTTP.get(front.url + "/v1/models").json()["workers"]
        assert sorted(w["protocol"] for w in workers) == ["sglang", "vllm"]
        assert all(w["state"] == "up" for w in workers)
    finally:
        front.stop()


# -- traces ------------------------------------------------------------------------


def test_one_trace_record_per_vllm_request(tmp_path, vsim):
    base = str(tmp_path / "t")
    front = start_frontend([f"vllm={vsim.url}"], extra=["--trace-file", base + ".jsonl"])
    try:
        assert post(front.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}}, GEN).status_code == 200
        body = {"token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": 2}}
        assert sse(front.url, body, GEN, headers={"x-request-id": "t-hdr"})[0] == 200
        features = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 2}]}}
        mm = {"token_ids": PROMPT, "features": features, "sampling_params": {"max_tokens": 1}}
        assert post(front.url, mm, GEN).status_code == 200
        assert post(front.url, {"token_ids": [], "sampling_params": {}}, GEN).status_code == 400
        assert post(front.url, b'{"token_ids": [1', GEN).status_code == 400

        def records():
            lines = trace_lines(str(tmp_path / "t.*.jsonl"))
            return [orjson.loads(line) for line in lines] if len(lines) >= 5 else None

        recs = wait_until(records)
    finally:
        front.stop()
    assert len(records()) == 5
    fields = ("format", "route", "stream", "status", "http_status", "input_tokens", "output_tokens", "public_id")
    assert [tuple(r.get(f) for f in fields) for r in recs] == [
        ("vllm", GEN, False, "ok", 200, 4, 3, None),
        ("vllm", GEN, True, "ok", 200, 4, 2, "t-hdr"),
        ("vllm", GEN, False, "ok", 200, 4, 1, None),
        ("vllm", GEN, None, "rejected", 400, None, 0, None),
        ("vllm", GEN, None, "rejected", 400, None, 0, None),
    ]
    assert [r.get("finish", {}).get("backend_finish_reason") for r in recs] == ["length"] * 3 + [None, None]
    assert recs[0]["replay"]["input_length"] == 4 and recs[2]["replay"] == {"excluded": "multimodal"}
    assert recs[1]["x_request_id"] == "t-hdr"
    assert [len(r["attempts"]) for r in recs] == [1, 1, 1, 0, 0]
    # A wrongly typed (here: too short) field is a bad request; only a body
    # that is not JSON is invalid JSON.
    assert [r["error"]["type"] for r in recs[3:]] == ["invalid_request", "invalid_json"]
