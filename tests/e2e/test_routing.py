"""Spreading requests over workers: least outstanding, ties round-robin,
unreachable workers skipped until healthy again, 503 with none left."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import orjson
import pytest

from support import free_port, post, sse, start_frontend, start_sim, stats, wait_until, without_timing, trace_records

pytestmark = pytest.mark.e2e

BODY = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 4}}


@pytest.fixture
def two_sims():
    procs = [start_sim(itl_ms=20), start_sim(itl_ms=20)]
    yield procs
    for p in procs:
        p.stop()


def test_ties_go_round_robin(two_sims):
    fe = start_frontend([f"sglang={s.url}" for s in two_sims])
    try:
        for _ in range(10):
            assert post(fe.url, BODY).status_code == 200
        assert [stats(s)["received"] for s in two_sims] == [5, 5]
    finally:
        fe.stop()


def test_least_outstanding_wins(two_sims):
    fe = start_frontend([f"sglang={s.url}" for s in two_sims])
    try:
        long = {"input_ids": [1], "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        result = {}
        t = threading.Thread(target=lambda: result.update(r=sse(fe.url, long)))
        t.start()
        deadline = time.monotonic() + 10
        while sum(stats(s)["running"] for s in two_sims) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        busy = [stats(s)["running"] for s in two_sims].index(1)
        for _ in range(4):
            assert post(fe.url, BODY).status_code == 200
        t.join(30)
        counts = [stats(s)["received"] for s in two_sims]
        assert counts[busy] == 1 and counts[1 - busy] == 4
        assert len(result["r"][1]) == 201  # 200 chunks and [DONE]
    finally:
        fe.stop()


def test_unreachable_worker_is_skipped_and_comes_back():
    live = start_sim()
    port = free_port()
    fe = start_frontend([f"sglang={live.url}", f"sglang=http://127.0.0.1:{port}"])
    late = None
    try:
        for _ in range(4):
            assert post(fe.url, BODY).status_code == 200
        assert stats(live)["received"] == 4
        workers = httpx.get(fe.url + "/v1/models").json()["workers"]
        assert [(w["id"], w["state"]) for w in workers] == [("w0", "up"), ("w1", "down")]
        assert workers[1]["last_error"].startswith(f"connect to 127.0.0.1:{port} failed")
        late = start_sim(port=port)
        deadline = time.monotonic() + 10
        while httpx.get(fe.url + "/v1/models").json()["workers"][1]["state"] != "up":
            assert time.monotonic() < deadline, "worker w1 never came back up"
            time.sleep(0.05)
        for _ in range(4):
            assert post(fe.url, BODY).status_code == 200
        assert [stats(live)["received"], stats(late)["received"]] == [6, 2]
    finally:
        fe.stop()
        live.stop()
        if late is not None:
            late.stop()


def test_no_worker_left_is_503():
    port = free_port()
    fe = start_frontend([f"sglang=http://127.0.0.1:{port}"], health="/v1/models")
    try:
        health = httpx.get(fe.url + "/health")
        assert health.status_code == 503
        assert health.json() == {"status": "unavailable", "healthy_workers": 0}
        resp = post(fe.url, BODY)
        assert resp.status_code == 503
        assert resp.json() == {
            "object": "error",
            "message": "no healthy worker for protocol 'sglang'",
            "type": "503",
            "param": None,
            "code": 503,
        }
    finally:
        fe.stop()


def test_dead_worker_fails_over_before_first_token():
    a, b = start_sim(), start_sim()
    fe = start_frontend([f"sglang={a.url}", f"sglang={b.url}"], extra=["--health-interval", "30"])
    try:
        expected = without_timing(post(b.url, {**BODY, "rid": "x"}).json())
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        for _ in range(4):
            resp = post(fe.url, {**BODY, "rid": "x"})
            assert resp.status_code == 200
            assert without_timing(resp.json()) == expected
        assert stats(b)["received"] == 5
    finally:
        fe.stop()
        a.stop()
        b.stop()


def test_same_rid_concurrently_each_gets_its_own_output(two_sims):
    fe = start_frontend([f"sglang={s.url}" for s in two_sims])
    try:
        bodies = [
            {"input_ids": [100 + i], "rid": "dup", "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
            for i in range(6)
        ]
        expected = [without_timing(post(two_sims[0].url, b).json()) for b in bodies]
        results: list = [None] * 6

        def run(i: int) -> None:
            results[i] = post(fe.url, bodies[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [r.status_code for r in results] == [200] * 6
        assert [without_timing(r.json()) for r in results] == expected
        seen = stats(two_sims[0])["seen_rids"][6:] + stats(two_sims[1])["seen_rids"]
        assert len(seen) == 6 and len(set(seen)) == 6 and "dup" not in seen
    finally:
        fe.stop()


@pytest.mark.parametrize("prompt", [[1, 2], [[1, 2], [3, 4]]], ids=["one", "batch"])
def test_keepalive_comments_while_the_engine_is_silent(prompt):
    # Keep-alives due at 1 s and 2 s, the first token at 2.5 s: each may be
    # 0.5 s late before the count changes.
    sim = start_sim(ttft_ms=2500)
    fe = start_frontend([f"sglang={sim.url}"], extra=["--sse-keepalive", "1"])
    try:
        body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 2}}
        with httpx.stream("POST", fe.url + "/generate", content=orjson.dumps(body), timeout=10) as resp:
            raw = b"".join(resp.iter_bytes())
        assert resp.status_code == 200
        assert raw.startswith(b": keep-alive\n\n: keep-alive\n\n")
        assert raw.endswith(b"data: [DONE]\n\n")
        assert raw.count(b": keep-alive\n\n") == 2
    finally:
        fe.stop()
        sim.stop()


def test_incremental_streaming_worker():
    sim = start_sim(incremental=True)
    fe = start_frontend([f"sglang={sim.url}"])
    try:
        body = {"input_ids": [9, 8, 7], "rid": "inc", "return_logprob": True, "top_logprobs_num": 2,
                "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
        _, direct = sse(sim.url, {**body, "stream": True})
        _, through = sse(fe.url, {**body, "stream": True})
        assert [without_timing(orjson.loads(e)) for e in through[:-1]] == [
            without_timing(orjson.loads(e)) for e in direct[:-1]
        ]
        assert [len(orjson.loads(e)["output_ids"]) for e in through[:-1]] == [1] * 6
        unary = post(fe.url, body).json()
        assert without_timing(unary) == without_timing(post(sim.url, body).json())
        merged_ids = [t for e in through[:-1] for t in orjson.loads(e)["output_ids"]]
        assert unary["output_ids"] == merged_ids
        assert len(unary["meta_info"]["output_token_logprobs"]) == 6
        assert len(unary["meta_info"]["input_token_logprobs"]) == 3
    finally:
        fe.stop()
        sim.stop()


def test_hung_worker_leaves_the_rotation_and_comes_back():
    """A frozen worker still accepts connections but never answers: its
    health probe times out, it is marked down, and it returns when thawed."""
    a, b = start_sim(), start_sim()
    fe = start_frontend([f"sglang={a.url}", f"sglang={b.url}"],
                        extra=["--health-timeout", "1", "--health-failures", "2"])
    try:
        a.proc.send_signal(signal.SIGSTOP)
        state = lambda: [w["state"] for w in httpx.get(fe.url + "/v1/models").json()["workers"]]  # noqa: E731
        wait_until(lambda: state() == ["down", "up"], timeout=10)
        for _ in range(4):
            assert post(fe.url, BODY, timeout=5).status_code == 200
        assert stats(b)["received"] == 4
        a.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: state() == ["up", "up"], timeout=10)
    finally:
        a.proc.send_signal(signal.SIGCONT)
        fe.stop()
        a.stop()
        b.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_connection_one_request_broke_leaves_the_worker_up(two_sims, worker_class, tmp_path):
    """SGLang breaks a stream's connection after its 200 when the request
    itself is bad (an unknown sampling param is a TypeError its generator
    does not catch). The worker still answers its health probe: the request
    gets 502, it is not replayed on the other worker, and nobody is marked
    down (a client must not be able to empty the rotation)."""
    trace = tmp_path / "trace.jsonl"
    fe = start_frontend([f"sglang={s.url}" for s in two_sims], worker_class=worker_class,
                        extra=["--trace-file", str(trace)])
    try:
        bad = {"input_ids": [1, 2], "stream": True, "sampling_params": {"no_such_param": 1}}
        resp = post(fe.url, bad)
        assert resp.status_code == 502
        body = resp.json()
        assert (body["object"], body["code"]) == ("error", 502)
        assert body["message"].startswith("worker w") and "broke the connection mid-answer: " in body["message"]
        workers = httpx.get(fe.url + "/v1/models").json()["workers"]
        assert [w["state"] for w in workers] == ["up", "up"]
        for _ in range(4):
            assert post(fe.url, BODY).status_code == 200
        assert [stats(s)["received"] for s in two_sims] == [2, 2]
    finally:
        fe.stop()
    (rec, *rest) = trace_records(str(tmp_path / "trace.*.jsonl"))
    assert len(rest) == 4
    assert (rec["status"], rec["http_status"], rec["error"]["type"]) == ("engine_error", 502, "engine")
    assert [a["outcome"] for a in rec["attempts"]] == ["error"]


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_v1_models_lists_only_models_a_live_worker_serves(worker_class):
    """A worker that never came up has no model to list (``data``); the
    workers list still shows it, down. When the live worker goes down too,
    no model is left."""
    live = start_sim()
    port = free_port()
    fe = start_frontend([f"sglang={live.url}", f"sglang=http://127.0.0.1:{port}"], worker_class=worker_class)
    try:
        models = httpx.get(fe.url + "/v1/models", timeout=10).json()
        assert [(m["id"], m["object"], m["max_model_len"], m["root"]) for m in models["data"]] == [
            ("sim", "model", 32768, "sim")]
        assert [(w["id"], w["state"], w["model"]) for w in models["workers"]] == [
            ("w0", "up", "sim"), ("w1", "down", None)]
        live.stop()
        wait_until(lambda: httpx.get(fe.url + "/v1/models", timeout=10).json()["workers"][0]["state"] == "down",
                   timeout=30)
        models = httpx.get(fe.url + "/v1/models", timeout=10).json()
        assert models["data"] == []
        assert [(w["id"], w["state"], w["model"]) for w in models["workers"]] == [
            ("w0", "down", "sim"), ("w1", "down", None)]
    finally:
        fe.stop()
        live.stop()
