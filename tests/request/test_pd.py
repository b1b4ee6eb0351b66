"""Prefill/decode disaggregation: a P/D answer is the aggregated answer.

A prefill simulator and a decode simulator exchange the KV over loopback (the
decode waits for the room the frontend minted); an aggregated simulator
answers the same request directly, and the two answers must agree value for
value (bar the timing field and the id, which the frontend restores). Then the
failure paths: a client that leaves at each phase, a prefill worker that is
gone, a prefill that fails, a decode that never gets its KV.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor


import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import (
    DECODE,
    PREFILL,
    PROMPT,
    RawClient,
    post,
    same,
    sse,
    start_frontend,
    start_sim,
    stats,
    Traced,
    prefill_spec,
    vnorm,
    wait_until,
    without_timing,
)

from wire_proxy import WireProxy

from asgi_generate.config import Settings
from asgi_generate.request.handshakes import bootstrap_host, mint_room
from asgi_generate.workers.router import Router
from asgi_generate.worker_specs import parse_worker_spec

# -- configuration and planning ------------------------------------------------


def test_worker_roles_from_flags_and_environment():
    s = Settings.from_env({
        "ASGI_GENERATE_PREFILL": "sglang=http://10.0.0.5:30000?bootstrap_port=9000,sglang=http://[::1]:30001",
        "ASGI_GENERATE_DECODE": "sglang=http://10.0.0.6:30002",
        "ASGI_GENERATE_DISAGGREGATION": "always",
    })
    assert s.prefill == [("sglang", "http://10.0.0.5:30000?bootstrap_port=9000"), ("sglang", "http://[::1]:30001")]
    assert s.decode == [("sglang", "http://10.0.0.6:30002")] and s.disaggregation == "always"
    assert Settings.from_env(s.to_env()) == s
    r = Router([], prefill=s.prefill, decode=s.decode)
    assert [(w.id, w.role, w.url, w.bootstrap_port) for w in r.workers] == [
        ("w0", "prefill", "http://10.0.0.5:30000", 9000), ("w1", "prefill", "http://[::1]:30001", 8998),
        ("w2", "decode", "http://10.0.0.6:30002", None)]
    assert [bootstrap_host(w) for w in r.workers[:2]] == ["10.0.0.5", "[::1]"]
    with pytest.raises(ValueError) as exc:
        Settings(disaggregation="sometimes").check()
    assert str(exc.value) == ("--disaggregation (ASGI_GENERATE_DISAGGREGATION) must be one of auto, always, "
                              "never, not 'sometimes'")


@pytest.mark.parametrize("spec,role,error", [
    ("sglang=http://h:1?bootstrap_port=9", "decode",
     "worker 'sglang=http://h:1?bootstrap_port=9': only an sglang prefill worker takes a query (?bootstrap_port=B)"),
    ("sglang=http://h:1?bootstrap_port=x", "prefill",
     "worker 'sglang=http://h:1?bootstrap_port=x': bootstrap_port must be a port number, not 'x'"),
    ("sglang=http://h:1?port=9", "prefill",
     "worker 'sglang=http://h:1?port=9': only an sglang prefill worker takes a query (?bootstrap_port=B)"),
])
def test_bad_pd_worker_specs(spec, role, error):
    with pytest.raises(ValueError) as exc:
        parse_worker_spec(spec, role)
    assert str(exc.value) == error


def test_plan_picks_each_role_by_least_outstanding():
    r = Router([("sglang", "http://127.0.0.1:1")],
               prefill=[("sglang", "http://127.0.0.1:2"), ("sglang", "http://127.0.0.1:3")],
               decode=[("sglang", "http://127.0.0.1:4")])
    agg, p1, p2, d = r.workers
    for w in r.workers:
        w.healthy = True
    assert r.plan("sglang") == (p1, d)
    assert r.plan("sglang") == (p2, d)  # ties round-robin
    p2.inflight.add(object())
    assert r.plan("sglang") == (p1, d)
    assert r.plan("sglang", [p1]) == (p2, d)
    assert r.plan("sglang", [p1, p2]) == (agg,)  # auto: no pair left, aggregated
    d.healthy = False
    assert r.plan("sglang") == (agg,)
    r.disaggregation = "always"
    assert r.plan("sglang") is None
    d.healthy = True
    r.disaggregation = "never"
    assert r.plan("sglang") == (agg,)
    assert r.plan("vllm") is None


def test_rooms_are_random_and_below_2_to_the_63():
    rooms = {mint_room() for _ in range(2000)}
    assert len(rooms) == 2000 and all(0 <= x < 1 << 63 for x in rooms)
    assert max(rooms) > 1 << 60
class Fleet(Traced):
    """A frontend with ``--trace-file`` in front of SGLang P/D simulators."""

    def __init__(self, tmp_path_factory, prefills, decodes, worker_class="trio", extra=()) -> None:
        args = ["--disaggregation", "always", *extra]
        for p in prefills:
            args += ["--prefill", prefill_spec(p)]
        for d in decodes:
            args += ["--decode", f"sglang={d.url}"]
        super().__init__(tmp_path_factory, args, worker_class)


@pytest.fixture(scope="module")
def sims():
    """A prefill simulator, a cumulative and an incremental decode
    simulator, and the aggregated simulators to compare with."""
    procs = {
        "prefill": start_sim(extra=PREFILL),
        "decode": start_sim(extra=DECODE),
        "decode_inc": start_sim(incremental=True, extra=DECODE),
        "agg": start_sim(),
        "agg_inc": start_sim(incremental=True),
    }
    yield procs
    for p in procs.values():
        p.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fronts(request, sims, tmp_path_factory):
    """(cumulative, incremental) P/D frontends on one worker class."""
    cum = Fleet(tmp_path_factory, [sims["prefill"]], [sims["decode"]], request.param)
    inc = Fleet(tmp_path_factory, [sims["prefill"]], [sims["decode_inc"]], request.param)
    yield cum, inc
    cum.stop()
    inc.stop()


def _unid(obj: dict, rid: str) -> dict:
    """``obj`` (an SGLang answer) with ``meta_info.id`` set to ``rid``."""
    return {**obj, "meta_info": {**obj["meta_info"], "id": rid}}


def _events(raw: list[bytes]) -> list:
    return [e if e == b"[DONE]" else without_timing(orjson.loads(e)) for e in raw]


BODIES = {
    "plain": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}},
    "logprobs": {"input_ids": [5, 9, 77, 300, 12], "sampling_params": {"max_new_tokens": 6},
                 "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
                 "token_ids_logprob": [7, 8], "return_text_in_logprobs": True},
    "logprobs_output_only": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5},
                             "return_logprob": True, "top_logprobs_num": 2},
    "one_token": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1},
                  "return_logprob": True, "logprob_start_len": 1},
    "one_token_plain": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}},
    "one_token_prompt": {"input_ids": [42], "sampling_params": {"max_new_tokens": 4},
                         "return_logprob": True, "logprob_start_len": 0},
    "stop_on_first": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [2358]},
                      "return_logprob": True},
    "text": {"text": "Hello there", "rid": "client-7", "sampling_params": {"max_new_tokens": 6}},
    "experts": {"input_ids": [5, 9, 77, 300, 12], "sampling_params": {"max_new_tokens": 6},
                "return_routed_experts": True},
    "experts_from": {"input_ids": [5, 9, 77, 300, 12], "sampling_params": {"max_new_tokens": 3},
                     "return_routed_experts": True, "routed_experts_start_len": 5},
    "experts_one_token": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1},
                          "return_routed_experts": True, "return_logprob": True},
    "experts_one_token_plain": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1},
                                "return_routed_experts": True},
    "experts_stop_on_first": {"input_ids": [7], "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [100]},
                              "return_routed_experts": True, "return_logprob": True},
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(BODIES))
def test_unary_is_the_aggregated_answer(fronts, sims, name):
    cum, _ = fronts
    body = BODIES[name]
    got = post(cum.url, body)
    want = post(sims["agg"].url, body)
    assert got.status_code == want.status_code == 200
    g = got.json()
    same(without_timing(g), without_timing(_unid(want.json(), g["meta_info"]["id"])))
    if "rid" in body:
        assert g["meta_info"]["id"] == body["rid"]
    (rec,) = cum.take()
    assert rec["status"] == "ok"
    assert rec["output_tokens"] == len(g["output_ids"])
    assert rec["input_tokens"] == g["meta_info"]["prompt_tokens"]
    assert [(a["role"], a["outcome"]) for a in rec["attempts"]] == [("prefill", "finished"), ("decode", "finished")]
    assert rec["finish"]["backend_finish_reason"] == g["meta_info"]["finish_reason"]["type"]


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(BODIES))
@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_sse_is_the_aggregated_stream(fronts, sims, name, incremental):
    cum, inc = fronts
    fe = inc if incremental else cum
    body = {**BODIES[name], "stream": True}
    status, got = sse(fe.url, body)
    _, want = sse(sims["agg_inc" if incremental else "agg"].url, body)
    assert status == 200 and got[-1] == b"[DONE]"
    rid = orjson.loads(got[0])["meta_info"]["id"]
    same(_events(got), [e if e == b"[DONE]" else _unid(e, rid) for e in _events(want)])
    (rec,) = fe.take()
    ids = [t for e in got[:-1] for t in orjson.loads(e)["output_ids"]] if incremental else \
        orjson.loads(got[-2])["output_ids"]
    assert rec["status"] == "ok" and rec["output_tokens"] == len(ids)


@pytest.mark.e2e
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(10, 4000), min_size=1, max_size=12),
    max_new=st.integers(1, 12),
    start=st.integers(-1, 0),
    top=st.integers(0, 3),
    stream=st.booleans(),
    stop=st.lists(st.integers(10, 4000), max_size=3),
    experts=st.booleans(),
)
def test_property_pd_equals_aggregated(fronts, sims, prompt, max_new, start, top, stream, stop, experts):
    cum, _ = fronts
    body = {"input_ids": prompt, "stream": stream, "return_logprob": True, "logprob_start_len": start,
            "top_logprobs_num": top, "return_routed_experts": experts,
            "sampling_params": {"max_new_tokens": max_new, "stop_token_ids": stop}}
    if stream:
        _, got = sse(cum.url, body)
        _, want = sse(sims["agg"].url, body)
        rid = orjson.loads(got[0])["meta_info"]["id"]
        same(_events(got), [e if e == b"[DONE]" else _unid(e, rid) for e in _events(want)])
    else:
        g = post(cum.url, body).json()
        same(without_timing(g), without_timing(_unid(post(sims["agg"].url, body).json(), g["meta_info"]["id"])))
    cum.take()


@pytest.mark.e2e
@pytest.mark.parametrize("field,value", [
    ("bootstrap_room", 7), ("bootstrap_host", "10.0.0.1"), ("bootstrap_port", 8998), ("bootstrap_pair_key", "k"),
])
def test_client_bootstrap_fields_are_refused(fronts, sims, field, value):
    cum, _ = fronts
    before = stats(sims["prefill"])["received"], stats(sims["decode"])["received"]
    r = post(cum.url, {"input_ids": PROMPT, field: value})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": f"{field} is set by the frontend for prefill/decode routing; "
                                             "do not send it."}}
    assert (stats(sims["prefill"])["received"], stats(sims["decode"])["received"]) == before
    (rec,) = cum.take()
    assert rec["status"] == "rejected" and rec["attempts"] == []


@pytest.mark.e2e
def test_models_and_stats_show_roles(fronts, sims):
    cum, _ = fronts
    workers = httpx.get(cum.url + "/v1/models", timeout=5).json()["workers"]
    assert [(w["role"], w["url"]) for w in workers] == [("prefill", sims["prefill"].url),
                                                        ("decode", sims["decode"].url)]
    assert workers[0]["bootstrap_port"] == httpx.get(sims["prefill"].url + "/get_server_info").json()[
        "disaggregation_bootstrap_port"]
    assert "bootstrap_port" not in workers[1]
    assert [w["role"] for w in httpx.get(cum.url + "/stats", timeout=5).json()["workers"].values()] == [
        "prefill", "decode"]


# -- failures -----------------------------------------------------------------


def _clean(*sims_) -> None:
    """Nothing running, no room waiting, on every simulator."""
    for s in sims_:
        wait_until(lambda s=s: (x := stats(s))["running"] == 0 and x["rooms_waiting"] == 0, timeout=3)


@pytest.fixture(scope="module")
def slow_pair():
    """A prefill that takes 1.5 s to prefill and a decode at 50 ms per token;
    their KV waits time out after 2 s."""
    p = start_sim(ttft_ms=1500, extra=[*PREFILL, "--disaggregation-timeout-s", "2"])
    d = start_sim(itl_ms=50, extra=[*DECODE, "--disaggregation-timeout-s", "2"])
    yield p, d
    p.stop()
    d.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def slow_front(request, slow_pair, tmp_path_factory):
    fe = Fleet(tmp_path_factory, [slow_pair[0]], [slow_pair[1]], request.param)
    yield fe
    fe.stop()


def _legs(p, d):
    """The one running engine id on each of the prefill and decode sims."""
    return wait_until(lambda: (a := stats(p)["running_rids"]) and (b := stats(d)["running_rids"]) and (a[0], b[0]))


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
def test_disconnect_while_the_prefill_is_pending(slow_front, slow_pair, stream):
    p, d = slow_pair
    c = RawClient(slow_front.url)
    c.send(orjson.dumps({"input_ids": PROMPT, "stream": stream, "sampling_params": {"max_new_tokens": 20}}))
    p_rid, d_rid = _legs(p, d)
    wait_until(lambda: stats(d)["rooms_waiting"] == 1)
    c.close()
    wait_until(lambda: p_rid in stats(p)["aborted_rids"] and d_rid in stats(d)["aborted_rids"], timeout=3)
    _clean(p, d)
    (rec,) = slow_front.take()
    assert rec["status"] == "client_disconnect" and rec["output_tokens"] == 0
    assert [(a["role"], a["engine_id"], a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [
        ("prefill", p_rid, "aborted", True), ("decode", d_rid, "aborted", True)]


@pytest.mark.e2e
def test_disconnect_during_decode(slow_front, slow_pair):
    p, d = slow_pair
    c = RawClient(slow_front.url)
    c.send(orjson.dumps({"input_ids": PROMPT, "stream": True,
                         "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}))
    p_rid, d_rid = _legs(p, d)
    got = c.events(3)
    assert [len(orjson.loads(e)["output_ids"]) for e in got] == [1, 2, 3]
    c.close()
    wait_until(lambda: d_rid in stats(d)["aborted_rids"], timeout=3)
    _clean(p, d)
    assert p_rid not in stats(p)["aborted_rids"]  # it had answered: nothing to abort
    (rec,) = slow_front.take()
    assert rec["status"] == "client_disconnect" and 3 <= rec["output_tokens"] < 40
    assert [(a["role"], a["outcome"], a.get("abort_acked")) for a in rec["attempts"]] == [
        ("prefill", "finished", None), ("decode", "aborted", True)]


@pytest.mark.e2e
def test_decode_that_never_gets_its_kv(tmp_path_factory):
    """The prefill worker stalls (its TTFT is past the decode's wait): the
    decode gives up with SGLang's transfer abort, which the client gets as
    the engine gives it; the prefill leg is aborted."""
    p = start_sim(ttft_ms=4000, extra=[*PREFILL, "--disaggregation-timeout-s", "10"])
    d = start_sim(extra=[*DECODE, "--disaggregation-timeout-s", "0.5"])
    fe = Fleet(tmp_path_factory, [p], [d])
    try:
        r = post(fe.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 500
        body = r.json()
        assert body["object"] == "error" and body["code"] == 500 and body["type"] == "500"
        assert body["message"].startswith("Decode transfer failed for request rank=0 decode_req.req.rid=")
        assert body["message"].endswith("s in KVPoll.WaitingForInput")
        (rec,) = fe.take()
        assert rec["status"] == "engine_error" and rec["http_status"] == 500
        assert [(a["role"], a["outcome"], a.get("abort_acked")) for a in rec["attempts"]] == [
            ("prefill", "aborted", True), ("decode", "error", None)]
        _clean(p, d)
        assert stats(d)["transfer_timeouts"] == 1
    finally:
        fe.stop()
        p.stop()
        d.stop()


@pytest.mark.e2e
def test_prefill_answering_an_error_fails_the_pair(tmp_path_factory):
    """The prefill engine aborts the request (503): the client gets that
    error, the decode leg waiting for the KV is aborted."""
    p = start_sim(extra=[*PREFILL, "--abort-after", "1", "--abort-status", "503"])
    d = start_sim(extra=DECODE)
    fe = Fleet(tmp_path_factory, [p], [d])
    try:
        r = post(fe.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 503
        assert r.json()["message"] == "simulated abort after 1 tokens (sim --abort-after)"
        (rec,) = fe.take()
        assert rec["status"] == "engine_error"
        assert [(a["role"], a["outcome"], a.get("abort_acked")) for a in rec["attempts"]] == [
            ("prefill", "error", None), ("decode", "aborted", True)]
        assert len(stats(d)["aborted_rids"]) == 1
        _clean(p, d)
    finally:
        fe.stop()
        p.stop()
        d.stop()


#: A request the failure tests send, and compare with the aggregated answer.
FAILOVER = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}, "return_logprob": True}


def _aggregated_answer(fe, agg, answer: dict, legs: list[tuple]) -> dict:
    """Check that ``answer`` (to :data:`FAILOVER`) is ``agg``'s, and that
    its record is ``ok`` with ``legs`` (role, worker, outcome, abort
    acknowledged); return the record."""
    same(without_timing(answer), without_timing(_unid(post(agg.url, FAILOVER).json(), answer["meta_info"]["id"])))
    (rec,) = fe.take()
    assert rec["status"] == "ok"
    assert [(a["role"], a["worker_id"], a["outcome"], a.get("abort_acked")) for a in rec["attempts"]] == legs
    return rec


@pytest.mark.e2e
def test_prefill_worker_down_goes_to_another_pair(sims, tmp_path_factory):
    """Two prefill workers; the first is gone (the router has not noticed:
    its probes are far apart). The request runs on the other pair with a new
    room; the first pair's decode leg is aborted. With no prefill left, the
    format's 503."""
    p1, p2, d = start_sim(extra=PREFILL), start_sim(extra=PREFILL), start_sim(extra=DECODE)
    fe = Fleet(tmp_path_factory, [p1, p2], [d], extra=["--health-interval", "60"])
    try:
        p1.stop()
        rec = _aggregated_answer(fe, sims["agg"], post(fe.url, FAILOVER).json(), [
            ("prefill", "w0", "connect_failed", None), ("decode", "w2", "aborted", True),
            ("prefill", "w1", "finished", None), ("decode", "w2", "finished", None)])
        assert stats(d)["aborted_rids"] == [rec["attempts"][1]["engine_id"]]
        p2.stop()
        r = post(fe.url, FAILOVER)
        assert r.status_code == 503
        assert r.json()["message"] == "no healthy worker for protocol 'sglang'"
        (rec,) = fe.take()
        assert [(a["role"], a["outcome"], a.get("abort_acked")) for a in rec["attempts"]] == [
            ("prefill", "connect_failed", None), ("decode", "aborted", True)]
        _clean(d)
        states = {w["id"]: w["state"] for w in httpx.get(fe.url + "/v1/models").json()["workers"]}
        assert states == {"w0": "down", "w1": "down", "w2": "up"}
    finally:
        fe.stop()
        for s in (p1, p2, d):
            s.stop()


@pytest.mark.e2e
def test_sglang_wire_audit_of_every_prefill_and_decode_body(sims, tmp_path_factory):
    """A recording proxy before each worker: both legs get the client's body
    with their own minted rid (the client's never) and the same bootstrap
    host, port and room; every pair's room is its own and below 2^63."""
    port = httpx.get(sims["prefill"].url + "/get_server_info", timeout=5).json()["disaggregation_bootstrap_port"]
    pp, dp = WireProxy(sims["prefill"].url), WireProxy(sims["decode"].url)
    fe = Traced(tmp_path_factory, ["--disaggregation", "always", "--prefill", f"sglang={pp.url}?bootstrap_port={port}",
                                   "--decode", f"sglang={dp.url}"])
    try:
        clients = [
            {"input_ids": PROMPT, "rid": "mine", "stream": True, "sampling_params": {"max_new_tokens": 5},
             "return_logprob": True, "top_logprobs_num": 2},
            {"text": "Hello there", "sampling_params": {"max_new_tokens": 3, "stop_token_ids": [7]},
             "return_routed_experts": True, "custom_field": [1]},
        ]
        for body in clients * 3:
            if body.get("stream"):
                assert sse(fe.url, body)[0] == 200
            else:
                assert post(fe.url, body).status_code == 200
        recs = fe.take(6)
        pre, dec = pp.requests("/generate"), dp.requests("/generate")
        assert len(pre) == len(dec) == 6
        rooms = []
        for body, rec, p, d in zip(clients * 3, recs, pre, dec):
            p_id, d_id = [a["engine_id"] for a in rec["attempts"]]
            room = p.body["bootstrap_room"]
            assert type(room) is int and 0 <= room < 1 << 63
            bootstrap = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
            assert p.body == {**body, "rid": p_id, **bootstrap}
            assert d.body == {**body, "rid": d_id, **bootstrap}
            assert p_id != d_id and "mine" not in (p_id, d_id)
            rooms.append(room)
        assert len(set(rooms)) == 6
        assert pp.forwarded == len(pp.seen) and dp.forwarded == len(dp.seen)
    finally:
        fe.stop()
        pp.stop()
        dp.stop()


@pytest.mark.e2e
def test_decode_worker_down_goes_to_another_pair(sims, tmp_path_factory):
    """The first pair's decode worker is gone: its prefill leg, waiting for
    a decode that never comes, is aborted, and a new pair with a new room
    answers."""
    p = start_sim(extra=[*PREFILL, "--disaggregation-timeout-s", "30"])
    d1, d2 = start_sim(extra=DECODE), start_sim(extra=DECODE)
    fe = Fleet(tmp_path_factory, [p], [d1, d2], extra=["--health-interval", "60"])
    try:
        d1.stop()
        rec = _aggregated_answer(fe, sims["agg"], post(fe.url, FAILOVER).json(), [
            ("prefill", "w0", "aborted", True), ("decode", "w1", "connect_failed", None),
            ("prefill", "w0", "finished", None), ("decode", "w2", "finished", None)])
        # The abort may reach the engine before the leg it names (the pair
        # failed at once); the leg, its client gone, then ends by itself.
        assert stats(p)["abort_named_ids"] == [rec["attempts"][0]["engine_id"]]
        wait_until(lambda: (x := stats(p))["running"] == 0 and x["rooms_waiting"] == 0, timeout=5)
        _clean(d2)
    finally:
        fe.stop()
        for s in (p, d1, d2):
            s.stop()


@pytest.mark.e2e
def test_prefill_worker_lost_to_the_health_probe_mid_request(sims, tmp_path_factory):
    """The prefill engine freezes mid-prefill (SIGSTOP): the health probe
    gives it up; the pair's decode leg is aborted and a new pair answers."""
    p1 = start_sim(ttft_ms=1000, extra=PREFILL)
    p2, d = start_sim(extra=PREFILL), start_sim(extra=DECODE)
    fe = Fleet(tmp_path_factory, [p1, p2], [d], extra=["--health-timeout", "0.3", "--health-failures", "2"])
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, fe.url, FAILOVER)
            wait_until(lambda: stats(p1)["running"] == 1)
            p1.signal(signal.SIGSTOP)
            try:
                g = answer.result(20).json()
            finally:
                p1.signal(signal.SIGCONT)
        _aggregated_answer(fe, sims["agg"], g, [
            ("prefill", "w0", "worker_lost", False), ("decode", "w2", "aborted", True),
            ("prefill", "w1", "finished", None), ("decode", "w2", "finished", None)])
        _clean(p2, d)
    finally:
        fe.stop()
        for s in (p1, p2, d):
            s.stop()


