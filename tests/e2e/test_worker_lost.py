"""A worker that dies mid-stream: its streams end in-band and their records
are written at once (no abort retried against the dead host), on both
hypercorn worker classes."""

from __future__ import annotations

import signal
import time

import httpx
import orjson
import pytest

from support import RawClient, start_frontend, start_sim, wait_until, trace_records

pytestmark = pytest.mark.e2e

STREAMS = 8
#: What a stream's own read sees of a SIGKILLed worker: its FIN, or a reset
#: when the kernel still held unread bytes of the connection.
BROKEN = ("worker broke HTTP/1.1: peer closed connection without sending complete message body "
          "(incomplete chunked read)",
          "connection to worker lost: ConnectionResetError(104, 'Connection reset by peer')")
#: Each stream ends by its own read ("failed", error type "engine"), or, when
#: the first stream's probe found the worker gone before this stream read its
#: own break, by that loss ("lost", type "worker_lost", the first one's
#: reason); with no other worker, migration was impossible.
UNMOVED = " (migration impossible: no worker left to resume on)"
ENDINGS = {**{f"worker w0 failed: {why}{UNMOVED}": "engine" for why in BROKEN},
           **{f"worker w0 lost: {why}{UNMOVED}": "worker_lost" for why in BROKEN}}


def _records(tmp_path) -> list[dict]:
    return trace_records(str(tmp_path / "t.*.jsonl"))


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_dead_worker_streams_are_recorded_as_they_end(tmp_path, worker_class):
    sim = start_sim(itl_ms=50)
    # The probe a stream's break sets off may give the worker up (connect
    # refused) before another stream reads its own break: that stream ends
    # with the probe's reason.
    endings = {**ENDINGS, f"worker w0 lost: connect to {sim.url.removeprefix('http://')} failed: "
                          f"Connection refused{UNMOVED}": "worker_lost"}
    # The streams' own reads must notice the death: a probe every 0.2 s
    # (the suite's default) could give the worker up first and end them
    # with its own reason (test_engine_timing covers that path).
    fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class,
                        extra=["--trace-file", str(tmp_path / "t.jsonl"), "--health-interval", "60"])
    clients = []
    try:
        body = orjson.dumps({"input_ids": [5, 6, 7], "stream": True,
                             "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}})
        for _ in range(STREAMS):
            c = RawClient(fe.url)
            c.send(body)
            clients.append(c)
        for c in clients:
            assert len(c.events(2)) == 2
        broke_ms = time.time() * 1000
        sim.proc.send_signal(signal.SIGKILL)
        sim.proc.wait(5)
        recs = wait_until(lambda: len(r := _records(tmp_path)) == STREAMS and r, timeout=10)
        messages = []
        for c in clients:
            tail = c.events(10_000)
            assert tail[-1] == b"[DONE]"
            error = orjson.loads(tail[-2])["error"]
            assert (error["message"] in endings, error["type"], error["code"]) == (True, "502", 502), error
            messages.append(error["message"])
        fe_stats = httpx.get(fe.url + "/stats", timeout=5).json()
    finally:
        for c in clients:
            c.close()
        fe.stop()
        sim.stop()
    lags = sorted(rec["event_time_unix_ms"] - broke_ms for rec in recs)
    # Written as the streams end, not at a timer: connect (5 s) and abort
    # (10 s) timeouts, the probe (60 s here). 2 s is room for a loaded machine.
    assert lags[-1] < 2_000, lags
    assert sorted(rec["error"]["message"] for rec in recs) == sorted(messages)
    for rec in recs:
        kind = endings[rec["error"]["message"]]
        assert (rec["status"], rec["http_status"], rec["error"]["type"]) == ("engine_error", 200, kind)
        # The worker is down: its abort ends "lost" at once, unsent.
        assert [(a["worker_id"], a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [
            ("w0", "worker_lost", False)]
    assert (fe_stats["aborts_worker_lost"], fe_stats["by_status"]) == (STREAMS, {"engine_error": STREAMS})
    assert fe_stats["workers"]["w0"]["aborts"]["requests"] == 0
