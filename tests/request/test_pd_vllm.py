"""vLLM prefill/decode (sequential legs): a P/D answer is the aggregated
answer, value for value (tokens, logprobs, prompt logprobs, finish reasons,
routed-expert bytes), and every failure ends cleanly.

The simulators play vLLM's KV connector (a producer keeps a finished
prefill's blocks until the consumer reads them or ``--kv-expiry-s`` passes)
and ``--enable-return-routed-experts``; the aggregated simulator answers the
same request directly.
"""

from __future__ import annotations

import base64
import io
import signal
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import (
    CONSUMER,
    EXPERTS,
    PRODUCER,
    PROMPT,
    RawClient,
    Traced,
    post,
    same,
    sse,
    start_sim,
    stats,
    vnorm,
    wait_until,
)
from wire_proxy import WireProxy

GEN = "/inference/v1/generate"


def pd_args(prefills, decodes, *extra) -> list[str]:
    args = ["--disaggregation", "always", *extra]
    for p in prefills:
        args += ["--prefill", f"vllm={p.url}"]
    for d in decodes:
        args += ["--decode", f"vllm={d.url}"]
    return args


@pytest.fixture(scope="module")
def vsims():
    procs = {"prefill": start_sim("vllm", extra=[*PRODUCER, "--kv-expiry-s", "0.5"]),
             "decode": start_sim("vllm", itl_ms=30, extra=CONSUMER),
             "agg": start_sim("vllm", extra=[EXPERTS])}
    yield procs
    for p in procs.values():
        p.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def vfronts(request, vsims, tmp_path_factory):
    """P/D frontends on one worker class: (strict, and strict and
    --pd-fallback with the aggregated simulator as their prefill worker, a
    worker without a KV connector, which answers no kv_transfer_params)."""
    strict = Traced(tmp_path_factory, pd_args([vsims["prefill"]], [vsims["decode"]]), request.param)
    unpaired = [Traced(tmp_path_factory, pd_args([vsims["agg"]], [vsims["decode"]], *extra), request.param)
                for extra in ((), ("--pd-fallback",))]
    yield strict, *unpaired
    for fe in (strict, *unpaired):
        fe.stop()


@pytest.fixture
def vfront(vfronts):
    return vfronts[0]


def npy(value: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(value)))


VBODIES = {
    "plain": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8}},
    "logprobs": {"token_ids": [5, 9, 77, 300, 12], "sampling_params": {"max_tokens": 5, "logprobs": 3,
                                                                       "prompt_logprobs": 2, "min_tokens": 2}},
    "prompt_logprobs": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "prompt_logprobs": 0}},
    "one_token": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "logprobs": 1}},
    "one_token_plain": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}},
    "one_token_prompt": {"token_ids": [42], "sampling_params": {"max_tokens": 4, "logprobs": 0}},
    "ignore_eos": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 30, "ignore_eos": True}},
}
#: Bodies whose first token is a stop token, for a prefill worker that
#: answers no kv_transfer_params.
FALLBACK_BODIES = {
    "stop_on_first": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "stop_token_ids": [2358],
                                                               "logprobs": 2, "prompt_logprobs": 1}},
    "stop_on_first_one_token": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "stop_token_ids": [2358]}},
}


def _law(fe, agg, body: dict, stream: bool) -> list[int]:
    """Assert ``fe``'s answer to ``body`` is ``agg``'s; return its token ids."""
    body = {**body, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        status, got = sse(fe.url, body, GEN)
        _, want = sse(agg.url, body, GEN)
        assert status == 200 and got[-1] == b"[DONE]"
        same([vnorm(orjson.loads(e)) for e in got[:-1]], [vnorm(orjson.loads(e)) for e in want[:-1]])
        return [t for e in got[:-1] for c in orjson.loads(e)["choices"] for t in c["token_ids"]]
    got = post(fe.url, body, GEN)
    assert got.status_code == 200, got.text
    same(vnorm(got.json()), vnorm(post(agg.url, body, GEN).json()))
    return got.json()["choices"][0]["token_ids"]


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(VBODIES))
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_vllm_pd_is_the_aggregated_answer(vfront, vsims, name, stream):
    ids = _law(vfront, vsims["agg"], VBODIES[name], stream)
    (rec,) = vfront.take()
    assert rec["status"] == "ok" and rec["output_tokens"] == len(ids)
    p, d = rec["attempts"]
    assert (p["role"], p["outcome"], d["role"], d["outcome"]) == ("prefill", "finished", "decode", "finished")
    assert "local_prefill" not in d
    assert p["engine_id"] == d["engine_id"]  # one X-Request-Id on both legs
    rid = "generate-tokens-" + p["engine_id"]
    assert rid in stats(vsims["prefill"])["seen_rids"] and rid in stats(vsims["decode"])["seen_rids"]
    wait_until(lambda: stats(vsims["prefill"])["kv_blocks_held"] == 0)  # the consumer read them


