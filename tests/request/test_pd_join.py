"""Prefill/decode answers joined as the engines really answer them.

The simulators play each engine's P/D legs as the released engines do
(:mod:`asgi_generate.sim.sglang`, :mod:`asgi_generate.sim.vllm`,
:mod:`asgi_generate.sim.kvconnector`): a decode that received the prompt's KV
reports the prefill's prefix-cache hit (SGLang, vLLM from 0.32) or the whole
prompt (vLLM before 0.32) as its ``cached_tokens``; it answers routed-expert
rows for every position with zeros where it never forwarded the prompt
(SGLang 0.5.23, vLLM 0.27; ``--decode-expert-rows own`` keeps the rows it
computed only); a vLLM MoRIIO producer hands off a prefill that stopped
before its length cap not at all. Against each, the client's answer is the
aggregated engine's, value for value, and the record keeps each leg's own
usage beside the request's figure. Then the law under faults: a decode leg
that fails after the KV hand-over (before its first token) or after k tokens,
retried, replayed or migrated onto an aggregated worker, with logprobs and
expert rows asked: the answer never carries the failed pair's prefill data.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Iterator

import httpx
import orjson
import pytest

from support import (
    CONTINUATION,
    DECODE,
    PREFILL,
    PROMPT,
    Traced,
    prefill_spec,
    post,
    same,
    sse,
    start_sim,
    vnorm,
    wait_until,
    without_timing,
)
from test_legs import anyio_backend, minted  # noqa: F401  (fixtures of the in-process tests)

GEN = "/inference/v1/generate"
EXPERTS = "--enable-return-routed-experts"
DETAILS = "--enable-prompt-tokens-details"
CACHE = ["--cache-tokens", "4096"]
V27 = ["--engine-version", "0.27.0"]
OWN = ["--decode-expert-rows", "own"]

SIMS = {
    # SGLang: a pair and an aggregated worker (the faults' auto fleet too),
    # and a cached pair whose decode answers its own expert rows only.
    "sg_prefill": ("sglang", PREFILL),
    "sg_decode": ("sglang", [*DECODE, "--itl-ms", "5"]),
    "sg_agg": ("sglang", []),
    "sg_prefill_cached": ("sglang", [*PREFILL, *CACHE]),
    "sg_decode_own": ("sglang", [*DECODE, *OWN]),
    "sg_agg_cached": ("sglang", CACHE),
    # vLLM 0.27 (a consumer counts the loaded prompt as cached, zeros for its
    # prompt rows; the faults' auto fleet too), and a MoRIIO producer before a
    # 0.33 consumer of its own rows only. Prompts up to 16 tokens never hit
    # a 16-token block.
    "v27_prefill": ("vllm", [*V27, "--kv-role", "producer", EXPERTS, DETAILS, *CACHE]),
    "v27_decode": ("vllm", [*V27, "--kv-role", "consumer", EXPERTS, DETAILS]),
    "v27_agg": ("vllm", [*V27, EXPERTS, DETAILS, *CACHE]),
    "v_prefill": ("vllm", ["--kv-role", "producer", "--kv-connector", "moriio", EXPERTS, DETAILS, *CACHE]),
    "v_decode_own": ("vllm", ["--kv-role", "consumer", *OWN, EXPERTS, DETAILS]),
    "v_agg": ("vllm", [EXPERTS, DETAILS, *CACHE]),
}


def _serve(started: dict) -> Iterator[dict]:
    """The processes ``started`` (name -> future) once every one is up,
    each stopped afterwards (those that started, when one did not)."""
    procs = {}
    try:
        for name, fut in started.items():
            procs[name] = fut.result()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def sims():
    """The simulators, the first alone (it may compile the session's
    bytecode cache), the others three at a time."""
    (first, (proto, extra)), *rest = SIMS.items()
    with ThreadPoolExecutor(3) as pool:
        started = {first: pool.submit(start_sim, proto, extra=extra)}
        wait(started.values())
        started.update({name: pool.submit(start_sim, proto, extra=extra) for name, (proto, extra) in rest})
    yield from _serve(started)


def _fleet(sims, prefills=(), decodes=(), aggregated=(), mode="always") -> list[str]:
    args = ["--disaggregation", mode]
    for name in prefills:
        s = sims[name]
        args += ["--prefill", prefill_spec(s) if name.startswith("sg") else f"vllm={s.url}"]
    for name in decodes:
        args += ["--decode", f"{'sglang' if name.startswith('sg') else 'vllm'}={sims[name].url}"]
    for name in aggregated:
        args += ["--worker", f"{'sglang' if name.startswith('sg') else 'vllm'}={sims[name].url}"]
    return args


#: Each frontend's fleet: an SGLang and a vLLM pair side by side (one
#: frontend serves both formats), in auto mode beside aggregated workers
#: (a request runs on a pair while both its workers are up).
FRONTS = {
    "pairs": dict(prefills=("sg_prefill", "v27_prefill"), decodes=("sg_decode", "v27_decode"),
                  aggregated=("sg_agg", "v27_agg"), mode="auto"),
    "own": dict(prefills=("sg_prefill_cached", "v_prefill"), decodes=("sg_decode_own", "v_decode_own")),
}


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fronts(request, sims, tmp_path_factory):
    with ThreadPoolExecutor(len(FRONTS)) as pool:
        started = {name: pool.submit(Traced, tmp_path_factory, _fleet(sims, **fleet), request.param)
                   for name, fleet in FRONTS.items()}
    yield from _serve(started)


@pytest.fixture(autouse=True)
def _own_records(request):
    """Each test takes only its own records (a failed one leaves its behind)."""
    if "fronts" in request.fixturenames:
        for fe in request.getfixturevalue("fronts").values():
            fe.taken = len(fe.records())


def _salt(fe) -> int:
    """Distinct prompts per worker class: the simulators' caches outlive one."""
    return 0 if fe.proc.name.endswith("trio") else 50


