"""SGLang's native endpoint, checked for the facts SGLang's own server tests
check, each against a simulator directly and through the frontend (real
hypercorn, both worker classes), with the same answer required from both.

Written in our own words from what SGLang's endpoint tests assert
(``test/srt/test_srt_endpoint.py`` and the routed-experts tests): logprob
shapes and their alignment with the tokens, ``logprob_start_len``,
``top_logprobs_num``, ``token_ids_logprob``, ``return_text_in_logprobs``,
stop token ids and stop strings with ``matched``, ``ignore_eos``,
``logit_bias`` (positive and negative), routed-expert row counts and
``routed_experts_start_len``, the refusals of ``SamplingParams.verify``,
``max_new_tokens`` past the context (2^31, 2^63, ``1e18``), ragged
``token_ids_logprob`` lists in one batch and in concurrent requests,
``extra_key``/``cache_salt`` isolation of cached prefixes, an ``abort`` finish
with an error status, ``--stream-interval`` chunking, and the info routes.
Grammars refused as SGLang's scheduler refuses them and ``--context-length``
/ ``--vocab-size`` are tests/e2e/test_engine_shape.py's; ``n`` > 1 is
tests/e2e/test_batches.py's.

Left out (they need a real model or a GPU, or are not the frontend's):
- answer quality: ``test_simple_decode``, ``test_parallel_sample``'s
  sample diversity, ``test_many_stop_strings`` text checks, the output of
  ``test_json_schema``/``regex``/``ebnf`` constrained decoding (the
  simulator checks a grammar and does not apply it), and the
  temperature/top-p/seed statistics tests;
- ``test_get_server_info``'s memory and CUDA-graph fields, ``flush_cache``
  timing, ``test_custom_logit_processor``, ``return_hidden_states``,
  LoRA, multimodal inputs, ``input_embeds`` and ``/generate_from_file``;
- ``abort_all``, ``/get_server_info`` and ``/get_model_info`` through the
  frontend are tests/e2e/test_admin_routes.py's.
"""

from __future__ import annotations

import base64
import threading

import httpx
import orjson
import pytest

from asgi_generate.sim.tokenizer import SimTokenizer
from support import post, sse, start_frontend, start_sim, without_timing

pytestmark = pytest.mark.e2e

PROMPT = [785, 2226, 374, 220, 19, 1010, 77, 3000]
EOS_PROMPT = [243, 42]  # its greedy answer ends with EOS at token 20
LAYERS_TOPK = 4 * 2  # the simulator's num_layers * experts_topk
TOK = SimTokenizer()


def both(frontend, sim, body: dict) -> dict:
    """The unary answer, asserted equal directly and through the frontend."""
    body = {"rid": "endpoint-test"} | body
    direct, through = post(sim.url, body), post(frontend.url, body)
    assert (through.status_code, through.headers["content-type"]) == (direct.status_code, "application/json")
    assert without_timing(through.json()) == without_timing(direct.json())
    return {"status": direct.status_code, "body": direct.json()}


def both_sse(frontend, sim, body: dict) -> list[dict]:
    """The SSE events (``[DONE]`` checked and dropped), equal both ways."""
    body = {"rid": "endpoint-test"} | body
    d_status, direct = sse(sim.url, body | {"stream": True})
    f_status, through = sse(frontend.url, body | {"stream": True})
    assert d_status == f_status == 200
    assert direct[-1] == through[-1] == b"[DONE]"
    got = [without_timing(orjson.loads(e)) for e in through[:-1]]
    assert got == [without_timing(orjson.loads(e)) for e in direct[:-1]]
    return got


def ok(frontend, sim, body: dict) -> dict:
    got = both(frontend, sim, body)
    assert got["status"] == 200, got
    return got["body"]


# -- logprobs ---------------------------------------------------------------------