@pytest.mark.e2e
def test_vllm_routed_experts_are_the_aggregated_array(vfront, vsims):
    """The joined rows are numpy's bytes of the aggregated array: the prompt
    positions (the prefill leg's), then the output positions but the last
    (the decode leg's); one token: the prefill leg's rows alone."""
    for max_tokens, rows in ((6, 4 + 6 - 1), (1, 4)):
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}
        got = post(vfront.url, body, GEN).json()["choices"][0]["routed_experts"]
        want = post(vsims["agg"].url, body, GEN).json()["choices"][0]["routed_experts"]
        assert got == want
        arr = npy(got)
        assert (arr.shape, arr.dtype) == ((rows, 4, 2), np.uint8)
        buf = io.BytesIO()
        np.save(buf, arr)
        assert base64.b64encode(buf.getvalue()).decode() == got
    vfront.take(2)


@pytest.mark.e2e
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(10, 4000), min_size=1, max_size=10),
    max_tokens=st.integers(1, 10),
    logprobs=st.none() | st.integers(0, 3),
    prompt_logprobs=st.none() | st.integers(0, 2),
    stop=st.lists(st.integers(10, 4000), max_size=2),
    ignore_eos=st.booleans(),
    stream=st.booleans(),
)
def test_property_vllm_pd_equals_aggregated(vfronts, vsims, prompt, max_tokens, logprobs, prompt_logprobs, stop,
                                            ignore_eos, stream):
    """Any sampling settings (a first token that is EOS or a stop token
    too: the prefill leg ignores both, so it always hands off) give the
    aggregated answer."""
    fe = vfronts[0]
    sp = {"max_tokens": max_tokens, "stop_token_ids": stop, "ignore_eos": ignore_eos}
    if logprobs is not None:
        sp["logprobs"] = logprobs
    if prompt_logprobs is not None and not stream:
        sp["prompt_logprobs"] = prompt_logprobs
    _law(fe, vsims["agg"], {"token_ids": prompt, "sampling_params": sp}, stream)
    fe.take()


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_client_kv_transfer_params_are_refused_on_a_pd_fleet(vfront, vsims, stream):
    """The frontend owns kv_transfer_params: a client's is refused before
    any leg runs (it could name another request's KV blocks)."""
    before = stats(vsims["prefill"])["received"], stats(vsims["decode"])["received"]
    kv = {"do_remote_prefill": True, "remote_block_ids": [0], "remote_engine_id": "e", "remote_host": "127.0.0.1",
          "remote_port": 1, "remote_request_id": "generate-tokens-someone-else"}
    r = post(vfront.url, {"token_ids": PROMPT, "stream": stream, "kv_transfer_params": kv,
                          "sampling_params": {"max_tokens": 4}}, GEN)
    assert (r.status_code, r.json()) == (400, {"error": {
        "message": "kv_transfer_params is set by the frontend for prefill/decode routing; do not send it.",
        "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}})
    assert (stats(vsims["prefill"])["received"], stats(vsims["decode"])["received"]) == before
    (rec,) = vfront.take()
    assert (rec["status"], rec["attempts"]) == ("rejected", [])


# -- --pd-fallback ---------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(FALLBACK_BODIES))
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_prefill_without_kv_transfer_params_is_an_error_without_fallback(vfronts, vsims, name, stream):
    """A prefill worker that answers no kv_transfer_params (no KV connector
    hands its KV off): an error of that leg, never a silent local prefill."""
    fe = vfronts[1]
    before = stats(vsims["decode"])["received"]
    r = post(fe.url, {**FALLBACK_BODIES[name], "stream": stream}, GEN)
    assert (r.status_code, r.json()) == (502, {"error": {
        "message": "the prefill worker answered no kv_transfer_params", "type": "Bad Gateway", "param": None,
        "code": 502}})
    assert stats(vsims["decode"])["received"] == before
    (rec,) = fe.take()
    assert (rec["status"], rec["http_status"], rec["error"]["message"]) == (
        "engine_error", 502, "the prefill worker answered no kv_transfer_params")
    assert [(a["role"], a["outcome"]) for a in rec["attempts"]] == [("prefill", "finished")]


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(FALLBACK_BODIES))
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_pd_fallback_lets_the_decode_worker_prefill_alone(vfronts, vsims, name, stream):
    """With --pd-fallback the decode leg runs without kv_transfer_params and
    prefills alone (recorded); its answer is the aggregated one (both legs
    computed the prompt logprobs, and they agree)."""
    fe = vfronts[2]
    ids = _law(fe, vsims["agg"], FALLBACK_BODIES[name], stream)
    assert ids == [2358]
    (rec,) = fe.take()
    assert rec["status"] == "ok" and rec["output_tokens"] == 1
    assert [(a["role"], a["outcome"], a.get("local_prefill")) for a in rec["attempts"]] == [
        ("prefill", "finished", None), ("decode", "finished", True)]


# -- prompt logprobs across legs ----------------------------------------------------


@pytest.mark.e2e
def test_prompt_logprobs_come_from_the_leg_that_computed_the_prompt(vsims):
    """The prefill leg computes the prompt logprobs; a consumer asked for
    them too loads no remote KV and prefills the prompt itself (vLLM from
    0.32), so it answers the same ones."""
    p, d = vsims["prefill"], vsims["decode"]
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "prompt_logprobs": 1}}
    leg = post(p.url, {**body, "kv_transfer_params": {"do_remote_decode": True},
                       "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}}, GEN).json()
    want = post(vsims["agg"].url, body, GEN).json()
    assert leg["prompt_logprobs"] == want["prompt_logprobs"] and want["prompt_logprobs"][1] is not None
    local = stats(d)["local_prefills"]
    decoded = post(d.url, {**body, "kv_transfer_params": leg["kv_transfer_params"]}, GEN).json()
    assert decoded["prompt_logprobs"] == want["prompt_logprobs"] and stats(d)["local_prefills"] == local + 1
    assert decoded["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def tampered(vsims, tmp_path_factory):
    """A frontend whose decode worker is behind a proxy that changes one
    value of the decode's unary answers, as a worker of another build or
    model might: the first prompt logprob, or the routed-expert rows."""
    mode = {"what": None}

    def rewrite(path, status, body):
        if path != GEN or status != 200:
            return status, body
        obj = orjson.loads(body)
        if mode["what"] == "prompt_logprobs":
            obj["prompt_logprobs"] = [None, {"2": {"logprob": -1.5, "rank": 2, "decoded_token": None}}]
        elif mode["what"] is not None:
            obj["choices"][0]["routed_experts"] = mode["what"]
        return status, orjson.dumps(obj)

    proxy = WireProxy(vsims["decode"].url, rewrite=rewrite)
    fe = Traced(tmp_path_factory, pd_args([vsims["prefill"]], [proxy], "--pd-fallback"))
    yield fe, mode
    fe.stop()
    proxy.stop()


@pytest.mark.e2e
def test_prompt_logprobs_that_differ_between_legs_fail_the_request(tampered):
    fe, mode = tampered
    mode["what"] = "prompt_logprobs"
    r = post(fe.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "prompt_logprobs": 1}}, GEN)
    assert (r.status_code, r.json()) == (502, {"error": {
        "message": "the prefill and decode legs answered different prompt_logprobs", "type": "Bad Gateway",
        "param": None, "code": 502}})
    (rec,) = fe.take()
    assert (rec["status"], rec["http_status"]) == ("engine_error", 502)
    assert [(a["role"], a["outcome"]) for a in rec["attempts"]] == [("prefill", "finished"), ("decode", "error")]


def _npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.e2e
@pytest.mark.parametrize("rows,message", [
    ("bm90IG5weQ", "a P/D leg sent routed experts that are not base64"),
    (_npy_b64(np.zeros((2, 4, 2), np.uint16)),
     "prefill and decode legs sent routed experts of different dtypes ('|u1', '<u2')"),
    (_npy_b64(np.zeros((2, 4, 3), np.uint8)),
     "prefill and decode legs sent routed experts of different trailing shapes ((4, 2), (4, 3))"),
    (_npy_b64(np.zeros((5, 4, 2), np.uint8)), "the decode leg sent 5 routed-expert rows for 3 output tokens"),
])
def test_bad_decode_expert_rows_fail_the_request(tampered, rows, message):
    fe, mode = tampered
    mode["what"] = rows
    r = post(fe.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}}, GEN)
    assert (r.status_code, r.json()) == (502, {"error": {
        "message": message, "type": "Bad Gateway", "param": None, "code": 502}})
    (rec,) = fe.take()
    assert (rec["status"], rec["error"]["message"]) == ("engine_error", message)


