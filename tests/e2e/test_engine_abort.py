"""An answer the engine cut short by its own abort (a pause without hold:
SGLang ``/pause_generation`` ``mode: abort``, vLLM ``/pause?mode=abort``)
reaches the client as the engine sent it and is recorded ``engine_abort``,
not ``ok``: a GRPO loop that keeps ``status == "ok"`` drops the truncated
sample. Both engines, unary and SSE, both worker classes."""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest

from support import (RawClient, Traced, finish_type, post, sse, start_frontend, start_sim, stats, stream_answer,
                     wait_until)
from wire_proxy import WireProxy

pytestmark = pytest.mark.e2e

N = 2000
GENERATE = {"sglang": "/generate", "vllm": "/inference/v1/generate"}
MESSAGE = "the engine aborted the request (finish_reason abort): its output is truncated"


@pytest.fixture(scope="module")
def sims():
    procs = {"sglang": start_sim(itl_ms=10), "vllm": start_sim("vllm", itl_ms=10)}
    yield procs
    for p in procs.values():
        p.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fe(request, sims, tmp_path_factory):
    traced = Traced(tmp_path_factory, [arg for p, s in sims.items() for arg in ("--worker", f"{p}={s.url}")],
                    request.param)
    yield traced
    traced.stop()


def _body(engine: str, rid: str, stream: bool) -> dict:
    if engine == "sglang":
        return {"rid": rid, "input_ids": [1, 2, 3], "stream": stream,
                "sampling_params": {"max_new_tokens": N, "ignore_eos": True}}
    return {"request_id": rid, "token_ids": [1, 2, 3], "stream": stream,
            "sampling_params": {"max_tokens": N, "ignore_eos": True}}


def _finish(engine: str, stream: bool, got) -> tuple[object, int]:
    """The answer's finish reason and output token count."""
    ids, finish = stream_answer(engine, got[1] if stream else [got.content])
    return finish_type(finish), len(ids)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_pause_without_hold_ends_the_answer_as_engine_abort(sims, fe, engine, stream):
    sim = sims[engine]
    rid = f"cut-{engine}-{stream}"
    out: dict = {}

    def run() -> None:
        body = _body(engine, rid, stream)
        out["got"] = sse(fe.url, body, GENERATE[engine]) if stream else post(fe.url, body, GENERATE[engine])

    thread = threading.Thread(target=run)
    thread.start()
    try:
        # Mid-generation: some tokens out, far from the last.
        wait_until(lambda: [n >= 5 for n in stats(sim)["running_output_tokens"].values()] == [True], timeout=30)
        pause, resume = (("/pause_generation", "/continue_generation") if engine == "sglang"
                         else ("/pause?mode=abort", "/resume"))
        assert post(fe.url, {"mode": "abort"} if engine == "sglang" else {}, pause).status_code == 200
        thread.join(30)
        assert post(fe.url, {}, resume).status_code == 200
    finally:
        thread.join(30)
    got = out["got"]
    assert (got[0] if stream else got.status_code) == 200
    finish, tokens = _finish(engine, stream, got)
    assert finish == "abort" and 0 < tokens < N
    (rec,) = [r for r in fe.take() if r.get("public_id") == rid]
    assert (rec["status"], rec["http_status"], rec["error"], rec["output_tokens"], rec["finish"]) == (
        "engine_abort", 200, {"type": "engine_abort", "message": MESSAGE}, tokens,
        {"finish_reason": "abort", "backend_finish_reason": "abort"})