def test_logprob_shapes_and_alignment(frontend, sims):
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    out = ok(frontend, sims[0], body)
    meta = out["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (8, 6)
    assert [t[1] for t in meta["input_token_logprobs"]] == PROMPT
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert all(type(t[0]) is float for t in meta["input_token_logprobs"][1:])
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert len(meta["input_top_logprobs"]) == 8 and len(meta["output_top_logprobs"]) == 6
    for row, tok in zip(meta["output_top_logprobs"], meta["output_token_logprobs"]):
        assert len(row) == 3
        assert [e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
        assert row[0][:2] == tok[:2]  # greedy: the pick is the best
    assert "input_token_ids_logprobs" not in meta


@pytest.mark.parametrize("start", [0, 3, 7])
def test_logprob_start_len_cuts_the_prompt_rows(frontend, sims, start):
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start,
            "sampling_params": {"max_new_tokens": 2}}
    meta = ok(frontend, sims[0], body)["meta_info"]
    assert [t[1] for t in meta["input_token_logprobs"]] == PROMPT[start:]
    assert len(meta["output_token_logprobs"]) == 2


def test_logprob_start_len_past_the_prompt_is_refused(frontend, sims):
    body = {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}
    got = both(frontend, sims[0], body)
    assert got == {"status": 400, "body": {"error": {"message": (
        "logprob_start_len (2) is higher than the number of input tokens (2). "
        "Request with a lower logprob_start_len.")}}}


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_logprob_rows(frontend, sims, stream):
    ids = [1000, 7, 3000]
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": ids,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    meta = both_sse(frontend, sims[0], body)[-1]["meta_info"] if stream else ok(frontend, sims[0], body)["meta_info"]
    assert len(meta["output_token_ids_logprobs"]) == 4
    assert len(meta["input_token_ids_logprobs"]) == len(PROMPT)
    assert meta["input_token_ids_logprobs"][0] is None
    for row in meta["output_token_ids_logprobs"] + meta["input_token_ids_logprobs"][1:]:
        assert [e[1] for e in row] == ids
        assert [e[2] for e in row] == [TOK.piece(i) for i in ids]
        assert all(type(e[0]) is float and e[0] < 0 for e in row)
    # The row is the model's logprob of each id at that position.
    model = TOK.model()
    assert meta["input_token_ids_logprobs"][3][1][0] == model.logprob(model.fold(PROMPT[:3]), 7)


RAGGED = [[7], [1000, 7, 3000], [5, 6]]


def _ids_rows(meta: dict) -> list[list[int]]:
    return [[e[1] for e in row] for row in meta["output_token_ids_logprobs"]]


def test_ragged_token_ids_logprob_in_one_batch(frontend, sims):
    body = {"input_ids": [PROMPT, PROMPT[:5], PROMPT[2:]], "return_logprob": True, "token_ids_logprob": RAGGED,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    out = ok(frontend, sims[0], body)
    assert [_ids_rows(item["meta_info"]) for item in out] == [[ids] * 3 for ids in RAGGED]


def test_ragged_token_ids_logprob_in_concurrent_requests(frontend, sims):
    """Requests in flight together, each with its own list (one engine
    batch), each answered with its own rows."""
    bodies = [{"rid": f"ragged-{i}", "input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": ids,
               "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}} for i, ids in enumerate(RAGGED)]
    for url in (sims[0].url, frontend.url):
        results: dict[int, dict] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, post(url, bodies[i]).json()))
                   for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [_ids_rows(results[i]["meta_info"]) for i in range(len(bodies))] == [[ids] * 4 for ids in RAGGED]
        assert len({tuple(r["output_ids"]) for r in results.values()}) == 1


def test_extra_key_and_cache_salt_isolate_cached_prefixes():
    """A fresh ``extra_key`` or ``cache_salt`` reuses no prefix cached
    without it (SGLang's radix cache keys entries by both)."""
    sim = start_sim("sglang", extra=["--cache-tokens", "4096"])
    front = start_frontend([f"sglang={sim.url}"])
    try:
        ids = list(range(100, 164))
        for url in (sim.url, front.url):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
            post(url, body)
            assert post(url, body).json()["meta_info"]["cached_tokens"] == len(ids) - 1
            for key in ("extra_key", "cache_salt"):
                assert post(url, {**body, key: f"fresh-{url}"}).json()["meta_info"]["cached_tokens"] == 0
    finally:
        front.stop()
        sim.stop()


@pytest.mark.parametrize("with_text", [False, True])
def test_return_text_in_logprobs(frontend, sims, with_text):
    body = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": with_text, "sampling_params": {"max_new_tokens": 3}}
    meta = ok(frontend, sims[0], body)["meta_info"]
    triples = meta["output_token_logprobs"] + [e for row in meta["output_top_logprobs"] for e in row]
    assert [e[2] for e in triples] == [TOK.piece(e[1]) if with_text else None for e in triples]


# -- stops, eos, bias ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_and_matched(frontend, sims, stream):
    free = ok(frontend, sims[0], {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}})
    stop = free["output_ids"][3]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [stop]}}
    final = both_sse(frontend, sims[0], body)[-1] if stream else ok(frontend, sims[0], body)
    assert final["output_ids"] == free["output_ids"][:4]
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert final["text"] == TOK.decode(free["output_ids"][:3])