# -- the wire, as the workers saw it --------------------------------------------------


@pytest.mark.e2e
def test_wire_audit_of_every_prefill_and_decode_body(vsims, tmp_path_factory):
    """A recording proxy before each worker: the prefill leg gets the
    client's body with the minted id, max_tokens 1, EOS ignored, no stop
    criterion, min_tokens or stream_options, stream false and the P/D
    kv_transfer_params; the decode leg gets the client's body with the same
    id, the client's stream, budget and stop criteria and the prefill
    answer's kv_transfer_params verbatim."""
    pp, dp = WireProxy(vsims["prefill"].url), WireProxy(vsims["decode"].url)
    fe = Traced(tmp_path_factory, pd_args([pp], [dp]))
    try:
        clients = [
            {"token_ids": PROMPT, "request_id": "mine", "stream": True, "cache_salt": "salt", "priority": 0,
             "stream_options": {"include_usage": False},
             "sampling_params": {"max_tokens": 6, "min_tokens": 2, "logprobs": 1, "ignore_eos": True}},
            {"token_ids": [5, 9, 77], "sampling_params": {"max_tokens": 3, "prompt_logprobs": 1,
                                                          "stop_token_ids": [7, 8], "ignore_eos": False}},
        ]
        for body in clients * 2:
            if body.get("stream"):
                assert sse(fe.url, body, GEN)[0] == 200
            else:
                assert post(fe.url, body, GEN).status_code == 200
        recs = fe.take(4)
        pre, dec = pp.requests(GEN), dp.requests(GEN)
        assert len(pre) == len(dec) == 4
        kv_seen = set()
        for body, rec, p, d in zip(clients * 2, recs, pre, dec):
            minted = rec["attempts"][0]["engine_id"]
            assert [a["engine_id"] for a in rec["attempts"]] == [minted, minted]
            assert p.headers["x-request-id"] == d.headers["x-request-id"] == minted
            sp = {k: v for k, v in body["sampling_params"].items()
                  if k not in ("min_tokens", "stop", "stop_token_ids")}
            want_p = {k: v for k, v in body.items() if k != "stream_options"}
            want_p.update(sampling_params={**sp, "max_tokens": 1, "ignore_eos": True}, stream=False,
                          kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                              "remote_engine_id": None, "remote_block_ids": None,
                                              "remote_host": None, "remote_port": None})
            assert p.body == want_p
            kv = d.body["kv_transfer_params"]  # the producer's answer, verbatim
            assert kv == {"do_remote_prefill": True, "do_remote_decode": False,
                          "remote_block_ids": kv["remote_block_ids"], "remote_engine_id": kv["remote_engine_id"],
                          "remote_request_id": "generate-tokens-" + minted, "remote_host": "127.0.0.1",
                          "remote_port": kv["remote_port"], "tp_size": 1, "remote_prefill_cached_tokens": 0}
            assert len(kv["remote_block_ids"]) == 1
            kv_seen.add(kv["remote_block_ids"][0])
            want_d = {**body, "kv_transfer_params": kv}
            if body.get("stream"):
                want_d["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
            assert d.body == want_d
        assert len(kv_seen) == 4  # each prefill's own blocks
        assert pp.forwarded == len(pp.seen) and dp.forwarded == len(dp.seen)  # nothing held back
    finally:
        fe.stop()
        pp.stop()
        dp.stop()


# -- disconnects at each phase ------------------------------------------------------


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """A slow prefill worker (1 s to its answer, blocks kept 1 s) and a
    decode worker behind a proxy that holds decode requests until released:
    the frontend is then between the prefill's answer and the decode's
    request reaching its engine."""
    p = start_sim("vllm", ttft_ms=1000, extra=[*PRODUCER, "--kv-expiry-s", "1"])
    d = start_sim("vllm", itl_ms=50, extra=CONSUMER)
    proxy = WireProxy(d.url, hold=lambda seen: seen.path == GEN)
    fe = Traced(tmp_path_factory, pd_args([p], [proxy]))
    yield fe, p, d, proxy
    fe.stop()
    proxy.stop()
    p.stop()
    d.stop()


def _quiet(*sims) -> None:
    """Nothing running and no KV held (past the expiry) on every simulator."""
    for s in sims:
        wait_until(lambda s=s: (x := stats(s))["running"] == 0 and x.get("kv_blocks_held", 0) == 0, timeout=5)


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_disconnect_before_the_prefill_answered(held, stream):
    fe, p, d, proxy = held
    seen = len(proxy.requests(GEN))
    c = RawClient(fe.url)
    c.send(orjson.dumps({"token_ids": PROMPT, "stream": stream, "sampling_params": {"max_tokens": 20}}), path=GEN)
    (rid,) = wait_until(lambda: stats(p)["running_rids"])
    c.close()
    wait_until(lambda: rid in stats(p)["abort_named_ids"], timeout=3)  # the frontend's abort arrived
    _quiet(p, d)
    assert len(proxy.requests(GEN)) == seen  # no decode was ever sent
    (rec,) = fe.take()
    assert (rec["status"], rec["output_tokens"]) == ("client_disconnect", 0)
    assert [(a["role"], "generate-tokens-" + a["engine_id"], a["outcome"], a["abort_acked"])
            for a in rec["attempts"]] == [("prefill", rid, "aborted", True)]


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_disconnect_between_the_prefill_answer_and_the_decode(held, stream):
    """The prefill answered (its blocks are held for the decode); the decode
    request has not reached its engine when the client leaves: the decode
    leg is aborted (acknowledged), the request never reaches the engine, and
    the producer's blocks expire."""
    fe, p, d, proxy = held
    expired, received = stats(p)["kv_blocks_expired"], stats(d)["received"]
    seen = len(proxy.requests(GEN))
    c = RawClient(fe.url)
    c.send(orjson.dumps({"token_ids": PROMPT, "stream": stream, "sampling_params": {"max_tokens": 20}}), path=GEN)
    wait_until(lambda: len(proxy.requests(GEN)) == seen + 1, timeout=5)
    assert stats(p)["kv_blocks_held"] == 1
    c.close()
    (rec,) = fe.take()
    assert (rec["status"], rec["output_tokens"]) == ("client_disconnect", 0)
    assert [(a["role"], a["outcome"], a.get("abort_acked")) for a in rec["attempts"]] == [
        ("prefill", "finished", None), ("decode", "aborted", True)]
    rid = "generate-tokens-" + rec["attempts"][1]["engine_id"]
    assert rid in stats(d)["abort_named_ids"]
    _quiet(p, d)  # the blocks nobody read expired
    assert stats(p)["kv_blocks_expired"] == expired + 1
    assert stats(d)["received"] == received and rid not in stats(d)["seen_rids"]


@pytest.mark.e2e
def test_disconnect_during_decode(vfront, vsims):
    p, d = vsims["prefill"], vsims["decode"]
    c = RawClient(vfront.url)
    c.send(orjson.dumps({"token_ids": PROMPT, "stream": True,
                         "sampling_params": {"max_tokens": 60, "ignore_eos": True}}), path=GEN)
    assert len(c.events(2)) == 2
    (rid,) = stats(d)["running_rids"]
    c.close()
    wait_until(lambda: rid in stats(d)["abort_named_ids"] and stats(d)["running"] == 0, timeout=3)
    _quiet(p, d)
    (rec,) = vfront.take()
    assert rec["status"] == "client_disconnect" and 2 <= rec["output_tokens"] < 60
    assert [(a["role"], a["outcome"], a.get("abort_acked")) for a in rec["attempts"]] == [
        ("prefill", "finished", None), ("decode", "aborted", True)]


# -- failures --------------------------------------------------------------------------


@pytest.mark.e2e
def test_consumer_prefills_locally_when_blocks_expired(vsims):
    """The producer drops blocks nobody read after --kv-expiry-s; a consumer
    given them prefills alone (counted) and answers the same."""
    p, d = vsims["prefill"], vsims["decode"]
    expired = stats(p)["kv_blocks_expired"]
    leg = post(p.url, {"token_ids": PROMPT, "kv_transfer_params": {"do_remote_decode": True},
                       "sampling_params": {"max_tokens": 1}}, GEN).json()
    kv = leg["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_port"] > 0 and kv["remote_block_ids"] == [
        kv["remote_block_ids"][0]]
    wait_until(lambda: (x := stats(p))["kv_blocks_held"] == 0 and x["kv_blocks_expired"] == expired + 1, timeout=5)
    local = stats(d)["local_prefills"]
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 5, "prompt_logprobs": 1}}
    got = post(d.url, {**body, "kv_transfer_params": kv}, GEN).json()
    assert stats(d)["local_prefills"] == local + 1
    same(vnorm(got), vnorm(post(vsims["agg"].url, body, GEN).json()))


