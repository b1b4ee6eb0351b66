"""vLLM ``/inference/v1/generate`` endpoint facts, for every vLLM version the
simulator plays, asked of the simulator directly and through the frontend.

Derived (in our own words, not copied) from the facts vLLM's tokens-in /
tokens-out serving tests check (``tests/entrypoints/serve/disagg/`` and
``tests/entrypoints/scale_out/token_in_token_out/``: ``test_serving_tokens``,
``test_tokens_logprobs``, ``test_generate_stream``, ``test_stop_reason``,
``test_return_routed_experts``): each case sends one request both ways,
asserts both answers are the same (all but a unary answer's clock), then
asserts the fact on that answer. Facts whose value differs between versions
(the answer layout, the logprob entry schema, ``stop_reason``, stop strings
on a tokens-only server, ``max_tokens`` beyond the context) are asserted per
version.

Asked elsewhere: routed-expert rows (the simulator serves them with
``--enable-return-routed-experts``: tests/e2e/test_migration.py,
tests/request/test_pd_join.py; here only their null without the flag), the model
shape flags (``--max-model-len``, ``--max-logprobs``, ``--vocab-size``) and
``structured_outputs``, which a ``--tokens-only`` server refuses
(tests/e2e/test_engine_shape.py).

Left out, because they need a real model, a tokenizer or a GPU feature the
simulator does not have, or the simulator does not play them:

- text equality with ``/v1/chat/completions`` (``test_same_response_as_chat_
  completions``, the stop-string workflow's detokenized comparison, LoRA
  adapters ``test_generate_with_lora_adapter``);
- sampling masks (``--return-sampling-mask``), ``output_mode="text"``,
  ``return_token_logprobs`` and other fields of releases newer than the
  versions played;
- ``logit_bias`` (checked by nothing and applied by nothing in the
  simulator's vLLM mode) and the out-of-vocabulary ``stop_token_ids`` refusal
  of 0.30 and later;
- a ``max_tokens`` whose sum with the prompt overflows int32, which kills a
  0.33 engine: the simulator stops generation at the context end instead;
- multimodal features, kv transfer to a real decode peer and the Rust
  frontend's refusals.
"""

from __future__ import annotations



import httpx
import orjson
import pytest

from asgi_generate.sdk._versions import VLLM_VERSIONS, vllm_behaviour
from support import CONTINUATION, PROMPT, same, sampled, start_frontend, start_sim, stats
from vllm_refusals import MALFORMED, malformed_body

pytestmark = pytest.mark.e2e

GEN = "/inference/v1/generate"
JSON = {"content-type": "application/json"}
MAX_MODEL_LEN = 32768
HTTP = httpx.Client(timeout=30)


# Session scope: an xdist worker may come back to this module after another
# (--dist worksteal), and a module teardown would have closed what it reuses.
@pytest.fixture(scope="session")
def version_sims():
    """A simulator playing each vLLM version, by version."""
    sims = {}
    try:
        for version in VLLM_VERSIONS:
            sims[version] = start_sim("vllm", extra=["--engine-version", version])
        yield sims
    finally:
        for sim in sims.values():
            sim.stop()
        HTTP.close()