def test_stop_string_is_matched_and_trimmed(frontend, sims):
    free = ok(frontend, sims[0], {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12}})
    word = free["text"][10:14]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "stop": ["no such", word]}}
    out = ok(frontend, sims[0], body)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert out["text"] == free["text"][: free["text"].index(word)]
    kept = ok(frontend, sims[0], body | {"sampling_params": body["sampling_params"] | {"no_stop_trim": True}})
    assert kept["output_ids"] == out["output_ids"]
    assert kept["text"] == TOK.decode(out["output_ids"]) and kept["text"].startswith(out["text"] + word)


def test_negative_logit_bias_bars_the_token(frontend, sims):
    free = ok(frontend, sims[0], {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
                                  "sampling_params": {"max_new_tokens": 1}})
    best, second = (e[1] for e in free["meta_info"]["output_top_logprobs"][0])
    body = {"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [best],
            "sampling_params": {"max_new_tokens": 1, "logit_bias": {str(best): -100}}}
    barred = ok(frontend, sims[0], body)
    assert barred["output_ids"] == [second]
    (row,) = barred["meta_info"]["output_token_ids_logprobs"]
    assert row[0][0] < barred["meta_info"]["output_token_logprobs"][0][0] - 90


def test_eos_stops_unless_ignore_eos(frontend, sims):
    stopped = ok(frontend, sims[0], {"input_ids": EOS_PROMPT, "sampling_params": {"max_new_tokens": 40}})
    assert len(stopped["output_ids"]) == 20 and stopped["output_ids"][-1] == TOK.eos_id
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": TOK.eos_id}
    ignored = ok(frontend, sims[0], {"input_ids": EOS_PROMPT,
                                     "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}})
    assert ignored["output_ids"][:20] == stopped["output_ids"] and len(ignored["output_ids"]) == 40
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 40}


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_forces_the_token(frontend, sims, stream):
    body = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 5, "logit_bias": {"1000": 100}}}
    final = both_sse(frontend, sims[0], body)[-1] if stream else ok(frontend, sims[0], body)
    assert final["output_ids"] == [1000] * 5
    assert all(row[0][1] == 1000 for row in final["meta_info"]["output_top_logprobs"])
    unbiased = ok(frontend, sims[0], {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}})
    assert 1000 not in unbiased["output_ids"]


# -- routed experts -------------------------------------------------------------------


def rows(meta: dict) -> int:
    return len(base64.b64decode(meta["routed_experts"])) // 4 // LAYERS_TOPK


@pytest.mark.parametrize("start", [None, 0, 5, 8])
def test_routed_expert_rows(frontend, sims, start):
    body = {"input_ids": PROMPT, "return_routed_experts": True, "sampling_params": {"max_new_tokens": 4}}
    if start is not None:
        body["routed_experts_start_len"] = start
    meta = ok(frontend, sims[0], body)["meta_info"]
    seq = meta["prompt_tokens"] + meta["completion_tokens"]
    assert rows(meta) == seq - 1 - (start or 0)