@pytest.fixture(scope="module")
def two_pairs(tmp_path_factory):
    """Two prefill workers (the first takes 1 s to prefill) and two decode
    workers, and an aggregated one to compare with; the tests below use them
    in order (the first freezes, then is stopped; the first decode worker is
    stopped)."""
    procs = [start_sim("vllm", ttft_ms=1000, extra=[*PRODUCER, "--kv-expiry-s", "0.5"]),
             start_sim("vllm", extra=[*PRODUCER, "--kv-expiry-s", "0.5"])]
    procs += [start_sim("vllm", extra=CONSUMER) for _ in range(2)]
    procs.append(start_sim("vllm", extra=[EXPERTS]))
    yield procs
    for s in procs:
        s.stop()


BODY = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "logprobs": 1, "prompt_logprobs": 1}}


@pytest.mark.e2e
def test_prefill_worker_lost_to_the_health_probe_mid_request(two_pairs, tmp_path_factory):
    """The prefill engine freezes mid-prefill (SIGSTOP): the health probe
    gives it up, the leg is dropped and the request runs on the other pair."""
    p1, p2, _, d2, agg = two_pairs
    fe = Traced(tmp_path_factory, pd_args([p1, p2], [d2], "--health-timeout", "0.3", "--health-failures", "2"))
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, fe.url, BODY, GEN)
            wait_until(lambda: stats(p1)["running"] == 1)
            p1.signal(signal.SIGSTOP)
            try:
                got = answer.result(20)
            finally:
                p1.signal(signal.SIGCONT)
        same(vnorm(got.json()), vnorm(post(agg.url, BODY, GEN).json()))
        (rec,) = fe.take()
        assert rec["status"] == "ok"
        assert [(a["role"], a["worker_id"], a["outcome"]) for a in rec["attempts"]] == [
            ("prefill", "w0", "worker_lost"), ("prefill", "w1", "finished"), ("decode", "w2", "finished")]
        _quiet(p1, p2, d2)  # the frozen prefill, thawed, finished; nobody read its blocks
    finally:
        fe.stop()


