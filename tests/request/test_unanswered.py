"""A worker that reads a request and closes the connection without
answering: the worker pool never sends that request again; the attempt loop
fails the request over under a new engine id (a pair: a new bootstrap room,
both legs anew), for an aggregated worker and each leg of either engine's
P/D pair. A health probe the same worker drops is retried once.

In process, the dropping worker is a loopback server behind a real
connection pool, on trio and asyncio, the other workers test_legs' scripted
pools; end to end, it is a recording proxy before a simulator, in front of
which a frontend of each worker class serves an aggregated fleet and an
SGLang P/D fleet.
"""

from __future__ import annotations

import itertools

import anyio
import httpx
import orjson
import pytest

from asgi_generate.request import handshakes
from asgi_generate.sdk import _ids as ids
from asgi_generate.workers.router import Router
from asgi_generate_sglang import SGLangCodec
from asgi_generate_vllm import VLLMCodec
from test_legs import (FIRST, KV, STALL, VLLM_BODY, VLLM_CHUNKS, VLLM_CLIENT, Client, FakePool, FakeResponse,
                       FakeRouter, answer, anyio_backend, sse, vllm_decode, vllm_prefill_answer, worker)
from support import DECODE, PREFILL, PROMPT, Traced, prefill_spec, sse as stream, start_sim
from scripted_worker import _response, _serve
from wire_proxy import WireProxy

__all__ = ["anyio_backend"]  # the fixture, imported for its trio and asyncio runs

#: What the dropping worker answers before it drops: a request that leaves
#: its connection idle in the pool, so the dropped request goes out on a
#: reused connection (the one a pool used to send again).
WARM = _response(b"{}")
STREAM = {"input_ids": [1, 2], "rid": "mine", "stream": True}
STREAMED = FIRST + (
    b'data: {"text":"","output_ids":[5,6],"meta_info":{"id":"mine","finish_reason":{"type":"stop"}}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.fixture
def fresh(monkeypatch):
    """Engine ids e0, e1, ... and bootstrap rooms 100, 101, ..."""
    engine_ids, rooms = itertools.count(), itertools.count(100)
    monkeypatch.setattr(ids, "mint", lambda: f"e{next(engine_ids)}")
    monkeypatch.setattr(handshakes.secrets, "randbits", lambda bits: next(rooms))


async def _dropping(tg, wid: str, protocol: str, role: str = "aggregated"):
    """A worker that answers one request, then reads the next and closes;
    that first request is sent, so the next one reuses its connection."""
    server, pool = await _serve(tg, [WARM, None])
    async with pool.request(b"POST", b"/warm", b'{"warm": true}') as resp:
        await resp.read()
    assert pool.idle == 1
    return server, worker(wid, protocol, pool, role)


def _received(server) -> list[dict]:
    """The JSON bodies the dropping worker read after the warm-up."""
    return [orjson.loads(body) for _, _, body in server.requests[1:]]


def _sglang_stream(*ids_: int, finish=None) -> FakePool:
    return FakePool(FakeResponse(200, [sse(answer(list(ids_), finish)), None]))


@pytest.mark.anyio
@pytest.mark.parametrize("up", [True, False], ids=["probe_up", "probe_down"])
async def test_aggregated_request_the_worker_dropped_fails_over_under_a_new_id(fresh, up):
    async with anyio.create_task_group() as tg:
        server, w0 = await _dropping(tg, "w0", "sglang")
        live = FakePool(FakeResponse(200, [sse(answer([5], None)), sse(answer([5, 6], {"type": "stop"})), None]))
        router = FakeRouter((w0,), (worker("w1", "sglang", live),), probe_up=up)
        client = Client(SGLangCodec(), STREAM, router)
        await client.run()
        tg.cancel_scope.cancel()
    assert _received(server) == [{**STREAM, "rid": "e0"}]
    assert [connection for connection, _, _ in server.requests] == [1, 1]
    assert (w0.pool.opened, w0.pool.retired) == (1, 1)
    assert [s[1]["rid"] for s in live.sent] == ["e1"]
    assert (client.status, client.body, client.st.status) == (200, STREAMED, "ok")
    assert client.attempts() == [("e0", "aggregated", "w0", "error" if up else "worker_lost", False),
                                 ("e1", "aggregated", "w1", "finished", False)]
    assert router.probed == ["w0"]
    assert client.aborts == [("w0", "e0")]  # it may have the request


@pytest.mark.anyio
async def test_aggregated_request_the_only_worker_dropped_is_a_502_not_a_resend(fresh):
    async with anyio.create_task_group() as tg:
        server, w0 = await _dropping(tg, "w0", "sglang")
        client = Client(SGLangCodec(), STREAM, FakeRouter((w0,)))
        await client.run()
        tg.cancel_scope.cancel()
    assert _received(server) == [{**STREAM, "rid": "e0"}]
    assert (client.status, client.st.status, client.st.http_status) == (502, "engine_error", 502)
    assert orjson.loads(client.body) == {
        "object": "error", "type": "502", "param": None, "code": 502,
        "message": "worker w0 failed: worker closed the connection before answering "
                   "(migration impossible: no worker left to resume on)"}
    assert client.attempts() == [("e0", "aggregated", "w0", "error", False)]
    assert client.aborts == [("w0", "e0")]


SGLANG_BOOTSTRAP = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}


