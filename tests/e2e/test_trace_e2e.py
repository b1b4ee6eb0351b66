"""Request-end records through real hypercorn and simulator processes: one
record per request, for every outcome, whose output_tokens is exactly what
the client received.

Traced frontends shared by tests: ``fast`` (trio, instant SGLang simulator,
tokenizer with the deepseek_r1 and hermes parsers), ``slow`` (asyncio, SGLang
simulator with TTFT and ITL, no parsers) and ``vllm_front`` (the vLLM format,
with parsers); engine death, shutdown and worker processes get their own.
Each test takes the records its requests added; at the end every file is
validated and its records counted against the requests sent.
"""

from __future__ import annotations

import glob
import signal
import subprocess
import sys
import threading

import httpx
import orjson
import pytest

from asgi_generate.assets import TOKENIZER_PATH
from asgi_generate.tracing.hashing import block_hashes
from asgi_generate.tracing.offline.validate import check_records, read_jsonl
from support import (JSON_HEADERS, RawClient, generating, post, reading_body, sse, sse_then_hang_up, start_frontend, start_sim,
                     stats, wait_until, trace_records)

pytestmark = pytest.mark.e2e

PARSERS = ["--tokenizer", str(TOKENIZER_PATH), "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes"]
class Traced:
    """A frontend with ``--trace-file``: counts the requests that must leave
    a record and hands out the records as they arrive."""

    def __init__(self, proc, base: str) -> None:
        self.proc = proc
        self.url = proc.url
        self.base = base
        self.expected = 0
        self.taken = 0

    def files(self) -> list[str]:
        return sorted(glob.glob(f"{self.base}.*.jsonl"))

    def records(self) -> list[dict]:
        return trace_records(f"{self.base}.*.jsonl")

    def take(self, n: int = 1) -> list[dict]:
        """The next ``n`` records (waits for them); counts them as expected."""
        self.expected += n
        recs = wait_until(lambda: (r := self.records()) and len(r) >= self.taken + n and r)
        new = recs[self.taken : self.taken + n]
        self.taken += n
        return new

    def finish(self) -> None:
        """Stop the frontend (its shutdown flushes the queue); then every
        record is valid and there is exactly one per request."""
        self.proc.stop()
        count, problems = check_records(rec for f in self.files() for rec in read_jsonl(f))
        assert problems == []
        assert count == self.expected == self.taken


def traced(tmp_path_factory, name: str, worker: str, worker_class: str, extra: list[str] = ()) -> Traced:
    base = str(tmp_path_factory.mktemp(name) / "trace")
    proc = start_frontend([worker], worker_class=worker_class, extra=["--trace-file", base + ".jsonl", *extra])
    return Traced(proc, base)


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    sim = start_sim()
    try:
        fe = traced(tmp_path_factory, "fast", f"sglang={sim.url}", "trio", ["--max-body-bytes", "65536", *PARSERS])
        yield fe
        fe.finish()
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    sim = start_sim(ttft_ms=1000, itl_ms=500)  # 500 ms: a hang-up is seen before the next token
    try:
        fe = traced(tmp_path_factory, "slow", f"sglang={sim.url}", "asyncio")
        fe.sim = sim
        yield fe
        fe.finish()
    finally:
        sim.stop()


def body(n: int, *, stream: bool, rid: str | None = None, ids=(11, 12, 13), **extra) -> dict:
    obj = {"input_ids": list(ids), "stream": stream,
           "sampling_params": {"max_new_tokens": n, "ignore_eos": True}, **extra}
    if rid is not None:
        obj["rid"] = rid
    return obj


def sse_tokens(events: list[bytes]) -> int:
    """Tokens an SGLang SSE client received (chunks are cumulative)."""
    return max((len(orjson.loads(e).get("output_ids", [])) for e in events if e != b"[DONE]"), default=0)