@pytest.mark.e2e
def test_prefill_worker_down_goes_to_another_pair(two_pairs, tmp_path_factory):
    p1, p2, d1, d2, agg = two_pairs  # the router probes rarely: the request meets p1 gone
    fe = Traced(tmp_path_factory, pd_args([p1, p2], [d1], "--health-interval", "60"))
    try:
        p1.stop()
        same(vnorm(post(fe.url, BODY, GEN).json()), vnorm(post(agg.url, BODY, GEN).json()))
        (rec,) = fe.take()
        assert rec["status"] == "ok"
        assert [(a["role"], a["worker_id"], a["outcome"]) for a in rec["attempts"]] == [
            ("prefill", "w0", "connect_failed"), ("prefill", "w1", "finished"), ("decode", "w2", "finished")]
        _quiet(p2, d1)
    finally:
        fe.stop()


@pytest.mark.e2e
def test_decode_worker_down_goes_to_another_pair(two_pairs, tmp_path_factory):
    """The first pair's decode worker is gone: a new pair runs the request;
    the blocks the first prefill kept for it expire."""
    _, p2, d1, d2, agg = two_pairs
    fe = Traced(tmp_path_factory, pd_args([p2], [d1, d2], "--health-interval", "60"))
    try:
        expired = stats(p2)["kv_blocks_expired"]
        d1.stop()
        same(vnorm(post(fe.url, BODY, GEN).json()), vnorm(post(agg.url, BODY, GEN).json()))
        (rec,) = fe.take()
        assert rec["status"] == "ok"
        assert [(a["role"], a["worker_id"], a["outcome"]) for a in rec["attempts"]] == [
            ("prefill", "w0", "finished"), ("decode", "w1", "connect_failed"),
            ("prefill", "w0", "finished"), ("decode", "w2", "finished")]
        _quiet(p2, d2)
        assert stats(p2)["kv_blocks_expired"] == expired + 1
    finally:
        fe.stop()