@pytest.mark.anyio
@pytest.mark.parametrize("dropped", ["prefill", "decode"])
async def test_sglang_pair_leg_the_worker_dropped_runs_anew_on_another_pair(fresh, dropped):
    async with anyio.create_task_group() as tg:
        server, gone = await _dropping(tg, "w0" if dropped == "prefill" else "w1", "sglang", dropped)
        other = worker("w1", "sglang", FakePool(STALL), "decode") if dropped == "prefill" else worker(
            "w0", "sglang", FakePool(STALL), "prefill")
        first = (gone, other) if dropped == "prefill" else (other, gone)
        p1 = _sglang_stream(9, finish={"type": "length", "length": 1})
        d1 = FakePool(FakeResponse(200, [sse(answer([5], None)), sse(answer([5, 6], {"type": "stop"})), None]))
        second = (worker("w2", "sglang", p1, "prefill"), worker("w3", "sglang", d1, "decode"))
        client = Client(SGLangCodec(), STREAM, FakeRouter(first, second))
        await client.run()
        tg.cancel_scope.cancel()
    sent = {"prefill": {**STREAM, "rid": "e0", **SGLANG_BOOTSTRAP, "bootstrap_room": 100},
            "decode": {**STREAM, "rid": "e1", **SGLANG_BOOTSTRAP, "bootstrap_room": 100}}
    assert _received(server) == [sent[dropped]]
    assert [s[1] for s in p1.sent + d1.sent] == [
        {**STREAM, "rid": rid, **SGLANG_BOOTSTRAP, "bootstrap_room": 101} for rid in ("e2", "e3")]
    assert (client.status, client.body, client.st.status) == (200, STREAMED, "ok")
    assert client.attempts() == [
        ("e0", "prefill", "w0", "error" if dropped == "prefill" else "aborted", False),
        ("e1", "decode", "w1", "error" if dropped == "decode" else "aborted", False),
        ("e2", "prefill", "w2", "finished", False), ("e3", "decode", "w3", "finished", False),
    ]
    assert sorted(client.aborts) == [("w0", "e0"), ("w1", "e1")]  # both legs, before the next pair
    assert handshakes._live_rooms == set()


@pytest.mark.anyio
@pytest.mark.parametrize("dropped", ["prefill", "decode"])
async def test_vllm_pair_leg_the_worker_dropped_runs_anew_on_another_pair(fresh, dropped):
    async with anyio.create_task_group() as tg:
        if dropped == "prefill":
            server, p0 = await _dropping(tg, "w0", "vllm", "prefill")
            d0 = worker("w1", "vllm", FakePool(), "decode")
        else:
            p0 = worker("w0", "vllm", FakePool(FakeResponse(200, [vllm_prefill_answer(KV)])), "prefill")
            server, d0 = await _dropping(tg, "w1", "vllm", "decode")
        p1 = FakePool(FakeResponse(200, [vllm_prefill_answer(KV)]))
        d1 = vllm_decode(*VLLM_CHUNKS)
        second = (worker("w2", "vllm", p1, "prefill"), worker("w3", "vllm", d1, "decode"))
        client = Client(VLLMCodec(), VLLM_BODY, FakeRouter((p0, d0), second))
        await client.run()
        tg.cancel_scope.cancel()
    # The engine id rides in X-Request-Id alone; the body is the client's.
    assert [body.get("request_id") for body in _received(server)] == [None]
    assert [dict(s[2])[b"x-request-id"] for s in p1.sent + d1.sent] == [b"e1", b"e1"]
    assert (client.status, client.body, client.st.status) == (200, VLLM_CLIENT, "ok")
    first_pair = ([("e0", "prefill", "w0", "error", False)] if dropped == "prefill" else
                  [("e0", "prefill", "w0", "finished", False), ("e0", "decode", "w1", "error", False)])
    assert client.attempts() == [*first_pair, ("e1", "prefill", "w2", "finished", False),
                                 ("e1", "decode", "w3", "finished", False)]
    assert client.aborts == [("w0" if dropped == "prefill" else "w1", "e0")]


@pytest.mark.anyio
async def test_a_health_probe_the_worker_dropped_is_retried_once():
    async with anyio.create_task_group() as tg:
        ok = _response(b"")
        server, pool = await _serve(tg, [ok, None, ok])
        router = Router([("sglang", f"http://127.0.0.1:{pool.port}")])
        (w,) = router.workers
        w.healthy = True  # up: a probe reads the health route alone
        assert (await router.probe(w), await router.probe(w)) == (True, True)
        await router.aclose()
        tg.cancel_scope.cancel()
    assert server.requests == [(1, b"GET /health HTTP/1.1", b""), (1, b"GET /health HTTP/1.1", b""),
                               (2, b"GET /health HTTP/1.1", b"")]
    assert (w.probe_pool.opened, w.probe_pool.retired, w.healthy, w.failures) == (2, 1, True, 0)


# -- end to end ----------------------------------------------------------------------

