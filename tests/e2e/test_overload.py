"""Admission end to end (``--admission``; docs/overload.md), through a real
frontend and its simulators, both worker classes: sheds in SGLang's and
vLLM's error shapes with ``Retry-After``, requests waiting (bounded) through
a fleet pause, the slot given back when the client leaves while queued and
while running, a stream cut at its deadline with the engine's abort finish,
answers unchanged on an idle fleet, and exactly one record per request with
its outcome."""

from __future__ import annotations

import signal
import threading

import httpx
import orjson
import pytest

from support import RawClient, Traced, post, sse, start_frontend, start_sim, trace_records, wait_until

pytestmark = pytest.mark.e2e

VLLM = "/inference/v1/generate"
GENERATE = {"sglang": "/generate", "vllm": VLLM}
PAUSE = {"sglang": ("/pause_generation", {"mode": "abort"}), "vllm": ("/pause?mode=abort", {})}
RESUME = {"sglang": ("/continue_generation", {}), "vllm": ("/resume", {})}


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fe(request, tmp_path_factory):
    t = Traced(tmp_path_factory, [
        "--admission", "--admission-worker-requests", "2", "--admission-queue-depth", "1",
        "--admission-queue-wait", "20", "--embedded-workers", "1", "--embedded-itl-ms", "20",
    ], worker_class=request.param)
    wait_until(lambda: _admission(t)["saturation"]["readings"] >= 2)
    yield t
    t.stop()


def _admission(fe) -> dict:
    return httpx.get(fe.url + "/stats", timeout=5).json()["admission"]


def _rollout(fe, protocol: str) -> dict:
    return _admission(fe)["protocols"].get(protocol, {}).get("classes", {}).get("rollout", {})


