"""Info and admin routes (asgi_generate/ops/admin.py): answers from the workers,
fan-out to every worker, per-worker failures, abort by rid, admin token, and
a trainer's pause/flush/update/continue around running streams."""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time

import httpx
import orjson
import pytest

from support import children, free_port, post, sse, start_frontend, start_sim, stats, wait_until

pytestmark = pytest.mark.e2e

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
SKIPPED = "asgi-generate-skipped-workers"
LONG = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}


@pytest.fixture(scope="module")
def fleet():
    """Two SGLang and two vLLM simulators (20 ms between tokens)."""
    sims = [
        start_sim(itl_ms=20), start_sim(itl_ms=20),
        start_sim("vllm", itl_ms=20, extra=["--model-name", "vm"]), start_sim("vllm", itl_ms=20, extra=["--model-name", "vm"]),
    ]
    yield sims
    for s in sims:
        s.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def frontend(request, fleet):
    # No fleet-state readings: they GET /is_paused every second, which the
    # tests count as the calls the frontend fanned out.
    fe = start_frontend([f"sglang={s.url}" for s in fleet[:2]] + [f"vllm={s.url}" for s in fleet[2:]],
                        worker_class=request.param, extra=["--fleet-state-interval", "0"])
    yield fe
    fe.stop()


def _calls(sim, path: str) -> int:
    return stats(sim)["admin_calls"].get(path, 0)