def _started(url: str, engine: str, rid: str, stream: bool) -> tuple[threading.Thread, dict]:
    """A request to ``url`` in a thread of its own; its answer lands in the
    returned dict's ``got``."""
    out: dict = {}

    def run() -> None:
        body = _body(engine, rid, stream)
        out["got"] = sse(url, body, GENERATE[engine]) if stream else post(url, body, GENERATE[engine])

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_vllm_abort_requests_by_id_then_all_ends_exactly_those_requests(sims, fe):
    vllm, sglang = sims["vllm"], sims["sglang"]
    named_before = len(stats(vllm)["abort_named_ids"])
    runs = {rid: _started(fe.url, engine, rid, stream) for rid, engine, stream in (
        ("va-cut", "vllm", True), ("va-keep", "vllm", False), ("sa-keep", "sglang", True))}
    try:
        wait_until(lambda: [n >= 5 for n in stats(vllm)["running_output_tokens"].values()] == [True, True]
                   and [n >= 5 for n in stats(sglang)["running_output_tokens"].values()] == [True], timeout=30)
        # By id: vLLM counts the ids named, known or not; an unknown one is ignored.
        got = post(fe.url, {"request_ids": ["va-cut", "nobody"]}, "/abort_requests")
        assert (got.status_code, got.json()) == (200, {"status": "aborted", "aborted": 2})
        runs["va-cut"][0].join(30)
        assert not runs["va-cut"][0].is_alive()
        assert runs["va-keep"][0].is_alive() and runs["sa-keep"][0].is_alive()
        assert len(stats(vllm)["running_rids"]) == 1
        # Empty: every vLLM request the frontend runs; SGLang's untouched.
        got = post(fe.url, {}, "/abort_requests")
        assert (got.status_code, got.json()) == (200, {"status": "aborted", "aborted": 1})
        runs["va-keep"][0].join(30)
        assert not runs["va-keep"][0].is_alive() and runs["sa-keep"][0].is_alive()
        assert stats(sglang)["running"] == 1
        assert post(fe.url, {"rid": "sa-keep"}, "/abort_request").status_code == 200
    finally:
        for thread, _ in runs.values():
            thread.join(30)
    # One abort per engine leg, each named once, by its prefixed engine id.
    named = stats(vllm)["abort_named_ids"][named_before:]
    assert len(named) == 2 and len(set(named)) == 2 and all(n.startswith("generate-tokens-") for n in named)
    results = {}
    for rid, (engine, stream) in {"va-cut": ("vllm", True), "va-keep": ("vllm", False),
                                  "sa-keep": ("sglang", True)}.items():
        got = runs[rid][1]["got"]
        assert (got[0] if stream else got.status_code) == 200
        finish, tokens = _finish(engine, stream, got)
        assert finish == "abort" and 0 < tokens < N, rid
        results[rid] = tokens
    recs = {r["public_id"]: r for r in fe.take(3)}
    for rid, tokens in results.items():
        rec = recs[rid]
        assert (rec["status"], rec["http_status"], rec["error"], rec["output_tokens"], rec["finish"]) == (
            "engine_abort", 200, {"type": "engine_abort", "message": MESSAGE}, tokens,
            {"finish_reason": "abort", "backend_finish_reason": "abort"}), rid


def test_vllm_abort_requests_refuses_what_vllm_refuses(fe):
    for content, detail in ((b"{", "Invalid JSON format"), (b"[1]", "Request body must be a JSON object")):
        got = httpx.post(fe.url + "/abort_requests", content=content)
        assert (got.status_code, got.json()) == (400, {"detail": detail})
    # Nothing running: an abort all aborts nothing, a named id is counted.
    assert post(fe.url, {"request_ids": []}, "/abort_requests").json() == {"status": "aborted", "aborted": 0}
    assert post(fe.url, {"request_ids": "x"}, "/abort_requests").json() == {"status": "aborted", "aborted": 1}


