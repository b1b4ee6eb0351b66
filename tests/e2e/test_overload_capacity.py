"""The overload law end to end on simulators playing their engines'
capacity (``asgi-generate sim --max-running-requests`` / ``--max-num-seqs``,
a small KV pool, a step time), both worker classes, both protocols, with
``--admission``: a burst larger than the fleet holds ends with exactly one
record per request, each answered whole with the tokens an uninterrupted
run gives (the simulator is deterministic: :func:`support.sampled`) or shed
with ``429``, ``Retry-After`` and the format's error shape; and a
preemptible low-class stream preempted for an eval request resumes exactly,
its answer equal to an uninterrupted one."""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest

from support import RawClient, post, sampled, start_frontend, start_sim, trace_records, wait_until

pytestmark = pytest.mark.e2e

GENERATE = {"sglang": "/generate", "vllm": "/inference/v1/generate"}
#: Two running sequences per engine, a 600-token KV pool, 3 ms a step.
ENGINE_LIMITS = {
    "sglang": ["--max-running-requests", "2", "--max-total-tokens", "600", "--step-ms", "3"],
    "vllm": ["--max-num-seqs", "2", "--block-size", "4", "--num-gpu-blocks-override", "150", "--step-ms", "3"],
}


class Fleet:
    """One capacity-limited simulator per protocol behind a frontend with
    admission (room 2 per worker, 4 waiting per class) and preemption."""

    def __init__(self, worker_class: str, base: str) -> None:
        self.base = base
        self.sims = {p: start_sim(p, extra=ENGINE_LIMITS[p]) for p in GENERATE}
        self.fe = start_frontend([f"{p}={s.url}" for p, s in self.sims.items()], worker_class=worker_class, extra=[
            "--admission", "--admission-preemption", "--admission-worker-requests", "2",
            "--admission-queue-depth", "4", "--admission-queue-wait", "20", "--admission-reserved-share", "0",
            "--trace-file", base + ".jsonl"])
        self.url = self.fe.url
        self.taken = 0
        wait_until(lambda: self.admission()["saturation"]["readings"] >= 2)

    def admission(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=5).json()["admission"]

    def held(self, protocol: str) -> int:
        classes = self.admission()["protocols"].get(protocol, {}).get("classes", {})
        return sum(c["held"] + c["waiting"] for c in classes.values())

    def take(self, n: int) -> dict[str, dict]:
        """The next ``n`` records by ``public_id``, once written (exactly ``n``)."""
        recs = wait_until(lambda: len(r := trace_records(self.base + ".*.jsonl")) >= self.taken + n and r, 20)
        assert len(recs) == self.taken + n, "one record per request"
        new, self.taken = recs[self.taken:], self.taken + n
        return {r["public_id"]: r for r in new}

    def stop(self) -> None:
        self.fe.stop()
        for sim in self.sims.values():
            sim.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fleet(request, tmp_path_factory):
    started = Fleet(request.param, str(tmp_path_factory.mktemp("capacity") / "trace"))
    yield started
    started.stop()