def test_unary_counts_and_replay_hashes(fast):
    ids = list(range(20, 20 + 150))
    r = post(fast.url, body(17, stream=False, rid="u1", ids=ids), headers={"x-request-id": "hdr-u1"})
    assert r.status_code == 200
    got = len(r.json()["output_ids"])
    (rec,) = fast.take()
    assert got == rec["output_tokens"] == 17
    assert rec["reasoning_tokens"] == 17  # deepseek_r1: never closed </think>
    assert (rec["public_id"], rec["x_request_id"], rec["status"], rec["http_status"]) == ("u1", "hdr-u1", "ok", 200)
    assert (rec["stream"], rec["input_tokens"], rec["cached_tokens"]) == (False, 150, 0)
    assert rec["finish"] == {"finish_reason": "length", "backend_finish_reason": "length", "tool_calls": []}
    assert rec["replay"] == {"block_size": 64, "input_length": 150, "block_hashes": block_hashes(ids, 64)}
    assert [(a["worker_id"], a["role"], a["outcome"]) for a in rec["attempts"]] == [("w0", "aggregated", "finished")]
    assert "session" not in rec
    assert 0 <= rec["dispatch_wait_ms"] <= rec["total_ms"]


@pytest.mark.parametrize("logprobs", [False, True])
def test_sse_counts(fast, logprobs):
    extra = {"return_logprob": True, "top_logprobs_num": 2} if logprobs else {}
    status, events = sse(fast.url, body(9, stream=True, rid="s1", **extra))
    assert (status, events[-1]) == (200, b"[DONE]")
    (rec,) = fast.take()
    assert sse_tokens(events) == rec["output_tokens"] == 9
    assert (rec["stream"], rec["status"], rec["finish"]["finish_reason"]) == (True, "ok", "length")
    assert 0 <= rec["dispatch_wait_ms"] <= rec["ttft_ms"] <= rec["total_ms"]


def test_natural_stop_counts(fast):
    r = post(fast.url, {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 2000}})
    got = r.json()
    (rec,) = fast.take()
    assert rec["output_tokens"] == len(got["output_ids"])
    finish = got["meta_info"]["finish_reason"]
    assert rec["finish"]["backend_finish_reason"] == finish["type"]
    assert rec["finish"].get("matched") == finish.get("matched")


def test_session_headers(fast):
    headers = {"x-session-id": "run7:worker", "x-parent-session-id": "run7", "x-session-final": "true"}
    post(fast.url, body(2, stream=False), headers=headers)
    (rec,) = fast.take()
    assert rec["session"] == {"session_id": "run7:worker", "parent_session_id": "run7", "session_final": True}