@pytest.mark.e2e
def test_prefill_answering_an_error_is_the_answer(vsims, tmp_path_factory):
    """The prefill engine fails (vLLM's 500 for a dead engine core): the
    client gets that error as the engine gave it; no decode is sent."""
    error = {"error": {"message": "EngineCore encountered an issue. See stack trace for the root cause.",
                       "type": "InternalServerError", "param": None, "code": 500}}
    proxy = WireProxy(vsims["prefill"].url, rewrite=lambda path, status, body: (
        (500, orjson.dumps(error)) if path == GEN else (status, body)))
    fe = Traced(tmp_path_factory, pd_args([proxy], [vsims["decode"]]))
    try:
        before = stats(vsims["decode"])["received"]
        r = post(fe.url, BODY, GEN)
        assert (r.status_code, r.json()) == (500, error)
        (rec,) = fe.take()
        assert (rec["status"], rec["http_status"]) == ("engine_error", 500)
        assert [(a["role"], a["outcome"]) for a in rec["attempts"]] == [("prefill", "error")]
        assert stats(vsims["decode"])["received"] == before
    finally:
        fe.stop()
        proxy.stop()


# -- the vLLM codec's leg joins, sans-IO ---------------------------------------------


def _legs(body: dict):
    from asgi_generate.sdk._codec import Attempt, Pair
    from asgi_generate_vllm import VLLMCodec

    codec = VLLMCodec()
    ex = codec.exchange(codec.decode(orjson.dumps(body), {b"content-type": b"application/json"}), "r" * 32)
    pair = Pair()
    p, d = Attempt("a" * 32, "prefill", pair=pair), Attempt("a" * 32, "decode", pair=pair)
    ex.worker_request(p)
    return ex, p, d