GEN = "/inference/v1/generate"


@pytest.mark.e2e
def test_serve_embedded_pd_serves_pairs_of_both_protocols():
    """``serve --embedded-pd`` with no worker: a prefill and a decode
    simulator per protocol beside the aggregated ones; requests run as
    pairs and answer as the aggregated simulators do."""
    fe = start_frontend([], extra=["--embedded-pd", "--embedded-workers", "1"])
    try:
        workers = httpx.get(fe.url + "/v1/models", timeout=5).json()["workers"]
        assert [(w["protocol"], w["role"], w["state"]) for w in workers] == [
            ("sglang", "aggregated", "up"), ("vllm", "aggregated", "up"), ("sglang", "prefill", "up"),
            ("vllm", "prefill", "up"), ("sglang", "decode", "up"), ("vllm", "decode", "up")]
        assert workers[2]["bootstrap_port"] > 0 and "bootstrap_port" not in workers[3]
        agg = {w["protocol"]: w["url"] for w in workers if w["role"] == "aggregated"}
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}, "return_logprob": True}
        g = post(fe.url, body).json()
        vbody = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 5, "logprobs": 1}}
        v = post(fe.url, vbody, GEN).json()
        pairs = {w["id"] for w in workers if w["role"] != "aggregated"}
        # Each simulator's own count of generate requests, before the test's
        # own to the aggregated ones (the frontend's connections also carry
        # its fleet-state readings).
        served = {w["id"] for w in workers
                  if httpx.get(w["url"] + "/sim/stats", timeout=5).json()["received"] > 0}
        same(without_timing(g), without_timing(_unid(post(agg["sglang"], body).json(), g["meta_info"]["id"])))
        same(vnorm(v), vnorm(post(agg["vllm"], vbody, GEN).json()))
        assert served == pairs  # auto: pairs first, the aggregated workers idle
    finally:
        fe.stop()