def _duplicates(url: str) -> int:
    """Aborts the frontend did not send again: their engine id's abort was
    queued, in flight or answered (``/stats``, every worker)."""
    workers = httpx.get(url + "/stats").json()["workers"].values()
    return sum(w.get("aborts", {}).get("duplicates", 0) for w in workers)


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_two_concurrent_abort_requests_send_the_engine_one_abort(sims, worker_class):
    sim = sims["sglang"]
    # The engine's abort answer is held until both calls reached the frontend.
    proxy = WireProxy(sim.url, hold=lambda seen: seen.path == "/abort_request")
    fe = start_frontend([f"sglang={proxy.url}"], worker_class=worker_class)
    named_before = len(stats(sim)["abort_named_ids"])
    rid = f"twice-{worker_class}"
    thread, out = _started(fe.url, "sglang", rid, True)
    calls: list = []
    try:
        wait_until(lambda: [n >= 5 for n in stats(sim)["running_output_tokens"].values()] == [True], timeout=30)
        (engine_id,) = stats(sim)["running_rids"]
        admin = [threading.Thread(target=lambda: calls.append(post(fe.url, {"rid": rid}, "/abort_request")))
                 for _ in range(2)]
        for t in admin:
            t.start()
        # Both calls in: the second joined the first (new), or a second abort went out (before).
        wait_until(lambda: len(proxy.requests("/abort_request")) == 2
                   or (len(proxy.requests("/abort_request")) == 1 and _duplicates(fe.url) == 1), timeout=30)
        proxy.release()
        for t in admin:
            t.join(30)
        thread.join(30)
        assert [(c.status_code, c.content) for c in calls] == [(200, b"")] * 2
        assert _finish("sglang", True, out["got"])[0] == "abort"
        assert [s.body for s in proxy.requests("/abort_request")] == [{"rid": engine_id}]
        assert stats(sim)["abort_named_ids"][named_before:] == [engine_id]
        assert _duplicates(fe.url) == 1
    finally:
        proxy.release()
        thread.join(30)
        fe.stop()
        proxy.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_disconnect_while_an_admin_abort_is_in_flight_sends_the_engine_one(sims, worker_class):
    """The client leaves while the admin abort of its request waits for the
    engine's answer: the disconnect's abort joins it, not a second one."""
    sim = sims["sglang"]
    proxy = WireProxy(sim.url, hold=lambda seen: seen.path == "/abort_request")
    # Patient aborts: the held one stays in flight until released.
    fe = start_frontend([f"sglang={proxy.url}"], worker_class=worker_class, extra=["--abort-timeout", "20"])
    named_before = len(stats(sim)["abort_named_ids"])
    rid = f"racing-{worker_class}"
    client = RawClient(fe.url)
    calls: list = []
    admin = None
    try:
        client.send(orjson.dumps(_body("sglang", rid, True)))
        wait_until(lambda: [n >= 3 for n in stats(sim)["running_output_tokens"].values()] == [True], timeout=30)
        (engine_id,) = stats(sim)["running_rids"]
        admin = threading.Thread(target=lambda: calls.append(post(fe.url, {"rid": rid}, "/abort_request")))
        admin.start()
        wait_until(lambda: len(proxy.requests("/abort_request")) == 1, timeout=30)  # in flight, unanswered
        client.close()
        # The disconnect's abort joined the first (new), or a second went out (before).
        wait_until(lambda: _duplicates(fe.url) == 1 or len(proxy.requests("/abort_request")) > 1, timeout=30)
        proxy.release()
        admin.join(30)
        wait_until(lambda: stats(sim)["running"] == 0)
        assert [(c.status_code, c.content) for c in calls] == [(200, b"")]
        assert [s.body for s in proxy.requests("/abort_request")] == [{"rid": engine_id}]
        assert stats(sim)["abort_named_ids"][named_before:] == [engine_id]
    finally:
        proxy.release()
        if admin is not None:
            admin.join(30)
        client.close()
        fe.stop()
        proxy.stop()


def test_vllm_abort_requests_reaches_a_pairs_decode_leg(tmp_path_factory):
    producer = start_sim("vllm", itl_ms=10, extra=["--kv-role", "producer"])
    consumer = start_sim("vllm", itl_ms=10, extra=["--kv-role", "consumer"])
    fe = Traced(tmp_path_factory, ["--prefill", f"vllm={producer.url}", "--decode", f"vllm={consumer.url}"])
    thread = None
    try:
        thread, out = _started(fe.url, "vllm", "pd-cut", True)
        wait_until(lambda: [n >= 5 for n in stats(consumer)["running_output_tokens"].values()] == [True], timeout=30)
        (engine_id,) = stats(consumer)["running_rids"]
        got = post(fe.url, {"request_ids": ["pd-cut"]}, "/abort_requests")
        assert (got.status_code, got.json()) == (200, {"status": "aborted", "aborted": 1})
        thread.join(30)
        finish, tokens = _finish("vllm", True, out["got"])
        assert finish == "abort" and 0 < tokens < N
        # The decode leg by its engine id, once; the prefill leg had ended.
        assert stats(consumer)["abort_named_ids"] == [engine_id]
        assert (stats(producer)["abort_named_ids"], stats(consumer)["running"]) == ([], 0)
        (rec,) = fe.take()
        assert (rec["public_id"], rec["status"], rec["output_tokens"]) == ("pd-cut", "engine_abort", tokens)
    finally:
        if thread is not None:
            thread.join(30)
        fe.stop()
        producer.stop()
        consumer.stop()