def _prefill_answer(rows=None, prompt_logprobs=None) -> bytes:
    kv = {"do_remote_prefill": True, "remote_block_ids": [1]}
    return orjson.dumps({"request_id": "x", "choices": [{"index": 0, "finish_reason": "length", "token_ids": [7],
                                                         "routed_experts": rows}],
                         "prompt_logprobs": prompt_logprobs, "kv_transfer_params": kv})


def _decode_answer(ids, rows=None, finish="length", prompt_logprobs=None) -> bytes:
    return orjson.dumps({"request_id": "x", "choices": [{"index": 0, "finish_reason": finish, "token_ids": ids,
                                                         "routed_experts": rows}],
                         "usage": None, "prompt_logprobs": prompt_logprobs, "kv_transfer_params": None})


def _rows(n: int, start: int = 0, dtype=np.uint8, trailing=(2, 2)) -> np.ndarray:
    return (np.arange(n * int(np.prod(trailing))).reshape(n, *trailing) + start * 10).astype(dtype)


PROMPT3 = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}


@pytest.mark.parametrize("pre,own,ids,finish,want", [
    (_rows(3), _rows(2, 3), [7, 8, 9], "length", np.concatenate([_rows(3), _rows(2, 3)])),  # joined
    (_rows(3), np.concatenate([np.zeros((3, 2, 2), np.uint8), _rows(2, 3)]), [7, 8, 9], "length",
     np.concatenate([_rows(3), _rows(2, 3)])),  # every position: the prompt's by position, the prefill's
    (_rows(3), None, [7], "length", _rows(3)),  # one token: the prefill's rows are all of them
    (_rows(3), _rows(2, 3), [7, 8, 9], "abort", None),  # aborted: none
    (_rows(3), _rows(5), [7, 8, 9], "stop", np.concatenate([_rows(3), _rows(5)[3:]])),
    (None, _rows(5), [7, 8, 9], "stop", _rows(5)),  # no prefill rows: the decode leg's, when whole
    (None, _rows(2), [7, 8, 9], "stop", None),  # only the decode leg's part: incomplete
    (None, None, [7, 8, 9], "stop", None),
])
def test_codec_joins_vllm_expert_rows(pre, own, ids, finish, want):
    ex, p, d = _legs(PROMPT3)
    ex.feed(p, _prefill_answer(None if pre is None else _npy_b64(pre)))
    ex.worker_request(d)
    ex.feed(d, _decode_answer(ids, None if own is None else _npy_b64(own), finish))
    got = orjson.loads(ex.unary_body()[1])["choices"][0]["routed_experts"]
    assert got == (None if want is None else _npy_b64(want))


def test_codec_joins_vllm_expert_rows_on_the_final_chunk_only():
    ex, p, d = _legs({**PROMPT3, "stream": True})
    ex.feed(p, _prefill_answer(_npy_b64(_rows(3))))
    ex.worker_request(d)
    chunks = [orjson.dumps({"request_id": "x", "choices": [{"index": 0, "finish_reason": f, "token_ids": [t],
                                                            "routed_experts": r}]})
              for t, f, r in ((7, None, None), (8, None, None), (9, "length", _npy_b64(_rows(2, 3))))]
    got = []
    for c in chunks:
        ex.feed(d, c)
        got.append(orjson.loads(ex.client_event(None))["choices"][0]["routed_experts"])
    assert got == [None, None, _npy_b64(np.concatenate([_rows(3), _rows(2, 3)]))]