def _sglang(fe, agg, body: dict, stream: bool) -> None:
    """``fe``'s answer to ``body`` is ``agg``'s, value for value (bar the
    timing field and the id the frontend restores)."""
    body = {**body, "stream": stream}
    if not stream:
        got, want = post(fe.url, body), post(agg.url, body)
        assert got.status_code == want.status_code == 200, got.text
        g, w = got.json(), want.json()
        w["meta_info"]["id"] = g["meta_info"]["id"]
        same(without_timing(g), without_timing(w))
        return
    (status, got), (_, want) = sse(fe.url, body), sse(agg.url, body)
    assert status == 200 and got[-1] == b"[DONE]", got[-2:]
    g = [without_timing(orjson.loads(e)) for e in got[:-1]]
    w = [without_timing(orjson.loads(e)) for e in want[:-1]]
    for e in w:
        e["meta_info"]["id"] = g[0]["meta_info"]["id"]
    same(g, w)


def _vllm(fe, agg, body: dict, stream: bool) -> None:
    """``fe``'s vLLM answer to ``body`` is ``agg``'s, value for value (bar
    the request id and ``created``)."""
    body = {**body, "stream": stream}
    if not stream:
        got, want = post(fe.url, body, GEN), post(agg.url, body, GEN)
        assert got.status_code == want.status_code == 200, got.text
        same(vnorm(got.json()), vnorm(want.json()))
        return
    body["stream_options"] = {"include_usage": True}
    (status, got), (_, want) = sse(fe.url, body, GEN), sse(agg.url, body, GEN)
    assert status == 200 and got[-1] == b"[DONE]", got[-2:]
    same([vnorm(orjson.loads(e)) for e in got[:-1]], [vnorm(orjson.loads(e)) for e in want[:-1]])


def _usage(rec: dict) -> list:
    return [a.get("usage") for a in rec["attempts"]]