FLEET_BODY = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 4}}


def _second_generate(proxy_of):
    """A ``drop`` hook: the second ``/generate`` the proxy sees (the first
    left its connection idle in the frontend's pool)."""
    return lambda seen: seen.path == "/generate" and len(proxy_of().requests("/generate")) == 2


def _until_dropped(fe: Traced, proxy: WireProxy) -> list[dict]:
    """Stream :data:`FLEET_BODY` through ``fe`` until the proxy dropped a
    request (at most 8 requests); every answer is the same; their records."""
    answers = set()
    sent = 0
    while len(proxy.requests("/generate")) < 2:
        assert sent < 8, "the proxy's worker was not given two requests"
        status, events = stream(fe.url, FLEET_BODY)
        assert status == 200 and events[-1] == b"[DONE]"
        answers.add(tuple(tuple(orjson.loads(e)["output_ids"]) for e in events[:-1]))
        sent += 1
    assert len(answers) == 1
    return fe.take(sent)


def _legs(rec: dict) -> list[tuple]:
    return [(a["role"], a["worker_id"], a["outcome"], a.get("abort_acked")) for a in rec["attempts"]]


def _dropped_record(recs: list[dict], proxy: WireProxy) -> tuple[str, dict]:
    """The engine id the proxy dropped, sent exactly once, and its request's record."""
    rids = [s.body["rid"] for s in proxy.requests("/generate")]
    dropped = rids[1]
    assert len(set(rids)) == len(rids) == 2  # never sent again
    (rec,) = [r for r in recs if dropped in {a["engine_id"] for a in r["attempts"]}]
    assert rec["status"] == "ok"
    ids_ = [a["engine_id"] for a in rec["attempts"]]
    assert len(set(ids_)) == len(ids_)  # every leg under its own id
    assert [s.body["rid"] for s in proxy.requests("/abort_request")] == [dropped]  # it may have it
    return dropped, rec


@pytest.mark.e2e
@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_fleet_fails_a_stream_the_worker_dropped_over_to_another_worker(tmp_path_factory, worker_class):
    a, b = start_sim(), start_sim()
    proxy = WireProxy(a.url, drop=_second_generate(lambda: proxy))
    fe = Traced(tmp_path_factory, ["--worker", f"sglang={proxy.url}", "--worker", f"sglang={b.url}"], worker_class)
    try:
        dropped, rec = _dropped_record(_until_dropped(fe, proxy), proxy)
        assert rec["attempts"][0]["engine_id"] == dropped
        assert _legs(rec) == [("aggregated", "w0", "error", True), ("aggregated", "w1", "finished", None)]
        states = {w["id"]: w["state"] for w in httpx.get(fe.url + "/v1/models", timeout=5).json()["workers"]}
        assert states == {"w0": "up", "w1": "up"}  # slow is not dead, nor is a dropped connection
    finally:
        fe.stop()
        proxy.stop()
        a.stop()
        b.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
@pytest.mark.parametrize("dropped_leg", ["prefill", "decode"])
def test_sglang_fleet_runs_a_pair_whose_leg_the_worker_dropped_anew(tmp_path_factory, worker_class, dropped_leg):
    """Two prefill and one decode worker, or one prefill and two decode
    workers; the first of the doubled role drops its second request."""
    timeout = ["--disaggregation-timeout-s", "30"]
    if dropped_leg == "prefill":
        sims = [start_sim(extra=[*PREFILL, *timeout]), start_sim(extra=[*PREFILL, *timeout]),
                start_sim(extra=[*DECODE, *timeout])]
        proxy = WireProxy(sims[0].url, drop=_second_generate(lambda: proxy))
        port = prefill_spec(sims[0]).rsplit("=", 1)[1]
        args = ["--prefill", f"sglang={proxy.url}?bootstrap_port={port}", "--prefill", prefill_spec(sims[1]),
                "--decode", f"sglang={sims[2].url}"]
        legs = [("prefill", "w0", "error", True), ("decode", "w2", "aborted", True),
                ("prefill", "w1", "finished", None), ("decode", "w2", "finished", None)]
    else:
        sims = [start_sim(extra=[*PREFILL, *timeout]), start_sim(extra=[*DECODE, *timeout]),
                start_sim(extra=[*DECODE, *timeout])]
        proxy = WireProxy(sims[1].url, drop=_second_generate(lambda: proxy))
        args = ["--prefill", prefill_spec(sims[0]), "--decode", f"sglang={proxy.url}",
                "--decode", f"sglang={sims[2].url}"]
        legs = [("prefill", "w0", "aborted", True), ("decode", "w1", "error", True),
                ("prefill", "w0", "finished", None), ("decode", "w2", "finished", None)]
    fe = Traced(tmp_path_factory, ["--disaggregation", "always", *args], worker_class)
    try:
        dropped, rec = _dropped_record(_until_dropped(fe, proxy), proxy)
        assert _legs(rec) == legs
        assert rec["attempts"][0 if dropped_leg == "prefill" else 1]["engine_id"] == dropped
    finally:
        fe.stop()
        proxy.stop()
        for sim in sims:
            sim.stop()
