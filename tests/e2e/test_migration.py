"""Mid-stream migration: a worker that dies mid-answer costs the
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

import itertools

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from support import (
    PROMPT,
    post,
    RawClient,
    sse,
    start_frontend,
    start_sim,
    stats,
    trace_records,
    wait_until,
    without_timing,
)

from asgi_generate.assets import TOKENIZER_PATH

pytestmark = pytest.mark.e2e

VARIANTS = ("sglang", "sglang-incremental", "vllm")
GEN = {"sglang": "/generate", "vllm": "/inference/v1/generate"}
_rids = itertools.count()
#: How the frontend's worker client words a stream the worker dropped.
DROPPED = ("worker broke HTTP/1.1: peer closed connection without sending complete message body "
           "(incomplete chunked read)")


def _lost(worker_id: str, why: str, rec: dict) -> str:
    """The exact message of a stream whose worker a fault dropped, ``why``
    the frontend went no further: the fault drops the stream and makes the
    worker's health answer 503 at once, so the leg's read or the health
    probe notices first (as when an engine dies); the record names which."""
    options = [f"worker {worker_id} failed: {DROPPED} ({why})", f"worker {worker_id} lost: health answered 503 ({why})"]
    assert rec["error"]["message"] in options
    return rec["error"]["message"]


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
                sim_extra = ["--enable-return-routed-experts"] if variant == "vllm" else []
                self.sims.append(start_sim(self.protocol, incremental=variant == "sglang-incremental",
                                           extra=sim_extra))
            self.base = str(tmp / "trace")
            self.fe = start_frontend(
                [f"{self.protocol}={s.url}" for s in self.sims], worker_class=worker_class,
                extra=["--trace-file", self.base + ".jsonl", "--tokenizer", str(TOKENIZER_PATH), *extra],
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.fe is not None:
            self.fe.stop()
        for s in self.sims:
            s.stop()

    def body(self, budget: int, logprobs: bool, rid: str, experts: bool = False) -> tuple[dict, dict]:
        """:func:`_body` in this fleet's protocol."""
        return _body(self.protocol, budget, logprobs, rid, experts)

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
        return _record(self.base, rid)


def _body(protocol: str, budget: int, logprobs: bool, rid: str, experts: bool = False) -> tuple[dict, dict]:
    """A streamed request of ``budget`` tokens (EOS ignored) and its
    headers; SGLang: with ``experts``, routed experts from position 1."""
    if protocol == "sglang":
        body = {"input_ids": PROMPT, "stream": True, "rid": rid,
                "sampling_params": {"max_new_tokens": budget, "ignore_eos": True}}
        if logprobs:
            body.update(return_logprob=True, top_logprobs_num=2, token_ids_logprob=[5, 9])
        if experts:
            body.update(return_routed_experts=True, routed_experts_start_len=1)
        return body, {}
    sp = {"max_tokens": budget, "ignore_eos": True}
    if logprobs:
        sp["logprobs"] = 2
    body = {"token_ids": PROMPT, "stream": True, "sampling_params": sp,
            "stream_options": {"include_usage": True, "continuous_usage_stats": logprobs}}
    return body, {"x-request-id": rid}


def _record(base: str, rid: str) -> dict:
    """The record of public id ``rid`` in the trace files ``base.*.jsonl``, once written."""
    return wait_until(lambda: next((r for r in trace_records(base + ".*.jsonl") if r.get("public_id") == rid), None))


class Beside:
    """A second traced frontend over a fleet's simulators, with ``extra`` flags."""

    def __init__(self, fleet: Fleet, tmp, extra: list[str]) -> None:
        self.fleet = fleet
        self.base = str(tmp / "trace")
        self.proc = start_frontend([f"{fleet.protocol}={s.url}" for s in fleet.sims],
                                   extra=["--trace-file", self.base + ".jsonl", *extra])

    def faulted(self, body: dict, headers: dict, rid: str) -> tuple[int, list[bytes], dict]:
        """Stream ``body`` through this frontend (its faults armed by the
        caller): its status, events and record. Then heal the fleet and wait
        until this frontend has every worker up again."""
        try:
            status, events = sse(self.proc.url, body, self.fleet.path, headers=headers)
            rec = _record(self.base, rid)
        finally:
            self.fleet.heal()
            wait_until(lambda: httpx.get(self.proc.url + "/health", timeout=5).json()["healthy_workers"] == 3)
        return status, events, rec