@pytest.fixture(scope="module", params=[(v, wc) for v in VLLM_VERSIONS for wc in ("trio", "asyncio")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def served(request, version_sims):
    """``(version, simulator, frontend)``: a simulator playing ``version``
    (shared by both worker classes) and a frontend in front of it alone."""
    version, worker_class = request.param
    sim = version_sims[version]
    front = start_frontend([f"vllm={sim.url}"], worker_class=worker_class)
    yield version, sim, front
    front.stop()


def _unary(url: str, body: dict) -> tuple[int, dict]:
    r = HTTP.post(url + GEN, content=orjson.dumps(body), headers=JSON)
    obj = r.json()
    if r.status_code == 200:  # the caller's id shown as vLLM's engine id; vLLM's clock
        assert obj.pop("request_id") == f"generate-tokens-{body['request_id']}"
        assert isinstance(obj.pop("created"), int)
    return r.status_code, obj


def _stream(url: str, body: dict) -> tuple[int, list]:
    with HTTP.stream("POST", url + GEN, content=orjson.dumps(body), headers=JSON) as r:
        raw = b"".join(r.iter_bytes())
    if r.status_code != 200:
        return r.status_code, [orjson.loads(raw)]
    payloads = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert payloads[-1] == b"[DONE]"
    return 200, [orjson.loads(p) for p in payloads[:-1]]


def ask(served, body: dict) -> tuple[int, object]:
    """The answer to ``body``, asserted the same directly and through the
    frontend: ``(status, unary object)`` or ``(status, stream chunks)``."""
    _, sim, front = served
    body = {"model": "sim", "request_id": "case", **body}  # one id shown both ways
    call = _stream if body.get("stream") else _unary
    direct, through = call(sim.url, body), call(front.url, body)
    assert direct[0] == through[0]
    same(through[1], direct[1])
    return direct


def sp(**params) -> dict:
    return {"token_ids": PROMPT, "sampling_params": params}


# -- tokens and finish -----------------------------------------------------------


def test_answers_the_requested_tokens_with_usage(served):
    status, answer = ask(served, sp(max_tokens=5))
    assert status == 200
    assert answer["model"] == "sim"  # (request_id and created are checked by ask)
    if vllm_behaviour(served[0]).generate_schema:
        assert list(answer) == ["model", "usage", "prompt_logprobs", "prompt_token_id_logprobs", "prompt_token_ids",
                                "mm_placeholders", "metrics", "kv_transfer_params", "ec_transfer_params",
                                "output_mode", "choices"]
        assert list(answer["choices"][0]) == ["index", "finish_reason", "stop_reason", "token_ids", "routed_experts",
                                              "sampling_mask", "weight_versions", "logprobs"]
    else:
        assert list(answer) == ["model", "choices", "usage", "prompt_logprobs", "kv_transfer_params",
                                "ec_transfer_params"]
        assert list(answer["choices"][0]) == ["index", "logprobs", "finish_reason", "token_ids", "routed_experts"]
    (choice,) = answer["choices"]
    assert (choice["index"], choice["token_ids"], choice["finish_reason"]) == (0, CONTINUATION[:5], "length")
    usage = {"prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5, "prompt_tokens_details": None}
    if vllm_behaviour(served[0]).completion_tokens_details:
        usage["completion_tokens_details"] = None
    assert list(answer["usage"].items()) == list(usage.items())


def test_without_sampling_params_the_engine_answers(served):
    # Every vLLM release requires the field (the frontend leaves that to it).
    body = {"model": "sim", "request_id": "case", "token_ids": PROMPT}  # as sent: the engine echoes it
    assert ask(served, {"token_ids": PROMPT}) == validation(
        served, [("missing", ("body", "sampling_params"), "Field required", body, None)], "body.sampling_params")


def test_empty_sampling_params_take_the_engine_defaults(served):
    status, answer = ask(served, sp())
    assert status == 200
    assert (answer["choices"][0]["token_ids"], answer["choices"][0]["finish_reason"]) == (CONTINUATION, "stop")


def test_omitted_max_tokens_is_the_rest_of_the_context_not_16(served):
    status, answer = ask(served, sp(ignore_eos=True, stop_token_ids=[CONTINUATION[20]]))
    assert status == 200 and len(answer["choices"][0]["token_ids"]) == 21 > 16


def test_stream_gives_the_unary_tokens_one_chunk_each(served):
    status, chunks = ask(served, {**sp(max_tokens=5), "stream": True})
    assert status == 200
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[t] for t in CONTINUATION[:5]]
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]


@pytest.mark.parametrize("n", [2, 4])
def test_n_choices_unary(served, n):
    status, answer = ask(served, sp(max_tokens=3, n=n))
    assert status == 200
    assert sorted(c["index"] for c in answer["choices"]) == list(range(n))
    # Choice i is the model's parallel sample i: choice 0 the n = 1 answer, the others differ.
    assert [c["token_ids"] for c in answer["choices"]] == [sampled(PROMPT, i, 3) for i in range(n)]
    assert CONTINUATION[:3] == sampled(PROMPT, 0, 3) != sampled(PROMPT, 1, 3)
    assert answer["usage"]["completion_tokens"] == 3 * n


def test_n_choices_stream(served):
    body = {**sp(max_tokens=2, n=2), "stream": True, "stream_options": {"include_usage": True}}
    status, chunks = ask(served, body)
    assert status == 200
    assert [(c["choices"][0]["index"], c["choices"][0]["token_ids"]) for c in chunks[:-1]] == [
        (0, [2358]), (1, [3390]), (0, [1262]), (1, [2856])]
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "total_tokens": 8, "completion_tokens": 4}