def test_text_input_is_excluded_from_replay(fast):
    r = post(fast.url, {"text": "Hello there", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    (rec,) = fast.take()
    assert rec["replay"] == {"excluded": "text"}
    assert rec["input_tokens"] == r.json()["meta_info"]["prompt_tokens"]
    assert rec["output_tokens"] == 3


def test_rejections_leave_one_record_each(fast):
    assert post(fast.url, b"{not json").status_code == 400
    assert post(fast.url, {"input_ids": []}).status_code == 400
    assert httpx.get(fast.url + "/generate", timeout=10).status_code == 405
    assert post(fast.url, body(1, stream=False, ids=[5] * 40000)).status_code == 413
    assert post(fast.url, b"{}", path="/no/such/route").status_code == 404  # not a route: no record
    recs = fast.take(4)
    assert [(r["status"], r["http_status"], r["error"]["type"], r["output_tokens"], r["attempts"], r["replay"])
            for r in recs] == [
        ("rejected", 400, "invalid_json", 0, [], {"excluded": "not_decoded"}),
        ("rejected", 400, "invalid_request", 0, [], {"excluded": "not_decoded"}),
        ("rejected", 405, "method_not_allowed", 0, [], {"excluded": "not_decoded"}),
        ("rejected", 413, "too_large", 0, [], {"excluded": "not_decoded"}),
    ]


def test_wrongly_typed_field_and_streamed_refusal_records(fast):
    """A wrongly typed field is ``invalid_request`` (the JSON parsed); a
    streamed request refused in-band is recorded with the 200 it got."""
    assert post(fast.url, {"input_ids": [1], "stream": "yes"}).status_code == 400
    status, events = sse(fast.url, {"input_ids": [], "stream": True})
    assert (status, events) == (200, [b'{"error":{"message":"input_ids cannot be empty."}}', b"[DONE]"])
    recs = fast.take(2)
    assert [(r["status"], r["http_status"], r["error"]["type"], r.get("stream"), r["output_tokens"]) for r in recs] == [
        ("rejected", 400, "invalid_request", None, 0),
        ("rejected", 200, "invalid_request", True, 0),
    ]


def test_stats_show_the_trace_counters(fast):
    trace = httpx.get(fast.url + "/stats", timeout=10).json()["trace"]
    assert trace["enabled"] is True
    assert trace["submitted"] == trace["records"] == fast.taken
    assert trace["dropped"] == {"queue_full": 0, "sink_error": 0, "build_error": 0, "closed": 0}
    assert trace["sinks"]["file"]["written"] == fast.taken


# -- disconnects (slow simulator: TTFT 1 s, ITL 500 ms) --------------------------


def test_disconnect_before_the_body_is_read(slow):
    c = RawClient(slow.url)
    c.send(orjson.dumps(body(5, stream=True)), upto=10)
    reading_body(slow.url)
    c.close()
    (rec,) = slow.take()
    assert (rec["status"], rec["output_tokens"], rec["attempts"]) == ("client_disconnect", 0, [])
    assert "http_status" not in rec and "stream" not in rec


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_during_the_first_token_wait(slow, stream):
    c = RawClient(slow.url)
    c.send(orjson.dumps(body(5, stream=stream)))
    wait_until(lambda: stats(slow.sim)["running"] == 1)
    c.close()
    (rec,) = slow.take()
    assert (rec["status"], rec["output_tokens"], rec["stream"]) == ("client_disconnect", 0, stream)
    assert "ttft_ms" not in rec and "http_status" not in rec
    assert [(a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [("aborted", True)]


@pytest.mark.parametrize("k", [1, 3])
def test_sse_disconnect_mid_stream(slow, k):
    got = sse_then_hang_up(slow.url, orjson.dumps(body(30, stream=True)), {}, k)
    (rec,) = slow.take()
    assert rec["output_tokens"] == got
    assert k <= got <= k + 1
    assert (rec["status"], rec["http_status"]) == ("client_disconnect", 200)
    assert [(a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [("aborted", True)]
    assert "finish" not in rec


def test_unary_disconnect_mid_generation(slow):
    c = RawClient(slow.url)
    c.send(orjson.dumps(body(30, stream=False)))
    generating(slow.sim)  # past TTFT: the engine is generating, the client has nothing
    c.close()
    (rec,) = slow.take()
    assert (rec["status"], rec["output_tokens"], rec["stream"]) == ("client_disconnect", 0, False)
    assert [(a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [("aborted", True)]


# -- engine death and shutdown (own processes) ------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_engine_dies_mid_request(tmp_path_factory, stream):
    sim = start_sim(ttft_ms=0, itl_ms=100)
    fe = None
    try:
        fe = traced(tmp_path_factory, "dies", f"sglang={sim.url}", "trio")
        results: dict = {}

        def client() -> None:
            if stream:
                results["sse"] = sse(fe.url, body(200, stream=True))
            else:
                results["unary"] = post(fe.url, body(200, stream=False))

        t = threading.Thread(target=client)
        t.start()
        generating(sim, tokens=5)  # written to the frontend before the kill: at least 2 reach the client
        sim.proc.kill()
        t.join(30)
        (rec,) = fe.take()
        if stream:
            assert [a["outcome"] for a in rec["attempts"]] == ["worker_lost"]
            status, events = results["sse"]
            assert (status, events[-1]) == (200, b"[DONE]")
            assert b"error" in events[-2]
            assert (rec["status"], rec["http_status"], rec["error"]["type"]) == ("engine_error", 200, "engine")
            assert rec["output_tokens"] == sse_tokens(events) >= 2
        else:
            # Nothing sent yet: the handler may try another worker (there is none).
            status = results["unary"].status_code
            expected = {502: "engine_error", 503: "unavailable"}[status]
            assert (rec["status"], rec["http_status"], rec["output_tokens"]) == (expected, status, 0)
            assert len(rec["attempts"]) == 1
            assert rec["attempts"][0]["outcome"] in ("worker_lost", "connect_failed")
    finally:
        try:
            if fe is not None:
                fe.finish()
        finally:
            sim.stop()


def test_shutdown_with_requests_in_flight(tmp_path_factory):
    sim = start_sim(ttft_ms=0, itl_ms=100)
    fe = None
    try:
        fe = traced(tmp_path_factory, "shutdown", f"sglang={sim.url}", "trio", ["--shutdown-grace", "0.5"])
        results: dict = {}

        def stream() -> None:
            results["sse"] = sse(fe.url, body(500, stream=True))

        t = threading.Thread(target=stream)
        t.start()
        generating(sim, tokens=3)  # some out before the shutdown (at least 1 is asserted)
        fe.proc.signal(signal.SIGTERM)
        t.join(30)
        fe.proc.proc.wait(30)
        (rec,) = fe.take()
        status, events = results["sse"]
        assert rec["status"] == "shutdown"
        assert rec["output_tokens"] == sse_tokens(events) >= 1
        assert [(a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [("aborted", True)]
    finally:
        try:
            if fe is not None:
                fe.finish()
        finally:
            sim.stop()


def test_worker_processes_write_their_own_files(tmp_path):
    sim = start_sim()
    fe = None
    try:
        fe = start_frontend([f"sglang={sim.url}"], extra=["--workers", "2", "--trace-file", str(tmp_path / "t.jsonl")])
        for i in range(30):  # a new connection each: the kernel spreads them over the processes
            assert post(fe.url, body(2, stream=False, rid=f"mw{i}")).status_code == 200
    finally:
        if fe is not None:
            fe.stop()
        sim.stop()
    files = sorted(tmp_path.glob("t.*.jsonl"))
    pids = {f.name.split(".")[1] for f in files}
    assert len(pids) == len(files) >= 1
    assert str(fe.proc.pid) not in pids  # written by the worker processes, not the parent
    count, problems = check_records(rec for f in files for rec in read_jsonl(str(f)))
    assert (count, problems) == (30, [])


def test_bad_trace_settings_stop_the_server_at_once():
    out = subprocess.run(
        [sys.executable, "-m", "asgi_generate", "serve", "--worker", "sglang=http://127.0.0.1:9",
         "--trace-stderr", "--reasoning-parser", "qwen3"],
        capture_output=True, text=True, timeout=60,
    )
    assert (out.returncode, out.stderr.splitlines()[-1]) == (
        2, "asgi-generate: --reasoning-parser and --tool-call-parser need --tokenizer")


# -- the vLLM format: the same records without a line of tracing in its codec --


@pytest.fixture(scope="module")
def vllm_front(tmp_path_factory):
    sim = start_sim("vllm")
    try:
        fe = traced(tmp_path_factory, "vllm", f"vllm={sim.url}", "trio", PARSERS)
        yield fe
        fe.finish()
    finally:
        sim.stop()


VLLM = "/inference/v1/generate"


def test_vllm_unary_and_stream_counts(vllm_front):
    body = {"token_ids": [1, 2, 3, 400], "model": "sim", "request_id": "v1", "sampling_params": {"max_tokens": 5}}
    r = httpx.post(vllm_front.url + VLLM, content=orjson.dumps(body), headers=JSON_HEADERS, timeout=30)
    assert r.status_code == 200
    (rec,) = vllm_front.take()
    assert rec["output_tokens"] == len(r.json()["choices"][0]["token_ids"]) == 5
    assert (rec["format"], rec["route"], rec["model"], rec["public_id"]) == ("vllm", VLLM, "sim", "v1")
    assert rec["reasoning_tokens"] == 5  # the unary worker leg's ids reached the parser too
    assert rec["finish"] == {"finish_reason": "length", "backend_finish_reason": "length", "tool_calls": []}
    assert rec["replay"]["input_length"] == 4

    status, payloads = sse(vllm_front.url, {**body, "stream": True}, path=VLLM)
    (rec,) = vllm_front.take()
    got = sum(len(c["token_ids"]) for p in payloads if p != b"[DONE]" for c in orjson.loads(p)["choices"])
    assert (status, rec["stream"], rec["output_tokens"], got) == (200, True, 5, 5)


def test_vllm_rejections(vllm_front):
    bad = {"token_ids": [1, 2], "model": "no-such-model", "sampling_params": {"max_tokens": 2}}
    r = httpx.post(vllm_front.url + VLLM, content=orjson.dumps(bad), headers=JSON_HEADERS, timeout=30)
    r2 = httpx.post(vllm_front.url + VLLM, content=b"[1, 2]", headers=JSON_HEADERS, timeout=30)
    recs = vllm_front.take(2)
    assert [(x["status"], x["http_status"]) for x in recs] == [("rejected", r.status_code), ("rejected", r2.status_code)]
    assert (r.status_code, r2.status_code) == (404, 400)