FLEETS = [(v, c) for v in VARIANTS for c in ("trio", "asyncio")]
#: The fleets of the text-only laws (vLLM's native route takes and answers
#: token ids only); a prefix of FLEETS, so a test parametrized with them
#: shares the module's fleets.
SGLANG_FLEETS = [f for f in FLEETS if f[0] != "vllm"]


def _fleet_id(fleet: tuple[str, str]) -> str:
    return f"{fleet[0]}-{fleet[1]}"


@pytest.fixture(scope="module", params=FLEETS, ids=_fleet_id)
def fleet(request, tmp_path_factory):
    variant, worker_class = request.param
    f = Fleet(variant, worker_class, tmp_path_factory.mktemp(f"mig-{variant}-{worker_class}"))
    yield f
    f.stop()


def _values(events: list[bytes]) -> list:
    """The answer's values, timing excepted."""
    return [without_timing(orjson.loads(e)) if e != b"[DONE]" else e for e in events]


def _migrated(fleet: Fleet, budget: int, logprobs: bool, fails: list[int],
              experts: bool = False) -> tuple[list, list, dict]:
    """Run one request uninterrupted, then with a failure after each
    ``fails[k]`` tokens of leg ``k``; return both answers and the record."""
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(budget, logprobs, rid, experts)
    reference = fleet.stream(body, headers)
    fleet.record(rid)
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(budget, logprobs, rid, experts)
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


def _check_law(fleet: Fleet, budget: int, logprobs: bool, fails: list[int], experts: bool = False) -> None:
    reference, got, rec = _migrated(fleet, budget, logprobs, fails, experts)
    if experts and fleet.protocol == "sglang":
        assert "routed_experts" in reference[-2]["meta_info"]
    elif experts:  # vLLM: on the finishing chunk (the simulator runs --enable-return-routed-experts)
        finishing = [e for e in reference[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
        assert finishing[0]["choices"][0]["routed_experts"]
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
    # The backoff: 50 ms before the first resumed leg, doubling.
    assert [a.get("backoff_ms", 0) for a in rec["attempts"]] == [0, 50, 100, 200][: n + 1]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), budget=st.integers(2, 12), logprobs=st.booleans())
def test_law_any_failure_point(fleet, data, budget, logprobs):
    """For a failure after any T in [1, budget - 1] tokens (and sometimes a
    second one on the resumed leg), the client's answer equals the
    uninterrupted answer value for value, and the record lists every leg;
    SGLang answers with routed experts too (the resumed leg keeps the
    client's ``routed_experts_start_len``: its rows are the whole answer's)."""
    first = data.draw(st.integers(1, budget - 1), label="T")
    fails = [first]
    if budget - first > 1 and data.draw(st.booleans(), label="second failure"):
        fails.append(data.draw(st.integers(1, budget - first - 1), label="T2"))
    experts = fleet.protocol == "sglang" and data.draw(st.booleans(), label="routed experts")
    _check_law(fleet, budget, logprobs, fails, experts)


@pytest.mark.parametrize("budget,fails,logprobs", [(8, [1], True), (8, [7], True), (8, [3, 4], True),
                                                   (256, [255], False)],
                         ids=["T=1", "T=budget-1", "two-failures", "256-tokens"])