def test_n_above_max_num_seqs_is_refused(served):
    assert ask(served, sp(n=257)) == (400, {"error": {
        "message": "sampling_params.n must be at most the server's max_num_seqs (256), got 257.",
        "type": "BadRequestError", "param": None, "code": 400}})


# -- logprobs ----------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_one_entry_per_token_with_k_alternatives(served, k):
    version = served[0]
    status, answer = ask(served, sp(max_tokens=5, logprobs=k))
    assert status == 200
    choice = answer["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == 5
    for tok, entry in zip(choice["token_ids"], content):
        assert len(entry["top_logprobs"]) == max(k, 1)
        if vllm_behaviour(version).generate_schema:
            assert list(entry) == ["token_id", "logprob", "rank", "top_logprobs"]
            assert (entry["token_id"], entry["rank"]) == (tok, 1)  # greedy: the sampled token ranks first
            assert [list(e) for e in entry["top_logprobs"]] == [["token_id", "logprob", "rank"]] * max(k, 1)
            assert [e["rank"] for e in entry["top_logprobs"]] == list(range(1, max(k, 1) + 1))
            sampled = entry["top_logprobs"][0]
            assert (sampled["token_id"], sampled["logprob"]) == (tok, entry["logprob"])
        else:
            assert list(entry) == ["token", "logprob", "bytes", "top_logprobs"]
            assert (entry["token"], entry["bytes"]) == (f"token_id:{tok}", None)
            assert [list(e) for e in entry["top_logprobs"]] == [["token", "logprob", "bytes"]] * max(k, 1)
            assert entry["top_logprobs"][0] == {"token": f"token_id:{tok}", "logprob": entry["logprob"], "bytes": None}
        assert entry["logprob"] <= 0


def test_no_logprobs_unless_asked(served):
    assert ask(served, sp(max_tokens=2))[1]["choices"][0]["logprobs"] is None


def test_stream_logprobs_align_with_each_chunks_tokens(served):
    status, chunks = ask(served, {**sp(max_tokens=3, logprobs=2), "stream": True})
    assert status == 200
    key = "token_id" if vllm_behaviour(served[0]).generate_schema else "token"
    for c in chunks:
        (choice,) = c["choices"]
        (entry,) = choice["logprobs"]["content"]
        want = choice["token_ids"][0] if key == "token_id" else f"token_id:{choice['token_ids'][0]}"
        assert entry[key] == want and len(entry["top_logprobs"]) == 2


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_one_map_per_prompt_position(served, k):
    status, answer = ask(served, sp(max_tokens=1, prompt_logprobs=k))
    assert status == 200
    rows = answer["prompt_logprobs"]
    assert len(rows) == len(PROMPT) and rows[0] is None
    for tok, row in zip(PROMPT[1:], rows[1:]):
        assert str(tok) in row and k <= len(row) <= k + 1
        assert all(set(v) == {"logprob", "rank", "decoded_token"} and v["decoded_token"] is None for v in row.values())
        assert isinstance(row[str(tok)]["rank"], int) and row[str(tok)]["rank"] >= 1


def test_too_many_logprobs_is_refused(served):
    assert ask(served, sp(logprobs=21)) == (400, {"error": {
        "message": "Requested sample logprobs of 21, which is greater than max allowed: 20",
        "type": "BadRequestError", "param": "logprobs", "code": 400}})


@pytest.mark.parametrize("key, what", [("logprobs", "sample"), ("prompt_logprobs", "prompt")])
def test_logprobs_minus_one_is_the_vocabulary_above_max_logprobs(served, key, what):
    """-1 asks for the whole vocabulary (4,096 ids), above the default
    ``--max-logprobs`` 20 (tests/e2e/test_engine_shape.py serves it with -1)."""
    assert ask(served, sp(**{key: -1})) == (400, {"error": {
        "message": f"Requested {what} logprobs of 4096, which is greater than max allowed: 20",
        "type": "BadRequestError", "param": key, "code": 400}})


# -- stop tokens, stop strings, stop_reason ----------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_finishes_with_its_stop_reason(served, stream):
    body = {**sp(max_tokens=10, stop_token_ids=[978]), "stream": stream}
    status, answer = ask(served, body)
    assert status == 200
    last = answer[-1]["choices"][0] if stream else answer["choices"][0]
    assert last["finish_reason"] == "stop"
    tokens = [c["choices"][0]["token_ids"][0] for c in answer] if stream else last["token_ids"]
    assert tokens == [2358, 1262, 978]
    if vllm_behaviour(served[0]).stop_reason:
        assert last["stop_reason"] == 978
    else:
        assert "stop_reason" not in last


def test_eos_and_length_have_no_stop_reason(served):
    for params, finish in (({}, "stop"), ({"max_tokens": 2}, "length")):
        choice = ask(served, sp(**params))[1]["choices"][0]
        assert choice["finish_reason"] == finish
        assert choice.get("stop_reason", "absent") == (None if vllm_behaviour(served[0]).stop_reason else "absent")


def test_ignore_eos_runs_past_eos(served):
    choice = ask(served, sp(max_tokens=26, ignore_eos=True))[1]["choices"][0]
    assert choice["token_ids"][:24] == CONTINUATION and (len(choice["token_ids"]), choice["finish_reason"]) == (
        26, "length")


def test_stop_strings_without_detokenize_are_refused(served):
    params = {"max_tokens": 4, "detokenize": False, "stop": ["27 member"]}
    assert ask(served, sp(**params)) == sampling_refused(
        served, params, "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")


def test_stop_strings_on_a_tokens_only_server(served):
    status, answer = ask(served, sp(max_tokens=4, stop=["27 member"]))
    if vllm_behaviour(served[0]).refuses_stop_strings:
        assert (status, answer["error"]["message"]) == (400, (
            "stop strings are not supported on a --tokens-only server because detokenization is disabled. "
            "Check stop strings on the coordinator, or use stop_token_ids."))
    else:  # older servers accept them and never apply them
        assert (status, answer["choices"][0]["token_ids"]) == (200, CONTINUATION[:4])


def test_detokenize_false_without_stop_strings_answers(served):
    assert ask(served, sp(max_tokens=3, detokenize=False))[1]["choices"][0]["token_ids"] == CONTINUATION[:3]


# -- max_tokens and other bounds ----------------------------------------------------


@pytest.mark.parametrize("max_tokens", [2**31 - 1, 2**31, 2**63, 1e18, MAX_MODEL_LEN - len(PROMPT) + 1],
                         ids=["int32max", "2^31", "2^63", "1e18", "context+1"])
def test_max_tokens_beyond_the_context(served, max_tokens):
    """pydantic reads an integral float as the integer it is (1e18)."""
    total = len(PROMPT) + int(max_tokens)
    if not vllm_behaviour(served[0]).bounds_max_tokens:  # generation stops at the context end
        status, answer = ask(served, sp(max_tokens=max_tokens, stop_token_ids=[CONTINUATION[3]]))
        assert (status, answer["choices"][0]["token_ids"]) == (200, CONTINUATION[:4])
        return
    assert ask(served, sp(max_tokens=max_tokens)) == (400, {"error": {
        "message": f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
                   f"{int(max_tokens)} output tokens and your prompt contains 4 input tokens, for a total of {total} "
                   "tokens. Please reduce the length of the input prompt or the number of requested output "
                   "tokens. (parameter=input_tokens, value=4)",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}})


def test_max_tokens_up_to_the_context_is_served(served):
    status, answer = ask(served, sp(max_tokens=MAX_MODEL_LEN - len(PROMPT)))
    assert (status, answer["choices"][0]["token_ids"]) == (200, CONTINUATION)


IS_INSTANCE = "is-instance[SamplingParams]"
TYPED_DICT = "function-after[_validate_msgspec(), typed-dict]"


def validation(served, errors: list[tuple], param: str) -> tuple[int, dict]:
    """vLLM's 400 for pydantic ``errors`` (``(type, loc, msg, input, ctx
    text)`` each, ``loc`` as pydantic spells it): from 0.30 each shows its
    dotted ``loc`` without pydantic's schema segments and a bounded
    ``input``; before, pydantic's own tuple and the whole input."""
    cleaned = vllm_behaviour(served[0]).clean_validation_errors
    lines = []
    for kind, loc, msg, value, ctx in errors:
        if cleaned:
            loc_text = repr(".".join(str(p) for p in loc if p not in (IS_INSTANCE, TYPED_DICT, "str", "list[str]")))
            value = f"<{type(value).__name__} of {len(value)} items>" if isinstance(value, (dict, list)) else str(value)
        else:
            loc_text = repr(loc)
        line = f"{{'type': {kind!r}, 'loc': {loc_text}, 'msg': {msg!r}, 'input': {value!r}"
        lines.append(line + (f", 'ctx': {ctx}}}" if ctx else "}"))
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {t}" for t in lines)
    return 400, {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}


def sampling_refused(served, params: dict, message: str, parameter=None, value=None) -> tuple[int, dict]:
    """vLLM's answer when ``SamplingParams._verify_args`` refuses ``params``
    while pydantic builds it: its ``VLLMValidationError`` is no
    ``ValueError``, so pydantic does not catch it and vLLM's ``VLLMError``
    handler answers a ``BadRequestError`` (``create_error_response``), the
    parameter and value it names shown after the message and as ``param``."""
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    shown = f"{message} ({', '.join(extras)})" if extras else message
    return 400, {"error": {"message": shown, "type": "BadRequestError", "param": parameter, "code": 400}}


@pytest.mark.parametrize(
    "params, message, parameter, value",
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0.", "max_tokens", 0),
        ({"n": 0}, "n must be at least 1, got 0.", None, None),
        ({"temperature": -1}, "temperature must be non-negative, got -1.0.", "temperature", -1.0),
        ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5.", "temperature", 2.5),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0.", "top_p", 0.0),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2.", None, None),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0.", None, None),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be less than or equal to max_tokens=2, got 5.", None,
         None),
        ({"logprobs": -2}, "logprobs must be non-negative or -1, got -2.", "logprobs", -2),
        ({"prompt_logprobs": -5}, "prompt_logprobs must be non-negative or -1, got -5.", "prompt_logprobs", -5),
        ({"stop": [""]}, "stop cannot contain an empty string.", None, None),
    ],
    ids=["max_tokens0", "n0", "temperature_negative", "temperature_high", "top_p0", "top_k", "presence",
         "min_tokens", "logprobs", "prompt_logprobs", "empty_stop"],
)
def test_out_of_range_sampling_params_are_refused(served, params, message, parameter, value):
    assert ask(served, sp(**params)) == sampling_refused(served, params, message, parameter, value)