def _body(protocol: str, prompt: list[int], n: int, rid: str) -> dict:
    if protocol == "sglang":
        return {"input_ids": prompt, "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
    return {"token_ids": prompt, "request_id": rid, "stream": True,
            "sampling_params": {"max_tokens": n, "ignore_eos": True}}


def _answer(protocol: str, events: list[bytes]) -> tuple[list[int], object]:
    """A stream's tokens and finish reason, as its client assembles them."""
    payloads = [orjson.loads(e) for e in events if e != b"[DONE]"]
    if protocol == "sglang":
        return payloads[-1]["output_ids"], payloads[-1]["meta_info"]["finish_reason"]
    tokens = [t for p in payloads for t in p["choices"][0]["token_ids"]]
    return tokens, payloads[-1]["choices"][0]["finish_reason"]


def _finish(protocol: str, n: int) -> object:
    return {"type": "length", "length": n} if protocol == "sglang" else "length"


def _shed_shape(protocol: str, body: dict) -> str:
    """The shed's message, once its body is checked to be the format's error shape."""
    error = body if protocol == "sglang" else body["error"]
    rest = {k: v for k, v in error.items() if k != "message"}
    want = {"type": "Too Many Requests", "param": None, "code": 429}
    assert rest == ({"object": "error", **want} if protocol == "sglang" else want)
    if protocol == "vllm":
        assert list(body) == ["error"]
    return error["message"]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_burst_past_the_fleets_capacity_answers_each_request_whole_or_sheds_it(fleet, protocol):
    """14 streams at an engine running 2 with 4 queue places: each is
    answered with exactly the uninterrupted run's tokens or shed (429,
    ``Retry-After``, the format's error shape); one record each; the engine
    never ran more than its limit, and admission gave every slot back."""
    sent = 14
    prompts = {f"{protocol}-burst-{i}": [20 + i, 7, 300 + i, 9] for i in range(sent)}
    results: dict[str, tuple] = {}

    def one(rid: str) -> None:
        with httpx.stream("POST", fleet.url + GENERATE[protocol], json=_body(protocol, prompts[rid], 24, rid),
                          timeout=60) as r:
            raw = r.read()
        results[rid] = (r.status_code, r.headers.get("retry-after"), raw)

    threads = [threading.Thread(target=one, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert set(results) == set(prompts), "every request got an answer"
    ok = {rid for rid, (status, _, _) in results.items() if status == 200}
    shed = {rid for rid, (status, _, _) in results.items() if status == 429}
    assert len(ok) + len(shed) == sent and len(ok) >= 2 and shed
    for rid in ok:
        events = [line[6:] for line in results[rid][2].split(b"\n") if line.startswith(b"data: ")]
        assert _answer(protocol, events) == (sampled(prompts[rid], 0, 24, ignore_eos=True), _finish(protocol, 24))
    for rid in shed:
        _, retry_after, raw = results[rid]
        assert retry_after is not None and 1 <= int(retry_after) <= 60
        message = _shed_shape(protocol, orjson.loads(raw))
        assert message.startswith("overloaded: shed from the rollout queue (queue_depth)")
    recs = fleet.take(sent)
    assert set(recs) == set(prompts)
    assert all((recs[rid]["status"], recs[rid]["output_tokens"]) == ("ok", 24) for rid in ok)
    assert all((recs[rid]["status"], recs[rid]["http_status"], recs[rid]["shed_reason"]) == ("shed", 429, "queue_depth")
               for rid in shed)
    capacity = httpx.get(fleet.sims[protocol].url + "/sim/stats", timeout=5).json()["capacity"]
    assert capacity["peak_running"] <= 2 and capacity["queue_refusals"] == 0
    wait_until(lambda: fleet.held(protocol) == 0)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_preempted_stream_resumes_exactly_on_a_capacity_limited_engine(fleet, protocol):
    """The engine runs 2: a long rollout stream and a preemptible bulk
    stream fill it; an eval request preempts the bulk stream (aborted on the
    engine, parked), is answered, and the bulk stream resumes as a migrated
    leg: its client's answer equals an uninterrupted run's, value for value."""
    before = fleet.admission()
    path = GENERATE[protocol]
    blocker, bulk, urgent = [31, 32, 33, 34], [41, 42, 43, 44], [51, 52]
    clients = {}
    for rid, prompt, n, headers in ((f"{protocol}-rollout", blocker, 400, b""),
                                    (f"{protocol}-bulk", bulk, 80, b"x-priority-class: bulk\r\nx-preemptible: 1\r\n")):
        client = RawClient(fleet.url)
        raw = orjson.dumps(_body(protocol, prompt, n, rid))
        client.sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%s"
                            b"content-length: %d\r\n\r\n%s" % (path.encode(), headers, len(raw), raw))
        clients[rid] = (client, client.events(2))
        assert len(clients[rid][1]) == 2
    body = {**_body(protocol, urgent, 3, f"{protocol}-eval"), "stream": False}
    got = post(fleet.url, body, path, headers={"x-priority-class": "eval"}, timeout=30)
    assert got.status_code == 200
    tokens = got.json()["output_ids"] if protocol == "sglang" else got.json()["choices"][0]["token_ids"]
    assert tokens == sampled(urgent, 0, 3, ignore_eos=True)
    for rid, prompt, n in ((f"{protocol}-bulk", bulk, 80), (f"{protocol}-rollout", blocker, 400)):
        client, first = clients[rid]
        events = first + client.events(100000)
        assert _answer(protocol, events) == (sampled(prompt, 0, n, ignore_eos=True), _finish(protocol, n)), rid
    after = fleet.admission()
    assert (after["preemptions"] - before["preemptions"], after["resumed_parked"] - before["resumed_parked"],
            after["parked"]) == (1, 1, 0)
    recs = fleet.take(3)
    assert (recs[f"{protocol}-bulk"]["status"], recs[f"{protocol}-bulk"]["preemptions"],
            recs[f"{protocol}-bulk"]["output_tokens"]) == ("ok", 1, 80)
    assert recs[f"{protocol}-rollout"]["status"] == recs[f"{protocol}-eval"]["status"] == "ok"
    assert "preemptions" not in recs[f"{protocol}-rollout"]
    wait_until(lambda: fleet.held(protocol) == 0)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_preempted_group_member_resumes_alone_exactly(fleet, protocol):
    """A GRPO group of two preemptible streams fills the engine; an eval
    request preempts one member, which waits again alone (its group was
    admitted whole already: it does not wait for a second group to form)
    and resumes exactly: both members' answers equal uninterrupted ones."""
    before = fleet.admission()
    path = GENERATE[protocol]
    prompts = {f"{protocol}-member-{i}": [61 + i, 62, 63, 64] for i in range(2)}
    clients = {}
    for rid, prompt in prompts.items():
        client = RawClient(fleet.url)
        raw = orjson.dumps(_body(protocol, prompt, 80, rid))
        client.sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                            b"x-priority-class: bulk\r\nx-preemptible: 1\r\nx-group-id: grp-%s\r\n"
                            b"x-group-size: 2\r\ncontent-length: %d\r\n\r\n%s"
                            % (path.encode(), protocol.encode(), len(raw), raw))
        clients[rid] = client
    first = {rid: client.events(2) for rid, client in clients.items()}
    assert all(len(events) == 2 for events in first.values())
    body = {**_body(protocol, [71, 72], 3, f"{protocol}-eval-2"), "stream": False}
    got = post(fleet.url, body, path, headers={"x-priority-class": "eval"}, timeout=30)
    assert got.status_code == 200
    for rid, client in clients.items():
        events = first[rid] + client.events(100000)
        assert _answer(protocol, events) == (sampled(prompts[rid], 0, 80, ignore_eos=True), _finish(protocol, 80)), rid
    after = fleet.admission()
    assert (after["preemptions"] - before["preemptions"], after["resumed_parked"] - before["resumed_parked"],
            after["parked_expired"] - before["parked_expired"], after["parked"]) == (1, 1, 0, 0)
    recs = fleet.take(3)
    assert sorted(recs[rid].get("preemptions", 0) for rid in prompts) == [0, 1]
    assert all((recs[rid]["status"], recs[rid]["output_tokens"], recs[rid]["group_id"]) == ("ok", 80, f"grp-{protocol}")
               for rid in prompts)
    wait_until(lambda: fleet.held(protocol) == 0)