# -- usage across legs -------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
def test_sglang_usage_is_the_aggregated_engines_and_each_leg_keeps_its_own(fronts, sims, stream):
    """A 20-token prompt asked twice: the second time the prefill's cache
    holds 19 of it, as the aggregated engine's does; the decode reports the
    prefill's hit it received with the KV. The record keeps both legs'
    reports and the request's figure."""
    fe = fronts["own"]
    prompt = list(range(1000 + 100 * stream + _salt(fe), 1020 + 100 * stream + _salt(fe)))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    for _ in range(2):
        _sglang(fe, sims["sg_agg_cached"], body, stream)
    first, second = fe.take(2)
    assert (first["cached_tokens"], second["cached_tokens"]) == (0, 19)
    assert _usage(second) == [{"prompt_tokens": 20, "completion_tokens": 1, "cached_tokens": 19},
                              {"prompt_tokens": 20, "completion_tokens": 3, "cached_tokens": 19}]


@pytest.mark.e2e
@pytest.mark.parametrize("version", ["0.27", "0.33"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
def test_vllm_usage_is_the_aggregated_engines_and_each_leg_keeps_its_own(fronts, sims, version, stream):
    """A 40-token prompt asked twice: the second time the producer's cache
    holds 32 of it (two 16-token blocks), as the aggregated engine's does. A
    0.27 consumer counts the 40 tokens it loaded as cached, a 0.33 one
    reports the producer's 32 (``remote_prefill_cached_tokens``): the client
    gets 32 either way (0 the first time, as the aggregated engine reports a
    cold cache), the record both legs' own."""
    fe, agg = (fronts["pairs"], sims["v27_agg"]) if version == "0.27" else (fronts["own"], sims["v_agg"])
    prompt = list(range(2000 + 100 * stream + _salt(fe), 2040 + 100 * stream + _salt(fe)))
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 4, "ignore_eos": True}}
    for _ in range(2):
        _vllm(fe, agg, body, stream)
    first, second = fe.take(2)
    assert (first["cached_tokens"], second["cached_tokens"]) == (0, 32)
    decode_cached = 40 if version == "0.27" else 32
    assert _usage(second) == [{"prompt_tokens": 40, "completion_tokens": 1, "cached_tokens": 32},
                              {"prompt_tokens": 40, "completion_tokens": 4, "cached_tokens": decode_cached}]


# -- routed-expert rows by token position ---------------------------------------------