def test_numeric_string_for_a_float_is_taken_as_pydantic_does(served):
    assert ask(served, sp(max_tokens=2, temperature="0.5"))[1]["choices"][0]["token_ids"] == CONTINUATION[:2]


def test_wrongly_typed_sampling_param_is_a_validation_error(served):
    params = {"temperature": "hot"}
    assert ask(served, sp(**params)) == validation(served, [
        ("is_instance_of", ("body", "sampling_params", IS_INSTANCE), "Input should be an instance of SamplingParams",
         params, "{'class': 'SamplingParams'}"),
        ("float_parsing", ("body", "sampling_params", TYPED_DICT, "temperature"),
         "Input should be a valid number, unable to parse string as a number", "hot", None),
    ], "body.sampling_params")


def test_numbers_and_booleans_are_read_as_pydantic_reads_them(served):
    # Lax mode: numeric strings, integral floats and 0/1 or "yes"/"no"
    # booleans, in the fields the frontend reads itself (n, max_tokens,
    # stream, priority) as in those it passes on.
    params = {"max_tokens": "3", "n": 1.0, "logprobs": "1", "ignore_eos": "no", "top_k": 5.0, "temperature": 0}
    answer = ask(served, {**sp(**params), "stream": 0, "priority": "0"})[1]
    assert (answer["choices"][0]["token_ids"], len(answer["choices"])) == (CONTINUATION[:3], 1)
    assert len(answer["choices"][0]["logprobs"]["content"]) == 3


