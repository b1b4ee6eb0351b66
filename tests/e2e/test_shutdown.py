"""Stopping a frontend that streams: under a hypercorn you run yourself, the
app ends its open streams as ``serve`` does (the format's error in-band, the
terminal marker, a record) within hypercorn's graceful timeout; under
``serve`` a second Ctrl-C says how to force the stop, a third forces it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import orjson
import pytest

from support import RawClient, listening_socket, start_frontend, start_sim, trace_records, wait_until

pytestmark = pytest.mark.e2e

#: The in-band error a stream ended by a shutdown carries (SGLang's shape).
SHUTDOWN_EVENT = {"error": {"message": "server is shutting down", "type": "503", "code": 503}}
STREAM = {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}


@pytest.fixture(scope="module")
def itl_sim():
    sim = start_sim(itl_ms=50)
    yield sim
    sim.stop()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _token_count(events: list[bytes]) -> int:
    """Tokens the client got: the last token event's cumulative output."""
    return len(orjson.loads(next(e for e in reversed(events) if b'"output_ids"' in e))["output_ids"])


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_sigterm_under_your_own_hypercorn_ends_open_streams_in_band(itl_sim, tmp_path, worker_class):
    """hypercorn's default graceful timeout is 3 s: the app ends the stream
    after 2 (it keeps 1 s to end it), with the error event and ``[DONE]``,
    and writes its record before the process exits 0."""
    sock = listening_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = {**os.environ, "ASGI_GENERATE_WORKERS": f"sglang={itl_sim.url}",
           "ASGI_GENERATE_TRACE_FILE": str(tmp_path / "t.jsonl")}
    proc = subprocess.Popen([sys.executable, "-m", "hypercorn", "-k", worker_class, "-b", f"fd://{sock.fileno()}",
                             "asgi_generate.server.asgi:app"], pass_fds=[sock.fileno()], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sock.close()
    try:
        wait_until(lambda: _ok(url), timeout=30)
        client = RawClient(url)
        client.send(orjson.dumps(STREAM))
        first = client.events(3)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = client.events(1000)
        elapsed = time.monotonic() - stopped
        client.close()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    events = first + rest
    assert [orjson.loads(events[-2]), events[-1]] == [SHUTDOWN_EVENT, b"[DONE]"]
    assert 1.9 < elapsed < 3.0
    (rec,) = trace_records(str(tmp_path / "t.*.jsonl"))
    assert (rec["status"], rec["http_status"], rec["error"]) == (
        "shutdown", 200, {"type": "shutdown", "message": "server is shutting down"})
    assert rec["output_tokens"] == _token_count(events) < 400


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_second_ctrl_c_says_how_to_force_and_a_third_forces(itl_sim, worker_class):
    fe = start_frontend([f"sglang={itl_sim.url}"], worker_class=worker_class,
                        extra=["--shutdown-grace", "30", "--log-level", "info"])
    try:
        client = RawClient(fe.url)
        client.send(orjson.dumps(STREAM))
        first = client.events(3)
        fe.signal(signal.SIGINT)
        wait_until(lambda: "SIGINT: shutting down gracefully" in fe.log_path.read_text())
        fe.signal(signal.SIGINT)
        wait_until(lambda: "SIGINT: already stopping" in fe.log_path.read_text())
        assert len(client.events(3)) == 3  # the stream runs on
        forced = time.monotonic()
        fe.signal(signal.SIGINT)
        rest = client.events(1000)
        elapsed = time.monotonic() - forced
        client.close()
        assert fe.proc.wait(20) == 0
    finally:
        fe.stop()
    events = first + rest
    assert [orjson.loads(events[-2]), events[-1]] == [SHUTDOWN_EVENT, b"[DONE]"]
    assert elapsed < 1.0 and _token_count(events) < 400
    lines = [line.split("] ", 1)[1] for line in fe.log_path.read_text().splitlines() if "SIGINT" in line]
    assert lines == ["INFO asgi_generate: SIGINT: shutting down gracefully",
                     "WARNING asgi_generate: SIGINT: already stopping; press Ctrl-C again to force",
                     "WARNING asgi_generate: SIGINT: forcing the shutdown: ending the requests in flight now"]