def test_routed_experts_start_len_past_the_prompt_aborts(frontend, sims):
    body = {"input_ids": PROMPT, "return_routed_experts": True, "routed_experts_start_len": 9,
            "sampling_params": {"max_new_tokens": 4}}
    message = ("recv_req.routed_experts_start_len=9 is higher than the number of input tokens "
               "len(req.origin_input_ids)=8. Please use a smaller routed_experts_start_len.")
    assert both(frontend, sims[0], body) == {"status": 400, "body": {"error": {"message": message}}}
    (final,) = both_sse(frontend, sims[0], body)
    assert final["output_ids"] == [] and "routed_experts" not in final["meta_info"]
    assert final["meta_info"]["finish_reason"] == {
        "type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"}


# -- sampling parameter refusals (SamplingParams.verify) ---------------------------------

REFUSED = [
    ({"temperature": -0.5}, "temperature must be a non-negative finite number, got -0.5."),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
    ({"top_k": -2}, "top_k must be -1 (disable) or at least 1, got -2."),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5."),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3."),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0."),
    ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens], got -1."),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens must be in [0, max_new_tokens(2)], got 5."),
    ({"regex": "a", "ebnf": "b"}, "Only one of json_schema, regex, ebnf, or structural_tag can be set."),
]


@pytest.mark.parametrize("params,message", REFUSED, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(REFUSED)])
def test_sampling_params_refused_as_sglang_refuses_them(frontend, sims, params, message):
    body = {"input_ids": PROMPT, "sampling_params": params}
    assert both(frontend, sims[0], body) == {"status": 400, "body": {"error": {"message": message}}}
    assert both_sse(frontend, sims[0], body) == [{"error": {"message": message}}]


@pytest.mark.parametrize("max_new, total", [(2**31, "2147483656"), (2**63, "9223372036854775816"),
                                            (1e18, "1e+18")], ids=["2^31", "2^63", "1e18"])
def test_max_new_tokens_past_the_context_is_refused(frontend, sims, max_new, total):
    """SGLang's ``sampling_params`` is a plain dict: a float stays a float
    in the length check and its message."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_new}}
    message = (f"Requested token count exceeds the model's maximum context length of 32768 tokens. You requested a "
               f"total of {total} tokens: 8 tokens from the input messages and {max_new} tokens for the completion. "
               "Please reduce the number of tokens in the input messages or the completion to fit within the limit.")
    assert both(frontend, sims[0], body) == {"status": 400, "body": {"error": {"message": message}}}
    assert both_sse(frontend, sims[0], body) == [{"error": {"message": message}}]


def test_accepted_edge_values(frontend, sims):
    """What ``verify`` lets through: greedy temperature 0, top_k -1, top_p 1."""
    params = {"temperature": 0, "top_k": -1, "top_p": 1, "min_p": 0, "max_new_tokens": 2, "sampling_seed": 3}
    assert len(ok(frontend, sims[0], {"input_ids": PROMPT, "sampling_params": params})["output_ids"]) == 2


def test_unknown_sampling_param_is_an_engine_500(sims):
    """SGLang builds ``SamplingParams(**sampling_params)``: an unknown key is
    a ``TypeError`` its handler does not catch (checked on the simulator: the
    frontend passes the key through and reports the bare 500 in SGLang's shape)."""
    body = {"input_ids": [1], "sampling_params": {"no_such_param": 1}}
    resp = post(sims[0].url, body)
    assert (resp.status_code, resp.text) == (500, "Internal Server Error")
    # Streamed, the TypeError escapes SGLang's generator after the 200: the
    # connection ends without the chunked body's end.
    with httpx.stream("POST", sims[0].url + "/generate", content=orjson.dumps(body | {"stream": True}),
                      timeout=10) as stream:
        assert stream.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            b"".join(stream.iter_bytes())


# -- info routes ------------------------------------------------------------------------------


def test_info_routes(frontend, sims):
    info = httpx.get(sims[0].url + "/get_server_info", timeout=10).json()
    assert type(info["max_total_num_tokens"]) is int and info["max_total_num_tokens"] > 32768
    assert (info["context_length"], info["stream_interval"], info["version"]) == (32768, 1, "0.0.0-sim")
    model = httpx.get(sims[0].url + "/get_model_info", timeout=10).json()
    assert model["is_generation"] is True
    assert httpx.get(frontend.url + "/get_server_info", timeout=10).json() == info


def test_abort_all_ends_every_running_request():
    sim = start_sim("sglang", itl_ms=50)
    try:
        results: list[dict] = []
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        threads = [threading.Thread(target=lambda: results.append(post(sim.url, body).json())) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = 100
        while httpx.get(sim.url + "/sim/stats", timeout=5).json()["running"] < 2 and deadline:
            deadline -= 1
            threading.Event().wait(0.05)
        assert post(sim.url, {"abort_all": True}, "/abort_request").status_code == 200
        for t in threads:
            t.join(10)
        assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort", "abort"]
        assert all(len(r["output_ids"]) < 400 for r in results)
    finally:
        sim.stop()


# -- an abort finish with an error status (sim --abort-after) --------------------------------


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def aborting(request):
    sim = start_sim("sglang", extra=["--abort-after", "3", "--abort-status", "503"])
    fe = start_frontend([f"sglang={sim.url}"], worker_class=request.param)
    yield fe, sim
    fe.stop()
    sim.stop()


def test_abort_with_error_status_unary_is_that_http_error(aborting):
    fe, sim = aborting
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}
    got = both(fe, sim, body)
    assert got == {"status": 503, "body": {
        "object": "error", "message": "simulated abort after 3 tokens (sim --abort-after)",
        "type": "503", "param": None, "code": 503}}


def test_abort_with_error_status_sse_is_the_final_chunk(aborting):
    fe, sim = aborting
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}
    events = both_sse(fe, sim, body)
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3]
    assert events[-1]["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "simulated abort after 3 tokens (sim --abort-after)",
        "status_code": 503, "err_type": None}


