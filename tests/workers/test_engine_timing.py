"""Production timing on the engine side: timeouts by phase, slow is not
dead, and a worker the health probe gives up ends its requests at once.

The misbehaving engines are :class:`FakeWorker`: a small h11 server on
127.0.0.1 speaking SGLang's ``/generate`` (SSE), ``/health``,
``/get_server_info`` and ``/abort_request``, whose timing the test controls.
"""

from __future__ import annotations

import pathlib
import threading
import time

import httpx
import orjson
import pytest

from asgi_generate.workers.router import Router
from fakes import BODY, STREAM, FakeWorker
from support import post, sse, start_frontend, start_sim, stats, wait_until, without_timing, trace_records

def _states(fe) -> list[str]:
    return [w["state"] for w in httpx.get(fe.url + "/v1/models", timeout=5).json()["workers"]]


def _records(base: pathlib.Path, n: int) -> list[dict]:
    def read():
        recs = trace_records(f"{base}.*.jsonl")
        return recs if len(recs) >= n else None
    return wait_until(read, timeout=10)


@pytest.fixture(params=["trio", "asyncio"])
def worker_class(request):
    return request.param


@pytest.mark.e2e
def test_slow_unary_engine_is_answered_once_and_stays_up(worker_class):
    """TTFT 0.5 s and 0.5 s of decode, each past the old ``--read-timeout``
    (0.3 s here; it marked both workers down and answered 503): the answer
    comes, the prompt went to one worker once, both stay up."""
    sims = [start_sim(ttft_ms=500, itl_ms=100), start_sim(ttft_ms=500, itl_ms=100)]
    fast = start_sim()
    fe = None
    try:
        expected = without_timing(post(fast.url, {**BODY, "rid": "r"}).json())
        fe = start_frontend([f"sglang={s.url}" for s in sims], worker_class=worker_class,
                            extra=["--read-timeout", "0.3"])
        start = time.monotonic()
        resp = post(fe.url, {**BODY, "rid": "r"})
        assert time.monotonic() - start >= 1.0
        assert resp.status_code == 200
        assert without_timing(resp.json()) == expected
        assert sorted(stats(s)["received"] for s in sims) == [0, 1]
        assert _states(fe) == ["up", "up"]
    finally:
        if fe is not None:
            fe.stop()
        for s in (*sims, fast):
            s.stop()


