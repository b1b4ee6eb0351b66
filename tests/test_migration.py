"""Mid-stream migration (issue 10): a worker that dies mid-answer costs the
client nothing.

Each fleet is three simulators of one kind (SGLang cumulative, SGLang
incremental, vLLM) behind a frontend with tracing, once per hypercorn worker
class. Failures come from the simulator's fault hook (``POST /sim/faults``):
a fault armed on every simulator for prompts of an exact length fires on
whichever worker gets that leg, so a first leg (the client's prompt) and a
resumed leg (prompt + output so far, a longer prompt) fail exactly where the
test says, whatever the router picks. A fired fault also fails the worker's
health probe, which is what makes the frontend take the broken connection
for a dead worker.
"""

from __future__ import annotations

import glob
import itertools

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from support import PROMPT, RawClient, sse, start_frontend, start_sim, stats, wait_until, without_timing

VARIANTS = ("sglang", "sglang-incremental", "vllm")
GEN = {"sglang": "/generate", "vllm": "/inference/v1/generate"}
_rids = itertools.count()
#: How the frontend's worker client words a stream the worker dropped.
DROPPED = ("worker broke HTTP/1.1: peer closed connection without sending complete message body "
           "(incomplete chunked read)")


class Fleet:
    """Three simulators of ``variant`` behind a traced frontend."""

    def __init__(self, variant: str, worker_class: str, tmp, extra: list[str] = ()) -> None:
        self.variant = variant
        self.protocol = "vllm" if variant == "vllm" else "sglang"
        self.path = GEN[self.protocol]
        self.sims = []
        self.fe = None
        try:
            for _ in range(3):
                self.sims.append(start_sim(self.protocol, incremental=variant == "sglang-incremental"))
            self.base = str(tmp / "trace")
            self.fe = start_frontend(
                [f"{self.protocol}={s.url}" for s in self.sims], worker_class=worker_class,
                extra=["--trace-file", self.base + ".jsonl", *extra],
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.fe is not None:
            self.fe.stop()
        for s in self.sims:
            s.stop()

    def body(self, budget: int, logprobs: bool, rid: str) -> tuple[dict, dict]:
        """A streamed request of ``budget`` tokens (EOS ignored) and its headers."""
        if self.protocol == "sglang":
            body = {"input_ids": PROMPT, "stream": True, "rid": rid,
                    "sampling_params": {"max_new_tokens": budget, "ignore_eos": True}}
            if logprobs:
                body.update(return_logprob=True, top_logprobs_num=2, token_ids_logprob=[5, 9])
            return body, {}
        sp = {"max_tokens": budget, "ignore_eos": True}
        if logprobs:
            sp["logprobs"] = 2
        body = {"token_ids": PROMPT, "stream": True, "sampling_params": sp,
                "stream_options": {"include_usage": True, "continuous_usage_stats": logprobs}}
        return body, {"x-request-id": rid}

    def arm(self, after_tokens: int, input_len: int) -> None:
        for s in self.sims:
            httpx.post(s.url + "/sim/faults", json={"after_tokens": after_tokens, "input_len": input_len},
                       timeout=5).raise_for_status()

    def heal(self) -> None:
        """Disarm every fault; wait until the frontend has all three workers up."""
        for s in self.sims:
            httpx.delete(s.url + "/sim/faults", timeout=5).raise_for_status()
        wait_until(lambda: httpx.get(self.fe.url + "/health", timeout=5).json()["healthy_workers"] == 3)

    def stream(self, body: dict, headers: dict) -> list[bytes]:
        status, events = sse(self.fe.url, body, self.path, headers=headers)
        assert status == 200
        return events

    def record(self, rid: str) -> dict:
        def find():
            for f in glob.glob(self.base + ".*.jsonl"):
                with open(f, "rb") as fh:
                    for line in fh:
                        rec = orjson.loads(line)
                        if rec.get("public_id") == rid:
                            return rec
            return None
        return wait_until(find)


@pytest.fixture(scope="module", params=[(v, c) for v in VARIANTS for c in ("trio", "asyncio")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def fleet(request, tmp_path_factory):
    variant, worker_class = request.param
    f = Fleet(variant, worker_class, tmp_path_factory.mktemp(f"mig-{variant}-{worker_class}"))
    yield f
    f.stop()


def _values(events: list[bytes]) -> list:
    """The answer's values, timing excepted."""
    return [without_timing(orjson.loads(e)) if e != b"[DONE]" else e for e in events]


def _migrated(fleet: Fleet, budget: int, logprobs: bool, fails: list[int]) -> tuple[list, list, dict]:
    """Run one request uninterrupted, then with a failure after each
    ``fails[k]`` tokens of leg ``k``; return both answers and the record."""
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(budget, logprobs, rid)
    reference = fleet.stream(body, headers)
    fleet.record(rid)
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(budget, logprobs, rid)
    at = len(PROMPT)
    for t in fails:
        fleet.arm(t, at)
        at += t
    try:
        got = fleet.stream(body, headers)
        rec = fleet.record(rid)
    finally:
        fleet.heal()
    return _values(reference), _values(got), rec


def _check_law(fleet: Fleet, budget: int, logprobs: bool, fails: list[int]) -> None:
    reference, got, rec = _migrated(fleet, budget, logprobs, fails)
    if fleet.protocol == "sglang":
        for e in got[:-1]:
            e["meta_info"]["id"] = reference[0]["meta_info"]["id"]  # the two runs' rids
    else:
        for e in got[:-1]:
            e["request_id"] = reference[0]["request_id"]
    assert got == reference
    n = len(fails)
    assert (rec["status"], rec["output_tokens"], rec.get("migrations")) == ("ok", budget, n)
    assert [a["role"] for a in rec["attempts"]] == ["aggregated"] + ["resumed"] * n
    assert [a["outcome"] for a in rec["attempts"]] == ["worker_lost"] * n + ["finished"]
    assert [a.get("tokens", 0) for a in rec["attempts"]] == [*fails, budget - sum(fails)]
    assert len({a["worker_id"] for a in rec["attempts"]}) == n + 1
    assert len({a["engine_id"] for a in rec["attempts"]}) == n + 1
    assert all("abort_acked" in a for a in rec["attempts"][:-1])


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), budget=st.integers(2, 12), logprobs=st.booleans())
def test_law_any_failure_point(fleet, data, budget, logprobs):
    """For a failure after any T in [1, budget - 1] tokens (and sometimes a
    second one on the resumed leg), the client's answer equals the
    uninterrupted answer value for value, and the record lists every leg."""
    first = data.draw(st.integers(1, budget - 1), label="T")
    fails = [first]
    if budget - first > 1 and data.draw(st.booleans(), label="second failure"):
        fails.append(data.draw(st.integers(1, budget - first - 1), label="T2"))
    _check_law(fleet, budget, logprobs, fails)


@pytest.mark.parametrize("budget,fails", [(8, [1]), (8, [7]), (8, [3, 4]), (256, [255])],
                         ids=["T=1", "T=budget-1", "two-failures", "256-tokens"])
def test_law_explicit_points(fleet, budget, fails):
    """Explicit failure points; a 256-token answer cut after 255 is recorded
    as 256 tokens (one counter, the client's: a retiring attempt writes none)."""
    _check_law(fleet, budget, True, fails)


def test_failure_before_the_first_token_is_a_failover(fleet):
    """T = 0 (headers, then the connection drops): nothing reached the client,
    so the prompt simply runs elsewhere; no migration is counted."""
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(5, True, rid)
    reference = _values(fleet.stream(body, headers))
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(5, True, rid)
    for s in fleet.sims[:2]:  # two of three: whichever is picked first, one fails
        httpx.post(s.url + "/sim/faults", json={"after_tokens": 0}, timeout=5).raise_for_status()
    try:
        got = _values(fleet.stream(body, headers))
        rec = fleet.record(rid)
        fired = sum(stats(s)["faults_fired"] for s in fleet.sims)
    finally:
        fleet.heal()
    key = "meta_info" if fleet.protocol == "sglang" else None
    for e in got[:-1]:
        if key:
            e[key]["id"] = reference[0][key]["id"]
        else:
            e["request_id"] = reference[0]["request_id"]
    assert got == reference
    assert "migrations" not in rec and rec["status"] == "ok"
    assert [a["role"] for a in rec["attempts"]] == ["aggregated"] * len(rec["attempts"])
    assert len(rec["attempts"]) - 1 == [a["outcome"] for a in rec["attempts"]].count("worker_lost") <= fired


def _in_band(fleet: Fleet, message: str) -> bytes:
    """The exact in-band error payload of a 502 in ``fleet``'s format."""
    from asgi_generate.codec import RequestError
    from asgi_generate.registry import load_codecs

    codec = next(c.codec for c in load_codecs() if c.codec.name == fleet.protocol)
    return codec.in_band_error(RequestError(502, message, "engine"))


def _failed_once(fleet: Fleet, body: dict, headers: dict, rid: str, after: int = 2) -> tuple[list[bytes], dict]:
    fleet.arm(after, len(PROMPT))
    try:
        events = fleet.stream(body, headers)
        rec = fleet.record(rid)
    finally:
        fleet.heal()
    return events, rec


def test_constrained_decoding_is_not_migrated(fleet):
    """Constrained decoding (SGLang ``regex``, vLLM ``structured_outputs``):
    the broken stream ends with today's in-band error; no second attempt."""
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(6, False, rid)
    if fleet.protocol == "sglang":
        body["sampling_params"]["regex"] = "[a-z ]*"
    else:
        body["sampling_params"]["structured_outputs"] = {"regex": "[a-z ]*"}
    events, rec = _failed_once(fleet, body, headers, rid)
    wid = rec["attempts"][0]["worker_id"]
    message = f"worker {wid} failed: {DROPPED}"
    assert events[-2:] == [_in_band(fleet, message), b"[DONE]"]
    assert len(events) == 4
    assert (rec["status"], rec["error"]["message"], rec["output_tokens"]) == ("engine_error", message, 2)
    assert [(a["role"], a["outcome"], a.get("tokens")) for a in rec["attempts"]] == [("aggregated", "worker_lost", 2)]
    assert "migrations" not in rec


def test_no_worker_left_ends_in_band_with_every_attempt(fleet):
    """Every worker fails in turn: after two migrations no worker is left,
    so the last failure is the answer: the format's in-band error and the
    terminal marker."""
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(9, False, rid)
    for at, after in ((4, 2), (6, 3), (9, 1)):
        fleet.arm(after, at)
    try:
        events = fleet.stream(body, headers)
        rec = fleet.record(rid)
    finally:
        fleet.heal()
    message = f"worker {rec['attempts'][2]['worker_id']} failed: {DROPPED}"
    assert events[-2:] == [_in_band(fleet, message), b"[DONE]"]
    assert (rec["status"], rec["error"], rec["output_tokens"], rec["migrations"]) == (
        "engine_error", {"type": "engine", "message": message}, 6, 2)
    assert [(a["role"], a["outcome"], a.get("tokens")) for a in rec["attempts"]] == [
        ("aggregated", "worker_lost", 2), ("resumed", "worker_lost", 3), ("resumed", "worker_lost", 1)]


def test_engine_refusal_is_not_migrated(fleet):
    """An engine that refuses the request itself (SGLang: in-band value
    error; vLLM: 400) is answered as today, with one attempt."""
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(4, False, rid)
    body["sampling_params"]["min_p"] = 2.0
    status, events = sse(fleet.fe.url, body, fleet.path, headers=headers)
    rec = fleet.record(rid)
    if fleet.protocol == "sglang":
        assert status == 200 and events[-1] == b"[DONE]" and "error" in orjson.loads(events[0])
    else:
        assert status == 400
    assert rec["status"] in ("engine_error", "rejected") and len(rec["attempts"]) == 1
    assert "migrations" not in rec


def test_client_disconnect_is_not_migrated(fleet):
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(30000, False, rid)
    client = RawClient(fleet.fe.url)
    if fleet.protocol == "vllm":
        body["request_id"] = rid
    client.send(orjson.dumps(body), path=fleet.path)
    assert len(client.events(2)) == 2
    client.close()
    rec = fleet.record(rid)
    assert rec["status"] == "client_disconnect"
    assert [(a["role"], a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [("aggregated", "aborted", True)]
    assert "migrations" not in rec


@pytest.fixture(scope="module")
def limited(fleet, tmp_path_factory):
    """A second frontend over the same simulators with ``--migration-limit 1``."""
    base = str(tmp_path_factory.mktemp("limited") / "trace")
    proc = start_frontend([f"{fleet.protocol}={s.url}" for s in fleet.sims],
                          extra=["--trace-file", base + ".jsonl", "--migration-limit", "1"])
    yield proc, base
    proc.stop()


def test_limit_exhausted_ends_in_band_with_every_attempt(fleet, limited):
    proc, base = limited
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(8, True, rid)
    fleet.arm(3, 4)
    fleet.arm(2, 7)
    try:
        status, events = sse(proc.url, body, fleet.path, headers=headers)
        view = Fleet.__new__(Fleet)
        view.base = base
        rec = view.record(rid)
    finally:
        fleet.heal()
        wait_until(lambda: httpx.get(proc.url + "/health", timeout=5).json()["healthy_workers"] == 3)
    wid = rec["attempts"][1]["worker_id"]
    message = f"worker {wid} failed: {DROPPED} (migration limit 1 reached)"
    assert status == 200 and events[-2:] == [_in_band(fleet, message), b"[DONE]"]
    assert (rec["status"], rec["error"]["message"], rec["output_tokens"], rec["migrations"]) == (
        "engine_error", message, 5, 1)
    assert [(a["role"], a["outcome"], a.get("tokens")) for a in rec["attempts"]] == [
        ("aggregated", "worker_lost", 3), ("resumed", "worker_lost", 2)]


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_silence_past_the_inter_token_timeout_migrates(worker_class, tmp_path):
    """A worker that sends one token and then only comments is slow, not
    dead: it stays up, its leg is aborted, and the stream continues on
    another worker from the token it did send."""
    from test_engine_timing import STREAM, FakeWorker

    sim = start_sim("sglang")
    try:
        with FakeWorker("stall") as fake:
            fe = start_frontend([f"sglang={fake.url}", f"sglang={sim.url}"], worker_class=worker_class,
                                extra=["--inter-token-timeout", "0.5", "--trace-file", str(tmp_path / "t.jsonl")])
            try:
                for sent in (1, 2):  # the router may pick the simulator first
                    status, events = sse(fe.url, STREAM)
                    assert status == 200
                    if fake.generates:
                        break
                base = str(tmp_path / "t")
                recs = wait_until(lambda: len(r := _all_records(base)) >= sent and r)
                wait_until(lambda: fake.aborts == fake.generates)
            finally:
                fe.stop()
        resumed = {**STREAM, "input_ids": [11, 12, 13, 5], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
        _, direct = sse(sim.url, resumed)
    finally:
        sim.stop()
    assert len(fake.generates) == 1
    rec = recs[-1]
    expected = [{"text": "a", "output_ids": [5],
                 "meta_info": {"id": "mine", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 1}}]
    for e in _values(direct)[:-1]:
        meta = e["meta_info"]
        meta.update(prompt_tokens=3, completion_tokens=1 + meta["completion_tokens"])
        if meta["finish_reason"] is not None:
            meta["finish_reason"]["length"] = 6
        expected.append({"text": "a" + e["text"], "output_ids": [5, *e["output_ids"]], "meta_info": meta})
    assert _values(events) == [*expected, b"[DONE]"]
    assert (rec["status"], rec["output_tokens"], rec["migrations"]) == ("ok", 6, 1)
    assert [(a["role"], a["outcome"], a.get("tokens"), a.get("abort_acked")) for a in rec["attempts"]] == [
        ("aggregated", "timeout", 1, True), ("resumed", "finished", 5, None)]


def _all_records(base: str) -> list[dict]:
    return [orjson.loads(line) for f in sorted(glob.glob(base + ".*.jsonl")) for line in open(f, "rb")]