# -- several tokens per event (sim --stream-interval) ------------------------------------------


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def chunky(request):
    sims = [start_sim("sglang", extra=["--stream-interval", "3"]),
            start_sim("sglang", incremental=True, extra=["--stream-interval", "3"])]
    fes = [start_frontend([f"sglang={s.url}"], worker_class=request.param) for s in sims]
    yield list(zip(fes, sims))
    for p in (*fes, *sims):
        p.stop()


def test_stream_interval_chunks_after_tokens_1_4_7(chunky):
    (fe, sim), _ = chunky
    body = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    events = both_sse(fe, sim, body)
    assert [len(e["output_ids"]) for e in events] == [1, 4, 7, 8]
    for e in events:  # cumulative: logprob rows cover every token so far
        assert [t[1] for t in e["meta_info"]["output_token_logprobs"]] == e["output_ids"]
        assert len(e["meta_info"]["output_top_logprobs"]) == len(e["output_ids"])


def test_stream_interval_deltas_keep_logprobs_aligned(chunky):
    _, (fe, sim) = chunky
    body = {"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [5, 6],
            "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    events = both_sse(fe, sim, body)
    assert [len(e["output_ids"]) for e in events] == [1, 3, 3, 1]
    for e in events:
        assert [t[1] for t in e["meta_info"]["output_token_logprobs"]] == e["output_ids"]
        assert len(e["meta_info"]["output_token_ids_logprobs"]) == len(e["output_ids"])
    whole = ok(fe, sim, body)
    assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]


def test_request_stream_interval_overrides_the_servers(frontend, sims):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 7, "ignore_eos": True, "stream_interval": 2}}
    assert [len(e["output_ids"]) for e in both_sse(frontend, sims[0], body)] == [1, 3, 5, 7]


def test_the_readmes_first_answer_is_whole_words(frontend, sims):
    """The simulated model never picks a lone byte of a multi-byte character
    (its text alone would be U+FFFD)."""
    out = ok(frontend, sims[0], {"text": "Hello", "sampling_params": {"max_new_tokens": 8}})
    assert (out["text"], out["output_ids"]) == (
        "annotationflict only length KeyError col reset follow", [2693, 2960, 1030, 1697, 1616, 1066, 3080, 1241])
    long = ok(frontend, sims[0], {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True,
                                                                           "n": 1}})
    assert "\ufffd" not in long["text"] and not set(long["output_ids"]) & TOK.partial_ids()
    assert len(TOK.partial_ids()) == 128