def test_law_explicit_points(fleet, budget, fails, logprobs):
    """Explicit failure points; a 256-token answer cut after 255 is recorded
    as 256 tokens (one counter, the client's: a retiring attempt writes
    none). Its logprobs are left out: a late seam's logprobs are
    ``T=budget-1``'s, and SGLang's cumulative logprobs would make the long
    answer's events O(n^2) bytes for nothing more."""
    _check_law(fleet, budget, logprobs, fails)


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
    from asgi_generate.sdk._codec import RequestError
    from asgi_generate.sdk._registry import load_codecs
    from asgi_generate.protocols import PROTOCOLS

    codec = next(c.codec for c in load_codecs(protocols=PROTOCOLS) if c.codec.name == fleet.protocol)
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
    """Constrained decoding (SGLang ``regex``, vLLM's older
    ``guided_decoding``, which the simulator ignores, where the
    ``structured_outputs`` of today is refused by a ``--tokens-only``
    server): the broken stream ends with today's in-band error; no second
    attempt."""
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(6, False, rid)
    if fleet.protocol == "sglang":
        body["sampling_params"]["regex"] = "[a-z ]*"
    else:
        body["sampling_params"]["guided_decoding"] = {"regex": "[a-z ]*"}
    events, rec = _failed_once(fleet, body, headers, rid)
    wid = rec["attempts"][0]["worker_id"]
    message = _lost(wid, "not migrated: constrained decoding cannot be resumed exactly", rec)
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
    message = _lost(rec["attempts"][2]["worker_id"], "migration impossible: no worker left to resume on", rec)
    assert events[-2:] == [_in_band(fleet, message), b"[DONE]"]
    assert (rec["status"], rec["error"], rec["output_tokens"], rec["migrations"]) == (
        "engine_error", {"type": "engine", "message": message}, 6, 2)
    assert [(a["role"], a["outcome"], a.get("tokens"), a.get("backoff_ms")) for a in rec["attempts"]] == [
        ("aggregated", "worker_lost", 2, None), ("resumed", "worker_lost", 3, 50), ("resumed", "worker_lost", 1, 100)]


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
    second = Beside(fleet, tmp_path_factory.mktemp("limited"), ["--migration-limit", "1"])
    yield second
    second.proc.stop()


def test_limit_exhausted_ends_in_band_with_every_attempt(fleet, limited):
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(8, True, rid)
    fleet.arm(3, 4)
    fleet.arm(2, 7)
    status, events, rec = limited.faulted(body, headers, rid)
    wid = rec["attempts"][1]["worker_id"]
    message = _lost(wid, "migration limit 1 reached", rec)
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
    from fakes import STREAM, FakeWorker

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
        expected = _stalled_and_continued(sim)
    finally:
        sim.stop()
    assert len(fake.generates) == 1
    rec = recs[-1]
    assert _values(events) == expected
    assert (rec["status"], rec["output_tokens"], rec["migrations"]) == ("ok", 6, 1)
    assert [(a["role"], a["outcome"], a.get("tokens"), a.get("abort_acked")) for a in rec["attempts"]] == [
        ("aggregated", "timeout", 1, True), ("resumed", "finished", 5, None)]


def _all_records(base: str) -> list[dict]:
    return trace_records(base + ".*.jsonl")