@pytest.mark.e2e
def test_comment_only_stall_ends_at_the_inter_token_deadline(worker_class, tmp_path):
    """After one event the worker sends only ``: ping`` comments: they do not
    reset the inter-token timer, so the stream ends in-band with a 504 error
    and ``[DONE]``, the engine is aborted, the worker stays up."""
    with FakeWorker("stall") as fake:
        fe = start_frontend([f"sglang={fake.url}"], worker_class=worker_class,
                            extra=["--inter-token-timeout", "0.5", "--trace-file", str(tmp_path / "t.jsonl")])
        try:
            start = time.monotonic()
            status, events = sse(fe.url, STREAM)
            took = time.monotonic() - start
            assert status == 200
            assert len(events) == 3
            assert orjson.loads(events[0]) == {
                "text": "a", "output_ids": [5],
                "meta_info": {"id": "mine", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 1}}
            assert orjson.loads(events[1]) == {
                "error": {"message": "worker w0 sent no token for 0.5 s", "type": "504", "code": 504}}
            assert events[2] == b"[DONE]"
            # Not before its deadline; the error names the timer that ended it.
            assert took >= 0.5
            wait_until(lambda: fake.aborts == fake.generates, timeout=10)
            assert len(fake.generates) == 1
            assert _states(fe) == ["up"]
            (rec,) = _records(tmp_path / "t", 1)
            assert (rec["status"], rec["http_status"], rec["error"]) == (
                "timeout", 200, {"type": "timeout", "message": "worker w0 sent no token for 0.5 s"})
            assert [(a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [("aborted", True)]
            assert rec["output_tokens"] == 1
        finally:
            fe.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("mode,flag,body,message", [
    ("no_headers", "--headers-timeout", STREAM, "worker w0 sent no response headers within 0.5 s"),
    ("headers_only", "--first-token-timeout", STREAM, "worker w0 sent no token within 0.5 s"),
    ("no_headers", "--request-timeout", BODY, "worker w0 did not answer within 0.5 s"),
])
def test_timeout_before_the_answer_is_504_and_not_replayed(worker_class, mode, flag, body, message):
    """A worker that misses its headers, first-token or (unary) request
    deadline: 504 in SGLang's error shape, the leg aborted, the prompt not
    sent to the second worker, both workers still up."""
    sim = start_sim()
    with FakeWorker(mode) as fake:
        fe = start_frontend([f"sglang={fake.url}", f"sglang={sim.url}"], worker_class=worker_class,
                            extra=[flag, "0.5", "--sse-keepalive", "0"])
        try:
            start = time.monotonic()
            resp = post(fe.url, body, timeout=10)
            # Not before its deadline; the message names the deadline that ended it.
            assert time.monotonic() - start >= 0.5
            assert resp.status_code == 504
            assert resp.json() == {"object": "error", "message": message, "type": "504", "param": None, "code": 504}
            wait_until(lambda: fake.aborts == fake.generates, timeout=10)
            assert len(fake.generates) == 1
            assert stats(sim)["received"] == 0
            assert _states(fe) == ["up", "up"]
        finally:
            fe.stop()
            sim.stop()


@pytest.mark.e2e
def test_black_hole_worker_ends_its_requests_when_the_probe_gives_up(worker_class, tmp_path):
    """A healthy worker turns into a black hole (accepts, never answers): its
    in-flight request ends with 502 'worker lost' within one health interval
    of the probe marking it down, not at a read timeout; new requests go to
    the other worker. (Migration off: with it, the unary request is replayed
    on the other worker, ``test_migration.py``.)"""
    sim = start_sim()
    interval = 1.0
    with FakeWorker("no_headers") as fake:
        fe = start_frontend(
            [f"sglang={fake.url}", f"sglang={sim.url}"], worker_class=worker_class,
            extra=["--health-interval", str(interval), "--health-timeout", "0.3", "--health-failures", "2",
                   "--abort-timeout", "0.3", "--migration-limit", "0", "--trace-file", str(tmp_path / "t.jsonl")])
        try:
            result: dict = {}

            def run() -> None:
                result["resp"] = post(fe.url, BODY, timeout=20)
                result["at"] = time.monotonic()

            t = threading.Thread(target=run)
            t.start()
            wait_until(lambda: fake.generates, timeout=10)
            fake.blackhole = True
            went_down = time.monotonic()
            while _states(fe)[0] != "down":
                assert time.monotonic() - went_down < 10, "the probe never marked the black hole down"
                time.sleep(0.02)
            seen_down = time.monotonic()
            t.join(20)
            assert result["at"] - seen_down < interval
            resp = result["resp"]
            assert resp.status_code == 502
            assert resp.json() == {
                "object": "error", "message": "worker w0 lost: health probe got no answer within 0.3 s",
                "type": "502", "param": None, "code": 502}
            for _ in range(2):
                assert post(fe.url, BODY, timeout=10).status_code == 200
            assert stats(sim)["received"] == 2
            assert len(fake.generates) == 1
            (rec,) = [r for r in _records(tmp_path / "t", 3) if r["status"] != "ok"]
            assert (rec["status"], rec["http_status"], rec["error"]["type"]) == ("engine_error", 502, "worker_lost")
            assert [a["outcome"] for a in rec["attempts"]] == ["worker_lost"]
        finally:
            fe.stop()
            sim.stop()



@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_probe_failures_in_a_row_before_down_and_refused_connect_at_once():
    """A slow probe is one failure, not a verdict: an up worker leaves after
    ``health_failures`` in a row (its in-flight requests told at once); one
    success in between resets the count; a refused connect takes it out at
    once."""
    lost: list[str] = []

    class Request:
        def worker_lost(self, worker, reason):
            lost.append(reason)

    with FakeWorker("stall") as fake:
        router = Router([("sglang", fake.url)], health_timeout=0.2, health_failures=3)
        w = router.workers[0]
        assert await router.probe(w) and w.healthy
        w.inflight.add(Request())
        fake.blackhole = True
        assert not await router.probe(w)
        assert not await router.probe(w)
        assert (w.healthy, w.failures, lost) == (True, 2, [])
        fake.blackhole = False
        assert await router.probe(w) and w.failures == 0  # a fresh connection answers
        fake.blackhole = True
        for _ in range(3):
            await router.probe(w)
        assert (w.healthy, lost) == (False, ["health probe got no answer within 0.2 s"])
        await router.aclose()
    gone = Router([("sglang", fake.url)], health_timeout=0.2, health_failures=3)
    w = gone.workers[0]
    w.healthy = True
    assert not await gone.probe(w)
    assert not w.healthy and w.last_error.startswith("connect to 127.0.0.1:")