def _body(protocol: str, n: int = 4, stream: bool = False, rid: str = "r") -> dict:
    if protocol == "sglang":
        return {"input_ids": [5, 6, 7], "rid": rid, "stream": stream,
                "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
    return {"token_ids": [5, 6, 7], "request_id": rid, "stream": stream,
            "sampling_params": {"max_tokens": n, "ignore_eos": True}}


def _pause(fe, protocol: str) -> None:
    path, body = PAUSE[protocol]
    assert post(fe.url, body, path).status_code == 200


def _resume(fe, protocol: str) -> None:
    path, body = RESUME[protocol]
    assert post(fe.url, body, path).status_code == 200


def _in_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", fn()))
    thread.start()
    return thread, out


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_full_queue_sheds_in_the_formats_shape_and_a_pause_waits(fe, protocol):
    _pause(fe, protocol)
    try:
        thread, out = _in_thread(lambda: post(fe.url, _body(protocol, rid="waits"), GENERATE[protocol]))
        wait_until(lambda: _rollout(fe, protocol).get("waiting") == 1)
        shed = post(fe.url, _body(protocol, rid="shed"), GENERATE[protocol])
    finally:
        _resume(fe, protocol)
    thread.join(30)
    message = ("overloaded: shed from the rollout queue (queue_depth): the rollout queue is full (1 requests)")
    want = ({"object": "error", "message": message, "type": "Too Many Requests", "param": None, "code": 429}
            if protocol == "sglang" else
            {"error": {"message": message, "type": "Too Many Requests", "param": None, "code": 429}})
    assert (shed.status_code, shed.headers["retry-after"], shed.json()) == (429, "1", want)
    waited = out["r"]
    assert waited.status_code == 200
    tokens = (waited.json()["output_ids"] if protocol == "sglang" else waited.json()["choices"][0]["token_ids"])
    assert len(tokens) == 4
    recs = {r["public_id"]: r for r in fe.take(2)}
    assert (recs["shed"]["status"], recs["shed"]["http_status"], recs["shed"]["shed_reason"],
            recs["shed"]["priority_class"], recs["shed"]["tenant"]) == ("shed", 429, "queue_depth", "rollout",
                                                                         "default")
    assert recs["shed"]["error"] == {"type": "queue_depth", "message": message}
    assert recs["waits"]["status"] == "ok" and recs["waits"]["queue_ms"] > 0
    assert recs["waits"]["output_tokens"] == 4
    assert _rollout(fe, protocol)["held"] == 0


def test_an_unknown_class_is_a_400(fe):
    got = post(fe.url, _body("vllm", rid="bad"), VLLM, headers={"x-priority-class": "vip"})
    assert got.status_code == 400
    assert got.json()["error"]["message"] == ("unknown priority class 'vip' (x-priority-class; known: eval, agent, "
                                              "rollout, bulk)")
    (rec,) = fe.take(1)
    assert rec["status"] == "rejected" and rec["http_status"] == 400


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_answers_are_unchanged_on_an_idle_fleet(fe, protocol):
    worker = next(w for w in httpx.get(fe.url + "/v1/models").json()["workers"] if w["protocol"] == protocol)
    direct = post(worker["url"], _body(protocol, n=6, rid="same"), GENERATE[protocol]).json()
    got = post(fe.url, _body(protocol, n=6, rid="same"), GENERATE[protocol],
               headers={"x-priority-class": "eval", "x-tenant": "team-a"}).json()
    if protocol == "sglang":
        assert got["output_ids"] == direct["output_ids"] and got["text"] == direct["text"]
    else:
        assert got["choices"] == direct["choices"]
    (rec,) = fe.take(1)
    assert (rec["status"], rec["priority_class"], rec["tenant"], rec["queue_ms"]) == ("ok", "eval", "team-a", 0)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_the_slot_is_given_back_when_the_client_leaves_while_queued(fe, protocol):
    _pause(fe, protocol)
    try:
        client = RawClient(fe.url)
        client.send(orjson.dumps(_body(protocol, rid="queued-gone")), path=GENERATE[protocol])
        wait_until(lambda: _rollout(fe, protocol).get("waiting") == 1)
        client.sock.close()
        wait_until(lambda: _rollout(fe, protocol)["waiting"] == 0)
    finally:
        _resume(fe, protocol)
    (rec,) = fe.take(1)
    assert rec["status"] == "client_disconnect" and rec["attempts"] == [] and "queue_ms" not in rec
    assert _rollout(fe, protocol)["held"] == 0


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_the_slot_is_given_back_when_the_client_leaves_while_running(fe, protocol):
    client = RawClient(fe.url)
    client.send(orjson.dumps(_body(protocol, n=500, stream=True, rid="running-gone")), path=GENERATE[protocol])
    assert len(client.events(2)) == 2
    assert _rollout(fe, protocol)["held"] == 1
    client.sock.close()
    wait_until(lambda: _rollout(fe, protocol)["held"] == 0)
    (rec,) = fe.take(1)
    assert rec["status"] == "client_disconnect" and rec["attempts"][0]["abort_acked"] is True


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_the_overload_law_every_request_one_record_with_its_outcome(fe, protocol):
    """A burst of 12 streams at a fleet of room 2 with one queue place per
    class: each request is answered whole (200, all its tokens) or shed (429
    with Retry-After in the format's shape), and has one record saying which."""
    results = {}

    def one(i: int) -> None:
        results[i] = sse(fe.url, _body(protocol, n=20, stream=True, rid=f"burst-{i}"), GENERATE[protocol])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 12
    ok = {f"burst-{i}" for i, (status, _) in results.items() if status == 200}
    shed = {f"burst-{i}" for i, (status, _) in results.items() if status == 429}
    assert len(ok) + len(shed) == 12 and len(ok) >= 2 and shed
    for i, (status, events) in results.items():
        if status == 200:
            payloads = [orjson.loads(e) for e in events if e != b"[DONE]"]
            got = (len(payloads[-1]["output_ids"]) if protocol == "sglang" else
                   sum(len(p["choices"][0]["token_ids"]) for p in payloads if p.get("choices")))
            assert got == 20
    recs = {r["public_id"]: r for r in fe.take(12)}
    assert set(recs) == ok | shed
    assert {r["status"] for rid, r in recs.items() if rid in ok} == {"ok"}
    assert all((recs[rid]["status"], recs[rid]["http_status"], recs[rid]["shed_reason"]) == ("shed", 429, "queue_depth")
               for rid in shed)
    assert all(recs[rid]["output_tokens"] == 20 for rid in ok)
    wait_until(lambda: _rollout(fe, protocol)["held"] == 0 and _rollout(fe, protocol)["waiting"] == 0)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_stream_at_its_deadline_ends_with_the_abort_finish_and_its_tokens(fe, protocol):
    status, events = sse(fe.url, _body(protocol, n=500, stream=True, rid="late"), GENERATE[protocol],
                         headers={"x-deadline-ms": "400"})
    assert status == 200
    payloads = [orjson.loads(e) for e in events if e != b"[DONE]"]
    if protocol == "sglang":
        last = payloads[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        sent = len(last["output_ids"])
    else:
        assert payloads[-1]["choices"][0]["finish_reason"] == "abort"
        sent = sum(len(p["choices"][0]["token_ids"]) for p in payloads)
    assert 0 < sent < 500
    (rec,) = fe.take(1)
    assert (rec["status"], rec["shed_reason"], rec["output_tokens"]) == ("deadline", "deadline", sent)
    assert _admission(fe)["deadline_cuts"] >= 1
    assert _rollout(fe, protocol)["held"] == 0


def test_metrics_show_admission(fe):
    """The class's row exists once it has had a request (tests may run on a
    fresh frontend in any order), and shows the slot given back."""
    resp = post(fe.url, _body("sglang", rid="metrics"))
    assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 4
    assert [r["public_id"] for r in fe.take(1)] == ["metrics"]
    wait_until(lambda: _rollout(fe, "sglang")["held"] == 0)
    text = httpx.get(fe.url + "/metrics").text
    assert 'asgi_generate_admission_slots_held{class="rollout",protocol="sglang"} 0.0' in text
    assert 'asgi_generate_admission_room_sequences{protocol="sglang",quantity="capacity"} 2.0' in text
    assert "asgi_generate_engine_requests{" in text


@pytest.fixture(scope="module")
def sims():
    started = [start_sim(), start_sim()]
    yield started
    for sim in started:
        sim.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_the_slot_follows_a_migrated_stream_and_is_given_back_at_its_end(sims, worker_class, tmp_path):
    base = str(tmp_path / "t")
    fe = start_frontend([f"sglang={s.url}" for s in sims], worker_class=worker_class,
                        extra=["--admission", "--trace-file", base + ".jsonl"])
    try:
        wait_until(lambda: _admission(fe)["saturation"]["readings"] >= 2)
        for s in sims:
            httpx.post(s.url + "/sim/faults", json={"after_tokens": 5, "input_len": 3}, timeout=5).raise_for_status()
        status, events = sse(fe.url, _body("sglang", n=12, stream=True, rid="moved"), "/generate")
        assert status == 200
        assert len(orjson.loads(events[-2] if events[-1] == b"[DONE]" else events[-1])["output_ids"]) == 12
        wait_until(lambda: _rollout(fe, "sglang")["held"] == 0)
        (rec,) = wait_until(lambda: trace_records(base + ".*.jsonl"))
        assert (rec["status"], rec["migrations"], rec["output_tokens"], rec["priority_class"]) == ("ok", 1, 12,
                                                                                                 "rollout")
    finally:
        for s in sims:
            httpx.delete(s.url + "/sim/faults", timeout=5)
        fe.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_request_queued_at_shutdown_is_answered_503_with_its_record(sims, worker_class, tmp_path):
    base = str(tmp_path / "t")
    fe = start_frontend([f"sglang={sims[0].url}"], worker_class=worker_class,
                        extra=["--admission", "--trace-file", base + ".jsonl"])
    try:
        wait_until(lambda: _admission(fe)["saturation"]["readings"] >= 1)
        _pause(fe, "sglang")
        client = RawClient(fe.url)
        client.send(orjson.dumps(_body("sglang", rid="at-shutdown")))
        wait_until(lambda: _rollout(fe, "sglang").get("waiting") == 1)
        fe.signal(signal.SIGTERM)
        head = client._next()
        body = b""
        while type(event := client._next()).__name__ == "Data":
            body += event.data
        assert head.status_code == 503
        assert orjson.loads(body) == {"object": "error", "message": "server is shutting down", "type": "503",
                                      "param": None, "code": 503}
        fe.proc.wait(20)
        (rec,) = trace_records(base + ".*.jsonl")
        assert (rec["status"], rec["http_status"], rec["public_id"]) == ("shutdown", 503, "at-shutdown")
    finally:
        post(sims[0].url, {}, "/continue_generation")
        fe.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_group_larger_than_the_fleet_is_503_at_its_first_member(sims, worker_class, tmp_path):
    # one worker of 2 sequences: a group of 3 members can never be admitted,
    # so its first member is answered now, not after the queue's 60 s wait
    base = str(tmp_path / "t")
    fe = start_frontend([f"sglang={sims[0].url}"], worker_class=worker_class,
                        extra=["--admission", "--admission-worker-requests", "2", "--admission-queue-wait", "60",
                               "--trace-file", base + ".jsonl"])
    try:
        wait_until(lambda: _admission(fe)["saturation"]["readings"] >= 1)
        got = post(fe.url, _body("sglang", rid="big-0"), "/generate", headers={"x-group-id": "big",
                                                                                "x-group-size": "3"}, timeout=30)
        message = "group big of 3 members holds at least 3 sequences, over the fleet's limit of 2"
        assert (got.status_code, "retry-after" in got.headers, got.json()) == (
            503, False, {"object": "error", "message": message, "type": "503", "param": None, "code": 503})
        assert _rollout(fe, "sglang")["waiting"] == 0
        (rec,) = wait_until(lambda: trace_records(base + ".*.jsonl"))
        assert (rec["status"], rec["http_status"], rec["shed_reason"], rec["group_id"]) == ("shed", 503, "never",
                                                                                            "big")
    finally:
        fe.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_class_is_sent_as_the_engines_priority_unless_the_client_gave_one(sims, worker_class):
    from wire_proxy import WireProxy

    vllm = start_sim("vllm")
    proxies = {"sglang": WireProxy(sims[0].url), "vllm": WireProxy(vllm.url)}
    fe = start_frontend([f"{p}={proxy.url}" for p, proxy in proxies.items()], worker_class=worker_class,
                        extra=["--admission", "--admission-engine-priority", "eval=-10,bulk=10"])
    try:
        wait_until(lambda: _admission(fe)["saturation"]["readings"] >= 2)
        for protocol, proxy in proxies.items():
            path = GENERATE[protocol]
            assert post(fe.url, _body(protocol, rid="e"), path, headers={"x-priority-class": "eval"}).status_code == 200
            assert post(fe.url, _body(protocol, rid="r"), path).status_code == 200
            own = {**_body(protocol, rid="o"), "priority": 3}
            assert post(fe.url, own, path, headers={"x-priority-class": "bulk"}).status_code == 200
            sent = [s.body for s in proxy.requests(path)]
            assert [b.get("priority", "none") for b in sent] == [-10, "none", 3]
    finally:
        fe.stop()
        for proxy in proxies.values():
            proxy.stop()
        vllm.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_preempted_stream_resumes_exactly_and_the_higher_class_goes_first(worker_class, tmp_path):
    base = str(tmp_path / "t")
    slow = start_sim(itl_ms=30)
    fe = start_frontend([f"sglang={slow.url}"], worker_class=worker_class, extra=[
        "--admission", "--admission-preemption", "--admission-worker-requests", "1", "--admission-reserved-share", "0",
        "--trace-file", base + ".jsonl"])
    try:
        wait_until(lambda: _admission(fe)["saturation"]["readings"] >= 1)
        body = {**_body("sglang", n=80, stream=True, rid="bulk"), "input_ids": [9, 8, 7, 6]}
        _, whole = sse(slow.url, {**body, "rid": "uninterrupted"}, "/generate")
        client = RawClient(fe.url)
        raw = orjson.dumps(body)
        client.sock.sendall(
            b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-priority-class: bulk\r\n"
            b"x-preemptible: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw))
        first = client.events(2)
        assert len(first) == 2
        urgent = post(fe.url, _body("sglang", n=3, rid="eval"), "/generate", headers={"x-priority-class": "eval"})
        assert urgent.status_code == 200 and len(urgent.json()["output_ids"]) == 3
        rest = client.events(1000)
        got = [orjson.loads(e) for e in first + rest if e != b"[DONE]"]
        want = [orjson.loads(e) for e in whole if e != b"[DONE]"]
        assert got[-1]["output_ids"] == want[-1]["output_ids"] and len(got[-1]["output_ids"]) == 80
        assert got[-1]["meta_info"]["finish_reason"] == want[-1]["meta_info"]["finish_reason"]
        stats = _admission(fe)
        assert (stats["preemptions"], stats["resumed_parked"], stats["parked"]) == (1, 1, 0)
        wait_until(lambda: _admission(fe)["protocols"]["sglang"]["classes"]["bulk"]["held"] == 0)
        written = wait_until(lambda: len(found := trace_records(base + ".*.jsonl")) == 2 and found)
        recs = {r["public_id"]: r for r in written}
        assert (recs["bulk"]["status"], recs["bulk"]["preemptions"], recs["bulk"]["migrations"],
                recs["bulk"]["output_tokens"]) == ("ok", 1, 1, 80)
        assert recs["eval"]["status"] == "ok"
    finally:
        fe.stop()
        slow.stop()