# -- the SGLang codec's leg joins, sans-IO -----------------------------------------


def _legs_exchange(body: dict):
    from asgi_generate.sdk._codec import Attempt, Pair
    from asgi_generate_sglang import SGLangCodec

    codec = SGLangCodec()
    ex = codec.exchange(codec.decode(orjson.dumps(body), {}), "r" * 32)
    pair = Pair({"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 5})
    p = Attempt("a" * 32, "prefill", pair=pair)
    d = Attempt("b" * 32, "decode", pair=pair)
    wp, wd = ex.worker_request(p), ex.worker_request(d)
    for w, rid in ((wp, "a" * 32), (wd, "b" * 32)):
        sent = orjson.loads(w.body)
        assert (sent["rid"], sent["bootstrap_host"], sent["bootstrap_port"], sent["bootstrap_room"]) == (
            rid, "127.0.0.1", 8998, 5)
    return ex, p, d


def _answer(ids, finish, experts=None, **meta) -> bytes:
    m = {"id": "x", "finish_reason": finish, "prompt_tokens": 1, "completion_tokens": len(ids), **meta}
    if experts is not None:
        m["routed_experts"] = experts
    m["e2e_latency"] = 0.1
    return orjson.dumps({"text": "", "output_ids": ids, "meta_info": m})


# int32 rows [1, 2], [3, 4] and [0, 0] (a decode's never-written prompt row)
ROW_A, ROW_B, ZERO_ROW = "AQAAAAIAAAA=", "AwAAAAQAAAA=", "AAAAAAAAAAA="


@pytest.mark.parametrize("decode_ids,finish,own,want", [
    ([7, 8], {"type": "length", "length": 2}, ROW_B, "AQAAAAIAAAADAAAABAAAAA=="),  # joined on the token axis
    ([7, 8], {"type": "length", "length": 2}, "AAAAAAAAAAADAAAABAAAAA==",  # every position: its output's
     "AQAAAAIAAAADAAAABAAAAA=="),
    ([7], {"type": "length", "length": 1}, None, ROW_A),  # one token: the prefill's rows are all of them
    ([7], {"type": "length", "length": 1}, ZERO_ROW, ROW_A),
    ([7], {"type": "abort", "message": "m", "status_code": 200, "err_type": None}, None, None),  # aborted
])
def test_codec_joins_expert_rows(decode_ids, finish, own, want):
    ex, p, d = _legs_exchange({"input_ids": [1], "return_routed_experts": True})
    ev = ex.feed(p, _answer([7], {"type": "length", "length": 0}, ROW_A))
    assert (ev.token_ids, ev.finish_reason, ev.error) == ([], "length", None)
    ex.feed(d, _answer(decode_ids, finish, own))
    meta = orjson.loads(ex.unary_body()[1])["meta_info"]
    assert meta.get("routed_experts") == want
    assert list(meta)[-1] == "e2e_latency"


@pytest.mark.parametrize("pre,own,dtype,message", [
    ("not base64!", ROW_B, None, "a P/D leg sent routed experts that are not base64 int32 rows"),
    (ROW_A, "AQID", None, "a P/D leg sent routed experts that are not base64 int32 rows"),
    (ROW_A, ROW_B, "int16", "prefill and decode legs sent routed experts of different dtypes"),
    (ROW_A, None, None, "a P/D leg sent routed experts that come to 0 rows from the decode leg for 1 output "
                        "positions after a prompt of 1 from 0"),  # incomplete: never partial
])
def test_codec_refuses_bad_expert_rows(pre, own, dtype, message):
    from asgi_generate.sdk._codec import RequestError

    ex, p, d = _legs_exchange({"input_ids": [1], "return_routed_experts": True})
    extra = {"routed_experts_dtype": dtype} if dtype else {}
    ex.feed(p, _answer([7], {"type": "length", "length": 0}, pre, **extra))
    with pytest.raises(RequestError) as exc:
        ex.feed(d, _answer([7, 8], {"type": "length", "length": 2}, own))
    assert (exc.value.status, exc.value.message) == (502, message)


def test_codec_prefill_abort_is_an_engine_error():
    ex, p, _ = _legs_exchange({"input_ids": [1, 2]})
    ev = ex.feed(p, _answer([], {"type": "abort", "message": "KV transfer failed", "status_code": 500,
                                 "err_type": None}))
    assert (ev.error.status, ev.error.message) == (500, "KV transfer failed")