def _streams(url: str, bodies: list[dict]) -> tuple[list[threading.Thread], list]:
    results: list = [None] * len(bodies)

    def run(i: int) -> None:
        results[i] = sse(url, bodies[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return threads, results


def _finish(events: list[bytes]) -> dict:
    assert events[-1] == b"[DONE]"
    return orjson.loads(events[-2])["meta_info"]["finish_reason"]


def test_info_routes_are_a_workers_own_answer(fleet, frontend):
    for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
        got = httpx.get(frontend.url + path)
        direct = httpx.get(fleet[0].url + path)
        assert (got.status_code, got.json()) == (200, direct.json()), path
    info = httpx.get(frontend.url + "/get_model_info").json()
    direct_path = httpx.get(fleet[1].url + "/get_server_info").json()["model_path"]
    assert (info["is_generation"], info["model_path"]) == (True, direct_path)


def test_v1_models_carries_max_model_len_and_root(fleet, frontend):
    data = httpx.get(frontend.url + "/v1/models").json()["data"]
    vllm_root = httpx.get(fleet[2].url + "/v1/models").json()["data"][0]["root"]
    assert [(m["id"], m["max_model_len"], m["root"]) for m in data] == [
        ("sim", 32768, "sim"), ("vm", 32768, vllm_root),
    ]


def test_health_generate_generates_one_token_per_protocol(fleet, frontend):
    before = sum(stats(s)["received"] for s in fleet[2:])
    got = httpx.get(frontend.url + "/health_generate")
    assert (got.status_code, got.content) == (200, b"")
    assert sum(stats(s)["received"] for s in fleet[2:]) == before + 1


def test_sglang_admin_routes_reach_every_worker(fleet, frontend):
    sg = fleet[:2]
    calls = [
        ("GET", "/flush_cache", None, FLUSHED),
        ("POST", "/flush_cache", None, FLUSHED),
        ("POST", "/pause_generation", {"mode": "in_place"}, {"message": "Generation paused successfully.", "status": "ok"}),
        ("POST", "/continue_generation", {}, {"message": "Generation continued successfully.", "status": "ok"}),
        ("POST", "/update_weights_from_disk", {"model_path": "/ckpt/7", "weight_version": "v7"},
         {"success": True, "message": "Succeeded to update model weights. Weight version updated to v7.",
          "num_paused_requests": 0}),
        ("POST", "/release_memory_occupation", {}, None),
        ("GET", "/resume_memory_occupation", {}, None),
    ]
    for method, path, body, answer in calls:
        before = [_calls(s, path) for s in sg]
        content = orjson.dumps(body) if body is not None else b""
        got = httpx.request(method, frontend.url + path, content=content)
        assert got.status_code == 200, (path, got.text)
        assert (got.text if isinstance(answer, str) else got.json()) == answer, path
        assert [_calls(s, path) for s in sg] == [b + 1 for b in before], path
    assert [httpx.get(s.url + "/get_model_info").json()["weight_version"] for s in sg] == ["v7", "v7"]


def test_vllm_admin_routes_reach_every_worker(fleet, frontend):
    vl = fleet[2:]
    gen = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
    calls = [
        ("POST", "/reset_prefix_cache", b""),
        ("POST", "/sleep?level=1", b""),
        ("GET", "/is_sleeping", {"is_sleeping": True}),
        ("POST", "/wake_up", b""),
        ("GET", "/is_sleeping", {"is_sleeping": False}),
        ("POST", "/pause?mode=keep", {"status": "paused"}),
        ("GET", "/is_paused", {"is_paused": True}),
        ("POST", "/resume", {"status": "resumed"}),
        ("GET", "/is_paused", {"is_paused": False}),
    ]
    for method, target, answer in calls:
        path = target.split("?")[0]
        before = [_calls(s, path) for s in vl]
        got = httpx.request(method, frontend.url + target)
        assert got.status_code == 200, (target, got.text)
        assert (got.content if isinstance(answer, bytes) else got.json()) == answer, target
        assert [_calls(s, path) for s in vl] == [b + 1 for b in before], target
        if target == "/sleep?level=1":  # a sleeping engine refuses generation
            refused = post(vl[1].url, gen, "/inference/v1/generate")
            assert (refused.status_code, refused.json()["error"]["type"]) == (503, "ServiceUnavailableError")
    assert post(frontend.url, gen, "/inference/v1/generate").status_code == 200


def test_a_failing_worker_gives_502_with_every_result(fleet, frontend):
    threads, results = _streams(frontend.url, [LONG])
    wait_until(lambda: sum(stats(s)["running"] for s in fleet[:2]) == 1)
    busy = [stats(s)["running"] for s in fleet[:2]].index(1)
    got = httpx.post(frontend.url + "/flush_cache")
    assert got.status_code == 502
    expected = [{"worker": "w0", "status": 200, "body": FLUSHED}, {"worker": "w1", "status": 200, "body": FLUSHED}]
    expected[busy]["status"] = 400  # SGLang refuses a flush while requests run
    assert got.json() == expected
    for t in threads:
        t.join(30)
    assert _finish(results[0][1]) == {"type": "length", "length": 200}


def test_a_worker_that_is_down_is_skipped_and_named(fleet):
    port = free_port()
    fe = start_frontend([f"sglang={fleet[0].url}", f"sglang=http://127.0.0.1:{port}"])
    try:
        for _ in range(2):
            got = httpx.post(fe.url + "/flush_cache")
            assert (got.status_code, got.text, got.headers[SKIPPED]) == (200, FLUSHED, "w1")
        threads, results = _streams(fe.url, [LONG])
        wait_until(lambda: stats(fleet[0])["running"] == 1)
        got = httpx.post(fe.url + "/flush_cache")  # refused by the busy w0: the list names w1 too
        assert (got.status_code, got.headers[SKIPPED]) == (502, "w1")
        w0, w1 = got.json()
        assert w0 == {"worker": "w0", "status": 400, "body": FLUSHED}
        assert (w1["worker"], w1["status"], w1["skipped"]) == ("w1", None, True)
        assert w1["body"].startswith(f"down: connect to 127.0.0.1:{port} failed")
        for t in threads:
            t.join(30)
    finally:
        fe.stop()
    fe = start_frontend([f"sglang=http://127.0.0.1:{port}"], health="/stats")
    try:
        got = httpx.post(fe.url + "/flush_cache")
        assert (got.status_code, got.headers[SKIPPED]) == (503, "w0")
        assert got.json()["error"]["message"].startswith(
            f"no worker of protocol 'sglang' is up: w0 (connect to 127.0.0.1:{port} failed")
        for path in ("/get_model_info", "/server_info"):
            got = httpx.get(fe.url + path)
            assert (got.status_code, got.json()) == (503, {"error": {"message": "no healthy worker for protocol 'sglang'"}})
        got = httpx.get(fe.url + "/health_generate")
        assert (got.status_code, got.json()) == (
            503, {"error": {"message": "no worker generated a token for: 'sglang', 'vllm'"}}
        )
    finally:
        fe.stop()


def test_abort_request_by_rid_and_by_prefix_ends_exactly_those_streams(fleet, frontend):
    rids = ["job-1", "job-12", "jobs-2", "other"]
    threads, results = _streams(frontend.url, [{**LONG, "rid": r} for r in rids])
    wait_until(lambda: sum(stats(s)["running"] for s in fleet[:2]) == 4)
    got = httpx.post(frontend.url + "/abort_request", json={"rid": "job-12"})
    assert (got.status_code, got.content) == (200, b"")
    threads[1].join(30)
    assert not threads[1].is_alive() and all(t.is_alive() for t in (threads[0], threads[2], threads[3]))
    got = httpx.post(frontend.url + "/abort_request", json={"rid": "job"})  # prefix: job-1 and jobs-2
    assert (got.status_code, got.content) == (200, b"")
    for t in threads:
        t.join(30)
    abort = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT()
    finishes = [_finish(events) for _, events in results]
    assert finishes == [abort, abort, abort, {"type": "length", "length": 200}]
    assert [r[0] for r in results] == [200, 200, 200, 200]
    # The engine's own abort finish, asked directly, is the same.
    threads, direct = _streams(fleet[0].url, [{**LONG, "rid": "direct"}])
    wait_until(lambda: stats(fleet[0])["running"] == 1)
    httpx.post(fleet[0].url + "/abort_request", json={"rid": "direct"})
    threads[0].join(30)
    assert _finish(direct[0][1]) == abort
    # No rid and no abort_all aborts nothing, as SGLang.
    assert httpx.post(frontend.url + "/abort_request", json={}).status_code == 200


def test_admin_token_is_required_when_set(fleet):
    fe = start_frontend([f"sglang={fleet[0].url}"], extra=["--admin-token", "s3cret"])
    try:
        denied = {"error": {"message": "Unauthorized: admin routes need 'Authorization: Bearer <admin token>'"}}
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}, {"authorization": "Bearers3cret"}):
            got = httpx.post(fe.url + "/flush_cache", headers=headers)
            assert (got.status_code, got.json(), got.headers["www-authenticate"]) == (401, denied, "Bearer")
            got = httpx.post(fe.url + "/abort_request", json={"abort_all": True}, headers=headers)
            assert (got.status_code, got.headers["www-authenticate"]) == (401, "Bearer")
        before = _calls(fleet[0], "/flush_cache")
        # The scheme is case-insensitive (RFC 9110 section 11.1).
        for scheme in ("Bearer", "bearer", "BEARER"):
            got = httpx.post(fe.url + "/flush_cache", headers={"authorization": f"{scheme} s3cret"})
            assert (got.status_code, got.text) == (200, FLUSHED)
        assert _calls(fleet[0], "/flush_cache") == before + 3
        assert httpx.get(fe.url + "/get_model_info").status_code == 200  # info routes stay open
    finally:
        fe.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_trainer_checking_for_200_does_not_stall_on_a_dead_embedded_simulator(worker_class):
    fe = start_frontend([], worker_class=worker_class)  # two simulators per protocol, never restarted
    try:
        sglang = [pid for pid in children(fe.proc.pid)
                  if b"sglang" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        assert len(sglang) == 2
        os.kill(sglang[0], signal.SIGKILL)
        steps = [
            ("/pause_generation", {"mode": "in_place"}, {"message": "Generation paused successfully.", "status": "ok"}),
            ("/flush_cache", None, FLUSHED),
            ("/update_weights_from_disk", {"model_path": "/ckpt/8", "weight_version": "v8"},
             {"success": True, "message": "Succeeded to update model weights. Weight version updated to v8.",
              "num_paused_requests": 0}),
            ("/continue_generation", {}, {"message": "Generation continued successfully.", "status": "ok"}),
        ]
        skipped = set()
        for path, body, answer in steps * 2:  # at once, and again once the probe has given the worker up
            got = httpx.post(fe.url + path, content=b"" if body is None else orjson.dumps(body), timeout=10)
            assert got.status_code == 200, (path, got.text)
            assert (got.text if isinstance(answer, str) else got.json()) == answer, path
            skipped.add(got.headers["asgi-generate-skipped-workers"])
        dead = [w["id"] for w in httpx.get(fe.url + "/v1/models").json()["workers"] if w["state"] == "down"]
        assert [skipped] == [set(dead)] and len(dead) == 1
    finally:
        fe.stop()


def test_pause_flush_update_continue_around_20_streams(fleet, frontend):
    sg = fleet[:2]
    # 200 tokens at 20 ms: 4 s for the pause to reach the engines, however
    # busy the machine; a stream that ends first still ends whole.
    body = {"input_ids": [9, 8], "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    threads, results = _streams(frontend.url, [body] * 20)
    try:
        # In place: the streams wait out the weight update, then finish whole.
        wait_until(lambda: sum(stats(s)["running"] for s in sg) == 20)
        assert httpx.post(frontend.url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
        paused = sum(stats(s)["running"] for s in sg)
        upd = httpx.post(frontend.url + "/update_weights_from_disk", json={"model_path": "/ckpt/8"})
        assert (upd.status_code, upd.json()["success"]) == (200, True)
        time.sleep(0.2)  # a paused stream that ended would be a bug: give it time to show
        assert sum(stats(s)["running"] for s in sg) == paused
    finally:
        assert httpx.post(frontend.url + "/continue_generation").status_code == 200
        for t in threads:
            t.join(30)
    assert [(r[0], len(r[1]), _finish(r[1])) for r in results] == [(200, 201, {"type": "length", "length": 200})] * 20
    # Abort mode: every stream ends with the abort finish (none could end
    # first: 30,000 tokens), the idle cache flushes, and new requests run
    # after continue.
    body["sampling_params"]["max_new_tokens"] = 30_000
    threads, results = _streams(frontend.url, [body] * 20)
    try:
        wait_until(lambda: sum(stats(s)["running"] for s in sg) == 20)
        assert httpx.post(frontend.url + "/pause_generation", json={"mode": "abort"}).status_code == 200
    finally:
        for t in threads:
            t.join(30)
    assert {_finish(r[1])["type"] for r in results} == {"abort"}
    flushed = httpx.post(frontend.url + "/flush_cache")
    assert (flushed.status_code, flushed.text) == (200, FLUSHED)
    assert httpx.post(frontend.url + "/update_weights_from_disk", json={"model_path": "/ckpt/9"}).status_code == 200
    assert httpx.post(frontend.url + "/continue_generation").status_code == 200
    again = post(frontend.url, {"input_ids": [9, 8], "sampling_params": {"max_new_tokens": 3}})
    assert (again.status_code, again.json()["meta_info"]["finish_reason"]) == (200, {"type": "length", "length": 3})


def test_pd_workers_get_the_fan_out_and_the_abort_of_both_legs():
    prefill = start_sim(itl_ms=20, extra=["--disaggregation-mode", "prefill", "--bootstrap-port", "0"])
    decode = start_sim(itl_ms=20, extra=["--disaggregation-mode", "decode"])
    fe = None
    try:
        port = httpx.get(prefill.url + "/get_server_info").json()["disaggregation_bootstrap_port"]
        fe = start_frontend([], extra=["--disaggregation", "always", "--prefill",
                                       f"sglang={prefill.url}?bootstrap_port={port}", "--decode", f"sglang={decode.url}"])
        got = httpx.post(fe.url + "/flush_cache")
        assert (got.status_code, got.text) == (200, FLUSHED)
        assert [_calls(s, "/flush_cache") for s in (prefill, decode)] == [1, 1]
        threads, results = _streams(fe.url, [{**LONG, "rid": "pd-1"}])
        wait_until(lambda: stats(decode)["running"] == 1)
        engine_id = stats(decode)["running_rids"][0]
        got = httpx.post(fe.url + "/abort_request", json={"rid": "pd"})
        assert (got.status_code, got.content) == (200, b"")
        threads[0].join(30)
        assert _finish(results[0][1])["type"] == "abort"
        assert engine_id in stats(decode)["aborted_rids"]
        assert stats(decode)["abort_requests"] == 1  # the prefill leg aborted too if it was still live
        assert (stats(prefill)["running"], stats(decode)["running"]) == (0, 0)
    finally:
        if fe is not None:
            fe.stop()
        prefill.stop()
        decode.stop()