def _stalled_and_continued(sim) -> list:
    """What the client of the stall fake's request gets once it migrates to
    ``sim``: the fake's one token (``[5]``), then the simulator's own stream
    of ``[11, 12, 13]`` + ``[5]`` (5 tokens left) as the continuation of the
    first (ids, text, counts and the length finish over all 6 tokens)."""
    from fakes import STREAM

    resumed = {**STREAM, "input_ids": [11, 12, 13, 5], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    expected = [{"text": "a", "output_ids": [5],
                 "meta_info": {"id": "mine", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 1}}]
    for e in _values(sse(sim.url, resumed)[1])[:-1]:
        meta = e["meta_info"]
        meta.update(prompt_tokens=3, completion_tokens=1 + meta["completion_tokens"])
        if meta["finish_reason"] is not None:
            meta["finish_reason"]["length"] = 6
        expected.append({"text": "a" + e["text"], "output_ids": [5, *e["output_ids"]], "meta_info": meta})
    return [*expected, b"[DONE]"]


def test_routed_experts_rows_equal_the_uninterrupted_rows(fleet):
    """Routed experts (SGLang ``return_routed_experts``; vLLM
    ``--enable-return-routed-experts``, rows of every forwarded position):
    a resumed answer's final rows are the uninterrupted rows, none
    duplicated or missing (two failures)."""
    _check_law(fleet, 9, True, [3, 2], experts=True)


def _next_sim(fleet: Fleet) -> int:
    """Which simulator the router picks next: every worker is idle, so the
    pick goes round-robin after the last request's worker."""
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(1, False, rid)
    fleet.stream(body, headers)
    return (int(fleet.record(rid)["attempts"][0]["worker_id"][1:]) + 1) % 3


def _unary(fleet: Fleet, budget: int, rid: str) -> tuple[dict, dict]:
    body, headers = fleet.body(budget, True, rid)
    body["stream"] = False
    if fleet.protocol == "vllm":
        body.pop("stream_options")
        body["sampling_params"]["prompt_logprobs"] = 1
    return body, headers


def test_unary_request_is_replayed_from_scratch(fleet):
    """A unary leg shows no tokens before its answer, and a streamed leg
    would cost it over twice the CPU (bench/bench_unary_leg.py), so a unary
    request whose worker dies mid-answer runs again from scratch on another
    worker (role ``replayed``, counted in ``replays``, after the backoff):
    the answer is the uninterrupted one, SGLang ``meta_info`` and vLLM
    ``usage`` and ``prompt_logprobs`` included."""
    rid = f"m{next(_rids)}"
    body, headers = _unary(fleet, 6, rid)
    reference = post(fleet.fe.url, body, fleet.path, headers=headers)
    assert reference.status_code == 200
    fleet.record(rid)
    doomed = fleet.sims[_next_sim(fleet)]
    fired = stats(doomed)["faults_fired"]
    httpx.post(doomed.url + "/sim/faults", json={"after_tokens": 3, "input_len": len(PROMPT)},
               timeout=5).raise_for_status()
    rid = f"m{next(_rids)}"
    body, headers = _unary(fleet, 6, rid)
    try:
        got = post(fleet.fe.url, body, fleet.path, headers=headers)
        rec = fleet.record(rid)
        assert stats(doomed)["faults_fired"] == fired + 1
    finally:
        fleet.heal()
    assert got.status_code == 200
    want, have = without_timing(reference.json()), without_timing(got.json())
    if fleet.protocol == "sglang":
        want["meta_info"]["id"] = have["meta_info"]["id"]
    else:  # vLLM answers a unary request with the engine's own id
        want["request_id"] = have["request_id"]
        want["created"] = have["created"]
    assert have == want
    assert (rec["status"], rec["output_tokens"], rec.get("replays"), rec.get("migrations")) == ("ok", 6, 1, None)
    assert [(a["role"], a["outcome"], a.get("backoff_ms")) for a in rec["attempts"]] == [
        ("aggregated", "worker_lost", None), ("replayed", "finished", 50)]


def test_a_crash_looping_fleet_backs_off_and_the_limit_holds(fleet, limited):
    """Every worker drops every request after one token: the request backs
    off before each new leg, tries each worker once, and under
    ``--migration-limit 1`` stops after one resumed leg with the limit's
    in-band error; the workers saw exactly two legs."""
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(8, False, rid)
    fired = sum(stats(s)["faults_fired"] for s in fleet.sims)
    for s in fleet.sims:
        httpx.post(s.url + "/sim/faults", json={"count": 50, "after_tokens": 1}, timeout=5).raise_for_status()
    status, events, rec = limited.faulted(body, headers, rid)
    fired = sum(stats(s)["faults_fired"] for s in fleet.sims) - fired
    message = _lost(rec["attempts"][1]["worker_id"], "migration limit 1 reached", rec)
    assert status == 200 and events[-2:] == [_in_band(fleet, message), b"[DONE]"]
    assert fired == 2
    assert (rec["status"], rec["output_tokens"], rec["migrations"]) == ("engine_error", 2, 1)
    assert [(a["role"], a.get("tokens"), a.get("backoff_ms")) for a in rec["attempts"]] == [
        ("aggregated", 1, None), ("resumed", 1, 50)]


@pytest.fixture(scope="module")
def plain(fleet, tmp_path_factory):
    """A frontend over the same simulators without ``--tokenizer``."""
    second = Beside(fleet, tmp_path_factory.mktemp("plain"), [])
    yield second
    second.proc.stop()


def _sglang_cut(fleet: Fleet, body: dict, seam: int, prompt_len: int) -> tuple[list, list, dict]:
    """SGLang: ``body`` streamed uninterrupted, then again (a new rid) with
    its first worker dropping it after ``seam`` tokens; returns both
    answers' values (ids aligned) and the second one's record."""
    reference = _values(fleet.stream(body, {}))
    body["rid"] = rid = f"m{next(_rids)}"
    fleet.arm(seam, prompt_len)
    try:
        got = _values(fleet.stream(body, {}))
        rec = fleet.record(rid)
    finally:
        fleet.heal()
    for e in got[:-1]:
        e["meta_info"]["id"] = reference[0]["meta_info"]["id"]
    return reference, got, rec


def _straddling_stop(fleet: Fleet, budget: int, seam: int) -> str:
    """A stop string made of the end of output token ``seam - 1``'s text
    and the start of token ``seam``'s, so that it straddles a seam after
    ``seam`` tokens."""
    from asgi_generate.sim.tokenizer import SimTokenizer

    rid = f"m{next(_rids)}"
    body, headers = fleet.body(budget, False, rid)
    chunks = [orjson.loads(e)["output_ids"] for e in fleet.stream(body, headers)[:-1]]
    ids = [t for c in chunks for t in c] if fleet.variant == "sglang-incremental" else chunks[-1]
    tok = SimTokenizer()
    before, after = tok.decode(ids[:seam]), tok.decode(ids[: seam + 1])
    stop = before[-2:] + after[len(before):][:2]
    assert len(stop) >= 2 and tok.decode(ids[:seam - 1]).find(stop) < 0
    return stop


@pytest.mark.parametrize("trim", [True, False], ids=["trimmed", "no_stop_trim"])
@pytest.mark.parametrize("fleet", SGLANG_FLEETS, indirect=True, ids=_fleet_id)
def test_stop_string_across_the_seam_stops_as_uninterrupted(fleet, plain, trim):
    """A stop string begun before the seam and completed after it: the
    engine of the resumed leg cannot see it, the frontend (``--tokenizer``)
    does, and ends the answer exactly where the uninterrupted engine did
    (the resumed leg is aborted). Without a tokenizer the request is not
    migrated: today's in-band error, ``not_migrated`` in the record and
    ``/stats``."""
    seam = 4
    stop = _straddling_stop(fleet, 12, seam)
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(12, True, rid)
    body["sampling_params"].update(stop=[stop], no_stop_trim=not trim)
    reference, got, rec = _sglang_cut(fleet, body, seam, len(PROMPT))
    assert reference[-2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert reference[-2]["meta_info"]["completion_tokens"] == seam + 1
    assert got == reference
    assert (rec["status"], rec["output_tokens"], rec["migrations"]) == ("ok", seam + 1, 1)
    assert [(a["role"], a["outcome"], a.get("tokens")) for a in rec["attempts"]] == [
        ("aggregated", "worker_lost", seam), ("resumed", "aborted", 1)]
    assert rec["attempts"][1]["abort_acked"] is True  # the frontend ended it: aborted at the engine

    rid = f"m{next(_rids)}"
    body["rid"] = rid
    before = httpx.get(plain.proc.url + "/stats", timeout=5).json()["not_migrated"]
    fleet.arm(seam, len(PROMPT))
    status, events, rec = plain.faulted(body, {}, rid)
    message = _lost(rec["attempts"][0]["worker_id"],
                    "not migrated: a stop string could straddle the seam (no --tokenizer to check it)", rec)
    assert status == 200 and events[-2:] == [_in_band(fleet, message), b"[DONE]"] and len(events) == seam + 2
    assert (rec["status"], rec["output_tokens"], rec["not_migrated"]) == (
        "engine_error", seam, "a stop string could straddle the seam (no --tokenizer to check it)")
    assert httpx.get(plain.proc.url + "/stats", timeout=5).json()["not_migrated"] == before + 1


@pytest.mark.parametrize("fleet", SGLANG_FLEETS, indirect=True, ids=_fleet_id)
def test_text_prompt_migrates_with_a_tokenizer_only(fleet, plain):
    """A text prompt resumes as its token ids, tokenized as SGLang does
    (special tokens added by the tokenizer's post-processor, specials in
    the text parsed): the answer equals the uninterrupted one. Without
    ``--tokenizer`` it ends with today's in-band error, counted."""
    from asgi_generate.sdk._text import PromptTokenizer

    text = "<|im_start|>user\nHello there<|im_end|>"
    length = len(PromptTokenizer(str(TOKENIZER_PATH)).encode(text))
    rid = f"m{next(_rids)}"
    body, headers = fleet.body(7, True, rid)
    del body["input_ids"]
    body["text"] = text
    reference, got, rec = _sglang_cut(fleet, body, 3, length)
    assert reference[-2]["meta_info"]["prompt_tokens"] == length
    assert got == reference
    assert (rec["status"], rec["output_tokens"], rec["migrations"]) == ("ok", 7, 1)

    rid = f"m{next(_rids)}"
    body["rid"] = rid
    fleet.arm(3, length)
    status, events, rec = plain.faulted(body, {}, rid)
    message = _lost(rec["attempts"][0]["worker_id"], "not migrated: a text prompt needs --tokenizer to resume", rec)
    assert status == 200 and events[-2:] == [_in_band(fleet, message), b"[DONE]"]
    assert (rec["status"], rec["output_tokens"], rec["not_migrated"]) == (
        "engine_error", 3, "a text prompt needs --tokenizer to resume")


_PLAIN: dict[str, list[int]] = {}


def _plain_ids(fleet: Fleet) -> list[int]:
    """The model's output for PROMPT, 12 tokens, no stop: its prefix is every
    shorter answer's (the simulator's output depends on the prefix only)."""
    if fleet.variant not in _PLAIN:
        rid = f"m{next(_rids)}"
        body, headers = fleet.body(12, False, rid)
        body["stream"] = False
        body.pop("stream_options", None)
        answer = post(fleet.fe.url, body, fleet.path, headers=headers).json()
        _PLAIN[fleet.variant] = answer["output_ids"] if fleet.protocol == "sglang" else answer["choices"][0]["token_ids"]
    return _PLAIN[fleet.variant]


def _answer(fleet: Fleet, body: dict, headers: dict, unary: bool) -> tuple[list, int]:
    """The answer's values (ids and timing left out) and its output tokens."""
    if unary:
        resp = post(fleet.fe.url, body, fleet.path, headers=headers)
        v = without_timing(resp.json())
        if fleet.protocol == "sglang":
            v["meta_info"].pop("id")
            return [resp.status_code, v], len(v["output_ids"])
        v.pop("request_id"), v.pop("created")
        return [resp.status_code, v], sum(len(c["token_ids"]) for c in v["choices"])
    values = _values(fleet.stream(body, headers))
    for v in values[:-1]:
        (v["meta_info"] if fleet.protocol == "sglang" else v).pop("id" if fleet.protocol == "sglang" else "request_id")
    if fleet.variant == "sglang":
        n = len(values[-2]["output_ids"])
    elif fleet.variant == "sglang-incremental":
        n = sum(len(v["output_ids"]) for v in values[:-1])
    else:
        n = sum(len(v["choices"][0]["token_ids"]) for v in values[:-1] if v.get("choices"))
    return values, n


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), budget=st.integers(2, 12))
def test_law_with_stops_top_k_and_unary(fleet, data, budget):
    """The law over more of the request space: unary (replayed from scratch,
    T from 0) or SSE (resumed, T from 1), top-k logprobs, a stop token, an
    SGLang stop string (checked across the seam with ``--tokenizer``), one
    or two failures anywhere before the answer ends: the client's answer
    equals the uninterrupted answer value for value."""
    from asgi_generate.sim.tokenizer import SimTokenizer

    unary = data.draw(st.booleans(), label="unary")
    rid = f"m{next(_rids)}"
    body, headers = _unary(fleet, budget, rid) if unary else fleet.body(budget, False, rid)
    k = data.draw(st.sampled_from([0, 1, 3]), label="top-k")
    if k and fleet.protocol == "sglang":
        body.update(return_logprob=True, top_logprobs_num=k)
    elif k:
        body["sampling_params"]["logprobs"] = k
    ids = _plain_ids(fleet)
    if data.draw(st.booleans(), label="stop token"):
        body["sampling_params"]["stop_token_ids"] = [ids[data.draw(st.integers(0, budget - 1), label="at")]]
    if fleet.protocol == "sglang" and data.draw(st.booleans(), label="stop string"):
        text = SimTokenizer().decode(ids[:budget])
        at = data.draw(st.integers(0, max(0, len(text) - 2)), label="string at")
        if text[at:at + 2].strip():
            body["sampling_params"]["stop"] = [text[at:at + 2]]
    reference, n = _answer(fleet, body, headers, unary)
    if n < (1 if unary else 2):
        return  # the answer ends before any failure point
    first = data.draw(st.integers(0 if unary else 1, n - 1), label="T")
    fails = [first]
    if n - first > 1 and data.draw(st.booleans(), label="second failure"):
        fails.append(data.draw(st.integers(0 if unary else 1, n - first - 1 if not unary else n - 1), label="T2"))
    rid = f"m{next(_rids)}"
    if fleet.protocol == "sglang":
        body["rid"] = rid
    else:
        headers["x-request-id"] = rid
    if unary:  # the replay has the same prompt: arm the workers it will meet, in router order
        nxt = _next_sim(fleet)
        for j, t in enumerate(fails):
            httpx.post(fleet.sims[(nxt + j) % 3].url + "/sim/faults", json={"after_tokens": t, "input_len": len(PROMPT)},
                       timeout=5).raise_for_status()
    else:
        at = len(PROMPT)
        for t in fails:
            fleet.arm(t, at)
            at += t
    try:
        got, _ = _answer(fleet, body, headers, unary)
        rec = fleet.record(rid)
    finally:
        fleet.heal()
    assert got == reference
    assert (rec["status"], rec["output_tokens"]) == ("ok", n)
    role = "replayed" if unary else "resumed"
    assert [a["role"] for a in rec["attempts"]] == ["aggregated"] + [role] * len(fails)
    assert rec.get("replays" if unary else "migrations") == len(fails)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_engine_abort_finish_is_not_migrated(protocol, tmp_path):
    """An engine that ends the request with an ``abort`` finish (here after
    3 tokens, status 503, ``sim --abort-after``) answered about the request
    itself: the client gets that answer, no second leg is sent anywhere."""
    sims = [start_sim(protocol, extra=["--abort-after", "3", "--abort-status", "503"]) for _ in range(2)]
    try:
        fe = start_frontend([f"{protocol}={s.url}" for s in sims], extra=["--trace-file", str(tmp_path / "t.jsonl")])
        try:
            body, headers = _body(protocol, 8, False, "ab1")
            status, events = sse(fe.url, body, GEN[protocol], headers=headers)
            assert status == 200
            rec = _record(str(tmp_path / "t"), "ab1")
        finally:
            fe.stop()
        received = sum(stats(s)["received"] for s in sims)
    finally:
        for s in sims:
            s.stop()
    assert events[-1] == b"[DONE]"
    assert received == 1
    assert (rec["output_tokens"], rec["finish"]["backend_finish_reason"]) == (3, "abort")
    assert [(a["role"], a.get("tokens")) for a in rec["attempts"]] == [("aggregated", 3)]
    assert "migrations" not in rec and "not_migrated" not in rec


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_worker_the_probe_gives_up_mid_stream_migrates(worker_class, tmp_path):
    """A worker that stops answering everything, its health probes
    included, after one token (connection open, no error): the probe gives
    it up, its leg is cancelled at once (record ``worker_lost``), and the
    stream continues on the other worker from that token."""
    from fakes import STREAM, FakeWorker

    sim = start_sim("sglang")
    try:
        with FakeWorker("stall") as fake:
            fe = start_frontend([f"sglang={fake.url}", f"sglang={sim.url}"], worker_class=worker_class,
                                extra=["--health-timeout", "0.3", "--health-failures", "1",
                                       "--trace-file", str(tmp_path / "t.jsonl")])
            try:
                events = []
                for _ in range(2):  # the router may pick the simulator first
                    client = RawClient(fe.url)
                    client.send(orjson.dumps(STREAM))
                    events = client.events(1)
                    if fake.generates:
                        fake.blackhole = True
                        events += client.events(100)
                        client.close()
                        break
                    events += client.events(100)
                    client.close()
                recs = wait_until(lambda: (r := _all_records(str(tmp_path / "t"))) and r[-1]["attempts"][0][
                    "worker_id"] == "w0" and r)
            finally:
                fe.stop()
        expected = _stalled_and_continued(sim)
    finally:
        sim.stop()
    rec = recs[-1]
    assert _values(events) == expected
    assert (rec["status"], rec["output_tokens"], rec["migrations"]) == ("ok", 6, 1)
    assert [(a["worker_id"], a["role"], a["outcome"], a.get("tokens"), a.get("abort_acked")) for a in rec["attempts"]] == [
        ("w0", "aggregated", "worker_lost", 1, False), ("w1", "resumed", "finished", 5, None)]


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "unary"])
def test_503_before_any_token_is_a_failover(stream, tmp_path):
    """A worker answering a stream 503 (going away) before any token: the
    request simply runs on the next worker (no migration or replay counted,
    no backoff), and the answer is that worker's. A unary 503 may be the
    engine's own abort of the request (SGLang ``_wait_one_response``): it is
    the answer, passed through, with no second leg."""
    from fakes import STREAM, FakeWorker

    body = {**STREAM, "stream": stream}
    sim = start_sim("sglang")
    try:
        with FakeWorker("unavailable") as fake:
            fe = start_frontend([f"sglang={fake.url}", f"sglang={sim.url}"],
                                extra=["--trace-file", str(tmp_path / "t.jsonl")])
            try:
                for sent in (1, 2):  # the router may pick the simulator first
                    got = _values(sse(fe.url, body)[1]) if stream else without_timing(post(fe.url, body).json())
                    if fake.generates:
                        break
                recs = wait_until(lambda: len(r := _all_records(str(tmp_path / "t"))) >= sent and r)
            finally:
                fe.stop()
        direct = _values(sse(sim.url, body)[1]) if stream else without_timing(post(sim.url, body).json())
    finally:
        sim.stop()
    assert len(fake.generates) == 1
    rec = recs[-1]
    assert "migrations" not in rec and "replays" not in rec
    if not stream:
        assert got == {"error": {"message": "shutting down"}}
        assert (rec["status"], rec["http_status"]) == ("engine_error", 503)
        assert [(a["worker_id"], a["outcome"]) for a in rec["attempts"]] == [("w0", "error")]
        return
    assert got == direct and rec["status"] == "ok"
    assert [(a["worker_id"], a["role"], a["outcome"], a.get("backoff_ms")) for a in rec["attempts"]] == [
        ("w0", "aggregated", "error", None), ("w1", "aggregated", "finished", None)]