def test_unknown_fields_are_ignored(served):
    # GenerateRequest ignores extra fields, and so does the typed dict
    # SamplingParams is validated as: neither is refused.
    status, answer = ask(served, {**sp(max_tokens=2, future_knob="x"), "not_a_field": 1})
    assert (status, answer["choices"][0]["token_ids"]) == (200, CONTINUATION[:2])


def test_cache_salt_isolates_cached_prefixes():
    """A request salted with a fresh ``cache_salt`` reuses no unsalted
    prefix: vLLM reports 0 cached tokens."""
    sim = start_sim("vllm", extra=["--cache-tokens", "4096", "--enable-prompt-tokens-details"])
    front = start_frontend([f"vllm={sim.url}"])
    try:
        ids = list(range(100, 164))
        for url in (sim.url, front.url):
            body = {"model": "sim", "request_id": "salt", "token_ids": ids, "sampling_params": {"max_tokens": 1}}
            _unary(url, body)
            warm = _unary(url, body)[1]["usage"]
            salted = _unary(url, {**body, "cache_salt": f"fresh-{url}"})[1]["usage"]
            assert warm["prompt_tokens_details"] == {"cached_tokens": 48, "created_cache_tokens": None,
                                                     "multimodal_tokens": None}
            assert salted["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None,
                                                       "multimodal_tokens": None}
    finally:
        front.stop()
        sim.stop()