SG_EXPERTS = {
    "experts": {"input_ids": [5, 9, 77, 300, 12], "sampling_params": {"max_new_tokens": 6},
                "return_routed_experts": True, "return_logprob": True, "logprob_start_len": 0},
    "from_prompt_end": {"input_ids": [5, 9, 77, 300, 12], "sampling_params": {"max_new_tokens": 3},
                        "return_routed_experts": True, "routed_experts_start_len": 5},
    "from_mid_prompt": {"input_ids": [5, 9, 77, 300, 12], "sampling_params": {"max_new_tokens": 4},
                        "return_routed_experts": True, "routed_experts_start_len": 2},
    "one_token": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "return_routed_experts": True},
    "stop_on_first": {"input_ids": [7], "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [100]},
                      "return_routed_experts": True, "return_logprob": True},
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(SG_EXPERTS))
@pytest.mark.parametrize("decode", ["sequence", "own"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
def test_sglang_expert_rows_are_joined_by_token_position(fronts, sims, name, decode, stream):
    """The prompt positions' rows are the prefill leg's, the rest the decode
    leg's, whether the decode answers every position (zeros where it
    received the KV) or only its own: the aggregated engine's bytes."""
    fe, agg = (fronts["pairs"], sims["sg_agg"]) if decode == "sequence" else (fronts["own"], sims["sg_agg_cached"])
    _sglang(fe, agg, SG_EXPERTS[name], stream)
    (rec,) = fe.take()
    assert rec["status"] == "ok"


V_EXPERTS = {
    "experts": {"token_ids": [5, 9, 77, 300, 12], "sampling_params": {"max_tokens": 6, "logprobs": 1}},
    "one_token": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}},
    "one_token_prompt": {"token_ids": [42], "sampling_params": {"max_tokens": 4}},
    "stop_on_first": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "stop_token_ids": [2358]}},
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(V_EXPERTS))
@pytest.mark.parametrize("decode", ["0.27", "own"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
def test_vllm_expert_rows_are_joined_by_token_position(fronts, sims, name, decode, stream):
    """As for SGLang: a 0.27 consumer's prompt rows are slots the transfer
    filled (zeros here), never the answer's; a consumer of its own rows
    answers the output positions only."""
    fe, agg = (fronts["pairs"], sims["v27_agg"]) if decode == "0.27" else (fronts["own"], sims["v_agg"])
    _vllm(fe, agg, V_EXPERTS[name], stream)
    (rec,) = fe.take()
    assert rec["status"] == "ok"


# -- vLLM's prefill leg always hands off ------------------------------------------------

#: The prompt whose greedy first token is EOS.
EOS_FIRST = PROMPT + CONTINUATION[:23]
HANDOFF = {
    "eos_first": {"token_ids": EOS_FIRST, "sampling_params": {"max_tokens": 5, "logprobs": 1}},
    "stop_token_first": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 5, "stop_token_ids": [2358],
                                                                 "prompt_logprobs": 1}},
    "stop_token_first_min_tokens": {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 5, "stop_token_ids": [2358], "min_tokens": 2}},
    "eos_first_ignored": {"token_ids": EOS_FIRST, "sampling_params": {"max_tokens": 3, "ignore_eos": True}},
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(HANDOFF))
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
def test_vllm_prefill_leg_hands_off_whatever_stops_the_answer(fronts, sims, name, stream):
    """A MoRIIO producer hands off only a prefill that reached its length
    cap: the prefill leg is one token with no stop criterion and EOS
    ignored, so it always does; the decode leg keeps the client's criteria
    and ends the answer as the aggregated engine does."""
    body = HANDOFF[name]
    if stream:
        body = {**body, "sampling_params": {k: v for k, v in body["sampling_params"].items()
                                            if k != "prompt_logprobs"}}
    fe = fronts["own"]
    _vllm(fe, sims["v_agg"], body, stream)
    (rec,) = fe.take()
    assert [(a["role"], a["outcome"], a.get("local_prefill")) for a in rec["attempts"]] == [
        ("prefill", "finished", None), ("decode", "finished", None)]


# -- a decode leg failing at each point ----------------------------------------------------

FAULTED = {
    "sglang": {"input_ids": [5, 9, 77, 300, 12], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
               "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
               "return_routed_experts": True},
    "vllm": {"token_ids": [5, 9, 77, 300, 12, 8], "sampling_params": {
        "max_tokens": 6, "ignore_eos": True, "logprobs": 2}},
}