def _npy_raw(header: str, data: bytes) -> str:
    text = header.encode("latin-1")
    return base64.b64encode(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data).decode()


BIG = 8 << 20  # the most elements of one array


@pytest.mark.parametrize("pre,own,message", [
    ("not base64!", None, "a P/D leg sent routed experts that are not base64"),
    (base64.b64encode(b"PK\x03\x04 not npy").decode(), None, "a P/D leg sent routed experts that are not a .npy array"),
    (_npy_b64(np.asfortranarray(_rows(3))), None, "a P/D leg sent routed experts that are not in C order"),
    (_npy_b64(_rows(3).astype(np.float32)), None,
     "a P/D leg sent routed experts that have dtype '<f4', not a little-endian integer"),
    (_npy_b64(np.zeros((3, 1, 1, 1, 1, 1, 1, 1, 1), np.uint8)), None,
     "a P/D leg sent routed experts that have shape (3, 1, 1, 1, 1, 1, 1, 1, 1), not 1 to 8 axes"),
    (_npy_raw("{'descr': '|u1', 'fortran_order': False, 'shape': (3, 2, 2), }", b"\0" * 11), None,
     "a P/D leg sent routed experts that hold 11 data bytes for shape (3, 2, 2) of '|u1'"),
    (_npy_raw("__import__('os')", b""), None, "a P/D leg sent routed experts that have a .npy header that does not parse"),
    (_npy_b64(np.zeros((3, BIG // 3 + 1), np.uint8)), None,
     f"a P/D leg sent routed experts that have {3 * (BIG // 3 + 1)} elements, over {BIG}"),
    (_npy_b64(np.zeros((3, (32 << 20) // 24 + 1), np.int64)), None,
     "a P/D leg sent routed experts that are over 33554432 bytes"),
    (_npy_b64(_rows(4)), None, "the prefill leg sent 4 routed-expert rows for a prompt of 3 tokens"),
    (_npy_b64(_rows(3)), _npy_b64(_rows(2, dtype=np.int32)),
     "prefill and decode legs sent routed experts of different dtypes ('|u1', '<i4')"),
    (_npy_b64(_rows(3)), _npy_b64(_rows(2, trailing=(2, 3))),
     "prefill and decode legs sent routed experts of different trailing shapes ((2, 2), (2, 3))"),
    (_npy_b64(_rows(3)), _npy_b64(_rows(3)), "the decode leg sent 3 routed-expert rows for 3 output tokens"),
    (_npy_b64(_rows(3)), None, "the decode leg sent 0 routed-expert rows for 3 output tokens"),  # never partial
])
def test_codec_refuses_bad_vllm_expert_rows(pre, own, message):
    from asgi_generate.sdk._codec import RequestError

    ex, p, d = _legs(PROMPT3)
    ex.feed(p, _prefill_answer(pre))
    ex.worker_request(d)
    with pytest.raises(RequestError) as exc:
        ex.feed(d, _decode_answer([7, 8, 9], own))
    assert (exc.value.status, exc.value.message) == (502, message)


PL = [None, {"2": {"logprob": -1.25, "rank": 1, "decoded_token": None}},
      {"3": {"logprob": -0.5, "rank": 1, "decoded_token": None}}]


@pytest.mark.parametrize("pre,own,want", [
    (PL, None, PL),  # only the prefill leg computed the prompt
    (PL, PL, PL),  # both did, and agree
    (None, PL, PL),  # only the decode leg did (it prefilled alone)
    (None, None, None),
])
def test_codec_prompt_logprobs_from_the_leg_that_computed_them(pre, own, want):
    ex, p, d = _legs(PROMPT3)
    ex.feed(p, _prefill_answer(prompt_logprobs=pre))
    ex.worker_request(d)
    ex.feed(d, _decode_answer([7, 8], prompt_logprobs=own))
    assert orjson.loads(ex.unary_body()[1])["prompt_logprobs"] == want


def test_codec_prompt_logprobs_that_differ_fail():
    from asgi_generate.sdk._codec import RequestError

    ex, p, d = _legs(PROMPT3)
    ex.feed(p, _prefill_answer(prompt_logprobs=PL))
    ex.worker_request(d)
    with pytest.raises(RequestError) as exc:
        ex.feed(d, _decode_answer([7, 8], prompt_logprobs=[None, PL[1], {"3": {**PL[2]["3"], "rank": 2}}]))
    assert (exc.value.status, exc.value.message) == (502, "the prefill and decode legs answered different prompt_logprobs")