def test_unknown_model_is_404(served):
    assert ask(served, {**sp(), "model": "other"}) == (404, {"error": {
        "message": "The model `other` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}})


# -- usage and stream options -------------------------------------------------------


def test_stream_has_no_usage_unless_asked(served):
    status, chunks = ask(served, {**sp(max_tokens=2), "stream": True})
    assert status == 200 and all(c["usage"] is None and c["choices"] for c in chunks)


def test_stream_usage_chunk_when_asked(served):
    status, chunks = ask(served, {**sp(max_tokens=2), "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    usage = {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2}
    if vllm_behaviour(served[0]).generate_schema:
        want = {"request_id": "generate-tokens-case", "usage": usage, "output_mode": "tokens", "choices": []}
    else:
        want = {"request_id": "generate-tokens-case", "choices": [], "usage": usage}
    assert list(chunks[-1].items()) == list(want.items())


def test_stream_continuous_usage_on_every_chunk(served):
    body = {**sp(max_tokens=3), "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, chunks = ask(served, body)
    assert status == 200
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]


# -- routed experts and disaggregation placeholders -----------------------------------


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_sampling_params_are_refused_as_the_engine_refuses_them(served, case):
    """The frontend refuses these itself, with vLLM's answer (every error,
    the ``is-instance`` branch of ``SamplingParams`` first) in the wording
    of 0.30 and later; the engine, asked directly, answers the same."""
    version, sim, front = served
    body = {"model": "sim", "request_id": "case", **malformed_body(case)}
    before = stats(sim)["received"]
    assert _unary(front.url, body) == MALFORMED[case][1]
    assert stats(sim)["received"] == before  # refused before any worker
    if vllm_behaviour(version).clean_validation_errors:
        assert _unary(sim.url, body) == MALFORMED[case][1]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", ["no_sampling_params", "lax_and_bad_params"])
def test_an_engine_refusal_reaches_the_client_byte_for_byte(served, case, stream):
    """The frontend lets these through (a field it does not read is wrong,
    or missing) and the engine refuses them: the client gets the engine's
    own answer to its body, byte for byte, whatever the frontend added to
    the worker's body (a streaming leg's ``stream_options``) or converted
    (``"3"`` forwarded as 3) not showing in the echoed input."""
    _, sim, front = served
    body = {"token_ids": PROMPT, "stream": stream, "request_id": "mine"}
    if case == "lax_and_bad_params":
        body["sampling_params"] = {"max_tokens": "3", "temperature": "hot"}
    content = orjson.dumps(body)
    direct = HTTP.post(sim.url + GEN, content=content, headers=JSON)
    through = HTTP.post(front.url + GEN, content=content, headers=JSON)
    assert (through.status_code, through.content) == (direct.status_code, direct.content)
    if case == "no_sampling_params":
        assert direct.json() == validation(served, [
            ("missing", ("body", "sampling_params"), "Field required", body, None)], "body.sampling_params")[1]
    else:
        params = body["sampling_params"]
        assert direct.json() == validation(served, [
            ("is_instance_of", ("body", "sampling_params", IS_INSTANCE),
             "Input should be an instance of SamplingParams", params, "{'class': 'SamplingParams'}"),
            ("float_parsing", ("body", "sampling_params", TYPED_DICT, "temperature"),
             "Input should be a valid number, unable to parse string as a number", "hot", None),
        ], "body.sampling_params")[1]


def test_routed_experts_are_null_without_the_server_flag(served):
    answer = ask(served, sp(max_tokens=2))[1]
    assert answer["choices"][0]["routed_experts"] is None


def test_kv_transfer_params_are_refused_by_the_frontend(served):
    """vLLM itself accepts a client's kv_transfer_params (the simulator, as
    an engine without a KV connector, answers null); the frontend owns the
    field and refuses it, since it could name another request's KV."""
    _, sim, front = served
    body = {**sp(max_tokens=1), "model": "sim", "request_id": "case", "kv_transfer_params": {"do_remote_decode": True}}
    status, answer = _unary(sim.url, body)
    assert (status, answer["kv_transfer_params"]) == (200, None)
    assert _unary(front.url, body) == (400, {"error": {
        "message": "kv_transfer_params is set by the frontend for prefill/decode routing; do not send it.",
        "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}})