def _heal(sim, fronts) -> None:
    httpx.delete(sim.url + "/sim/faults", timeout=5).raise_for_status()
    for name, fe in fronts.items():
        want = sum(len(FRONTS[name].get(k, ())) for k in ("prefills", "decodes", "aggregated"))
        wait_until(lambda fe=fe, want=want: httpx.get(fe.url + "/health", timeout=5).json()[
            "healthy_workers"] == want)


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("after", [0, 3], ids=["after_handover", "after_3_tokens"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
def test_a_failed_pairs_prefill_data_never_joins_a_later_attempt(fronts, sims, engine, after, stream):
    """The decode leg dies after the KV hand-over, before its first token or
    after 3: the request is retried (a stream with nothing sent), replayed
    (unary) or migrated mid-stream, each onto the aggregated worker, whose
    answer is the whole answer: prompt logprobs and expert rows exactly the
    aggregated engine's, none of the failed pair's joined onto it."""
    fe = fronts["pairs"]
    decode, agg = (sims["sg_decode"], sims["sg_agg"]) if engine == "sglang" else (
        sims["v27_decode"], sims["v27_agg"])
    body = FAULTED[engine]
    if engine == "vllm" and not stream:
        body = {**body, "sampling_params": {**body["sampling_params"], "prompt_logprobs": 1}}
    prompt = body["input_ids" if engine == "sglang" else "token_ids"]
    httpx.post(decode.url + "/sim/faults", json={"after_tokens": after, "input_len": len(prompt)},
               timeout=5).raise_for_status()
    try:
        (_sglang if engine == "sglang" else _vllm)(fe, agg, body, stream)
    finally:
        _heal(decode, fronts)
    (rec,) = fe.take()
    third = "resumed" if stream and after else "replayed" if not stream else "aggregated"
    assert rec["status"] == "ok" and rec["output_tokens"] == 6
    (p, *rest) = [(a["role"], a["outcome"]) for a in rec["attempts"]]
    # SGLang's prefill answers once the decode took the KV; a decode that
    # fails at once may beat that answer to the frontend (it is then aborted).
    assert p in (("prefill", "finished"), ("prefill", "aborted") if engine == "sglang" else None)
    assert rest == [("decode", "worker_lost"), (third, "finished")]


# -- the joins, in process --------------------------------------------------------------


def _rows(*rows: tuple[int, int]) -> str:
    """Base64 int32 rows of two expert ids each (SGLang's layout)."""
    import array
    import base64

    return base64.b64encode(array.array("i", [e for row in rows for e in row]).tobytes()).decode()


P3 = [(1, 2), (3, 4), (5, 6)]  # the prefill's rows of a 3-token prompt
OUT = [(7, 8), (9, 10)]  # the output positions' rows of 3 output tokens
ZERO = (0, 0)


@pytest.mark.parametrize("own,start,tokens,want", [
    (_rows(ZERO, ZERO, ZERO, *OUT), 0, 3, _rows(*P3, *OUT)),  # every position, the prompt's unwritten
    (_rows(*OUT), 0, 3, _rows(*P3, *OUT)),  # its own positions only
    (_rows(ZERO, ZERO, ZERO), 0, 1, _rows(*P3)),  # one token: the prompt's rows are all
    (None, 0, 1, _rows(*P3)),
    ("", 0, 1, _rows(*P3)),
    (_rows(ZERO, ZERO, *OUT), 1, 3, _rows(*P3[1:], *OUT)),  # from a start inside the prompt
    (_rows(*OUT), 3, 3, _rows(*OUT)),  # from the prompt's end: the prefill has no row
])
def test_sglang_rows_join_by_token_position(own, start, tokens, want):
    from asgi_generate_sglang.experts import join

    pre = _rows(*P3[start:])
    assert join(pre, own, 3, start, tokens) == want


@pytest.mark.parametrize("pre,own,start,tokens,message", [
    (_rows(*P3), _rows(*OUT, ZERO), 0, 3, "come to 3 rows from the decode leg for 2 output positions after a "
                                            "prompt of 3 from 0"),
    (_rows(*P3), None, 0, 3, "come to 0 rows from the decode leg for 2 output positions after a prompt of 3 "
                             "from 0"),
    (_rows(*P3[:2]) + "", _rows(*OUT), 0, 3, "come to 16 bytes from the prefill leg for 3 prompt positions"),
    ("not base64!", _rows(*OUT), 0, 3, "are not base64 int32 rows"),
    (_rows(*P3), "AQID", 0, 3, "are not base64 int32 rows"),
    ("", None, 3, 3, "leave out the rows of 2 output positions"),
])
def test_sglang_rows_that_fit_neither_leg_fail_the_request(pre, own, start, tokens, message):
    from asgi_generate.sdk import RequestError
    from asgi_generate_sglang.experts import join

    with pytest.raises(RequestError) as exc:
        join(pre, own, 3, start, tokens)
    assert (exc.value.status, exc.value.message) == (502, "a P/D leg sent routed experts that " + message)


def test_vllm_last_rows_keep_the_array_layout():
    from asgi_generate_vllm import experts

    rows = experts.Rows("|u1", (4, 2, 2), bytes(range(16)))
    assert experts.last(rows, 2) == experts.Rows("|u1", (2, 2, 2), bytes(range(8, 16)))
    assert experts.last(rows, 0) == experts.Rows("|u1", (0, 2, 2), b"")


# -- the request path, in process (tests/request/test_legs.py's fake workers) -------------------

PROMPT_LP = [[None, 1, None], [-0.5, 2, None]]  # the prompt logprobs of [1, 2]


def _sg(ids_: list[int], finish, **meta) -> dict:
    return {"text": "", "output_ids": ids_, "meta_info": {"id": "e", "finish_reason": finish, **meta}}


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
async def test_a_failed_pairs_prefill_data_is_never_joined_onto_the_retried_attempt(minted, stream):
    """The prefill answered its prompt logprobs and rows, then the decode
    leg's worker was lost before any token: the aggregated attempt that
    answers instead is the whole answer, byte for byte its own."""
    from test_legs import BROKEN, Client, FakePool, FakeResponse, FakeRouter, sse as events, worker

    from asgi_generate_sglang import SGLangCodec

    pre = _sg([9], {"type": "length", "length": 0}, prompt_tokens=2, completion_tokens=1, cached_tokens=0,
              input_token_logprobs=PROMPT_LP, output_token_logprobs=[], routed_experts=_rows((1, 2), (3, 4)))
    own = _sg([9, 8], {"type": "length", "length": 2}, prompt_tokens=2, completion_tokens=2, cached_tokens=0,
              input_token_logprobs=PROMPT_LP, output_token_logprobs=[[-0.1, 9, None], [-0.2, 8, None]],
              routed_experts=_rows((1, 2), (3, 4), (5, 6)))
    prefill = FakePool(FakeResponse(200, [events(pre) if stream else orjson.dumps(pre), None]))
    decode = FakePool(FakeResponse(200, [BROKEN]))
    agg = FakePool(FakeResponse(200, [events(own, b"[DONE]") if stream else orjson.dumps(own), None]))
    pair = (worker("w0", "sglang", prefill, "prefill"), worker("w1", "sglang", decode, "decode"))
    body = {"input_ids": [1, 2], "rid": "mine", "stream": stream, "return_logprob": True,
            "logprob_start_len": 0, "return_routed_experts": True, "sampling_params": {"max_new_tokens": 2}}
    client = Client(SGLangCodec(), body, FakeRouter(pair, (worker("w2", "sglang", agg),), probe_up=False))
    await client.run()
    want = orjson.dumps({**own, "meta_info": {**own["meta_info"], "id": "mine"}})
    assert client.body == (events(want, b"[DONE]") if stream else want)
    assert [(a.role, a.outcome) for a in client.st.attempts] == [
        ("prefill", "finished"), ("decode", "worker_lost"), ("aggregated" if stream else "replayed", "finished")]


@pytest.mark.anyio
async def test_usage_is_the_prefills_hit_and_each_leg_keeps_its_own(minted):
    """vLLM: a decode that counts the 3 prompt tokens it loaded as cached;
    the client's closing usage chunk shows the prefill's 2, the record both
    legs' own and the request's 2."""
    from test_legs import KV, Client, FakePool, FakeResponse, FakeRouter, sse as events, worker

    from asgi_generate.tracing.record import build_record
    from asgi_generate_vllm import VLLMCodec

    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
             "prompt_tokens_details": {"cached_tokens": 2}}
    p = FakePool(FakeResponse(200, [orjson.dumps({"request_id": "generate-tokens-e0", "usage": usage, "choices": [
        {"index": 0, "token_ids": [9], "finish_reason": "length"}], "kv_transfer_params": KV})]))
    d = FakePool(FakeResponse(200, [events(
        {"request_id": "x", "choices": [{"index": 0, "token_ids": [9, 8], "finish_reason": "length"}]},
        {"request_id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                                     "prompt_tokens_details": {"cached_tokens": 3}}},
        b"[DONE]"), None]))
    plan = (worker("w0", "vllm", p, "prefill"), worker("w1", "vllm", d, "decode"))
    body = {"token_ids": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 2}}
    client = Client(VLLMCodec(), body, FakeRouter(plan))
    await client.run()
    assert client.body.split(b"\n\n")[1] == (
        b'data: {"request_id":"generate-tokens-rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr","choices":[],"usage":'
        b'{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":2}}}')
    client.st.t_done = client.st.t_received
    rec = build_record(client.st, 16)
    assert rec["cached_tokens"] == 2
    assert _usage(rec) == [{"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 2},
                           {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 3}]