@pytest.mark.parametrize("fleet", SGLANG_FLEETS, indirect=True, ids=_fleet_id)
def test_text_across_a_seam_that_splits_a_character(fleet):
    """A seam right after a token holding only the first bytes of a
    character: the resumed engine would decode the rest alone (U+FFFD); the
    frontend's one decoder over the whole output (``--tokenizer``) gives
    the uninterrupted ``text`` in every chunk."""
    from asgi_generate.sim.tokenizer import SimTokenizer

    tok = SimTokenizer()
    # The model never picks a lone byte itself: a logit bias on the two bytes
    # of "é" makes the answer of them, whole characters and stray bytes.
    sp = {"max_new_tokens": 20, "ignore_eos": True, "logit_bias": {str(b): 100.0 for b in tok.encode("é")}}
    for last in range(400, 600):  # a prompt whose answer splits a character early
        prompt = [1, 2, 3, last]
        ids = post(fleet.fe.url, {"input_ids": prompt, "sampling_params": sp}).json()["output_ids"]
        seam = next((i + 1 for i in range(1, 18) if tok.decode(ids[: i + 1]).endswith("\ufffd")
                     and not tok.decode(ids[: i + 2]).endswith("\ufffd")), None)
        if seam is not None:
            break
    assert seam is not None
    rid = f"m{next(_rids)}"
    body = {"input_ids": prompt, "stream": True, "rid": rid, "sampling_params": sp}
    reference, got, rec = _sglang_cut(fleet, body, seam, len(prompt))
    assert got == reference
    assert (rec["migrations"], rec["attempts"][0]["tokens"]) == (1, seam)
