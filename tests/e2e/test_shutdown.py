"""Stopping a frontend that streams: under a hypercorn you run yourself, the
app ends its open streams as ``serve`` does (the format's error in-band, the
terminal marker, a record) within hypercorn's graceful timeout; under
``serve`` a second Ctrl-C says how to force the stop, a third forces it."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import h11
import httpx
import orjson
import pytest

from support import RawClient, listening_socket, start_frontend, start_sim, stats, trace_records, wait_until

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
    assert elapsed > 1.9  # the grace ran (hypercorn's cut would have left no error event, no [DONE])
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
        fe.signal(signal.SIGINT)
        rest = client.events(1000)
        client.close()
        assert fe.proc.wait(20) == 0
    finally:
        fe.stop()
    events = first + rest
    assert [orjson.loads(events[-2]), events[-1]] == [SHUTDOWN_EVENT, b"[DONE]"]
    assert _token_count(events) < 400  # cut: 400 tokens take 20 s, well within the 30 s grace
    lines = [line.split("] ", 1)[1] for line in fe.log_path.read_text().splitlines() if "SIGINT" in line]
    assert lines == ["INFO asgi_generate: SIGINT: shutting down gracefully",
                     "WARNING asgi_generate: SIGINT: already stopping; press Ctrl-C again to force",
                     "WARNING asgi_generate: SIGINT: forcing the shutdown: ending the requests in flight now"]


# -- the connections during a drain ---------------------------------------------

#: A unary answer the drain cuts after the grace: 400 tokens at 50 ms.
LONG_UNARY = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}


def _unary(max_new_tokens: int = 1) -> bytes:
    body = orjson.dumps({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": max_new_tokens}})
    return (b"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def _answer(sock: socket.socket, conn: h11.Connection) -> tuple[int, dict[str, str], bytes]:
    """The next whole answer on ``sock`` (h11 parses it): status, headers, body."""
    status, headers, body = None, {}, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            status, headers = event.status_code, {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return status, headers, body
        else:
            raise AssertionError(f"{event!r} before the end of the answer")


def _keep_alive(url: str) -> tuple[socket.socket, h11.Connection]:
    """A connection that served one request and is idle, kept alive."""
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/generate", headers=[("host", "x"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    sock.sendall(_unary())
    status, headers, _ = _answer(sock, conn)
    assert status == 200 and "connection" not in headers
    conn.start_next_cycle()
    return sock, conn


def _read_to_eof(sock: socket.socket) -> bytes:
    """What the server sends until it closes (a reset counts as a close)."""
    out = b""
    try:
        while data := sock.recv(65536):
            out += data
    except ConnectionResetError:
        pass
    return out


def _rx_queued(port: int, peer_port: int) -> int:
    """Bytes the kernel holds unread on the server's socket of the
    connection between ``port`` (the server's) and ``peer_port``."""
    for line in pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and int(fields[2].rsplit(":", 1)[1], 16) == peer_port:
            return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"no connection {port} <- {peer_port}")


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
@pytest.mark.parametrize("path", ["/generate", "/inference/v1/generate"])
def test_the_drain_closes_idle_connections_answers_a_begun_request_and_says_connection_close(worker_class, path):
    """As the drain begins: a keep-alive connection idle between requests
    is closed at once, without a byte; one on which a request has begun
    (part of its head read) is read on and answered 503 in the format's
    shape with ``connection: close``, then closed; and the unary answer
    the drain ends after the grace says ``connection: close`` too."""
    sim = start_sim(itl_ms=50)
    vsim = start_sim("vllm")
    fe = start_frontend([f"sglang={sim.url}", f"vllm={vsim.url}"], worker_class=worker_class,
                        extra=["--shutdown-grace", "2", "--log-level", "info"])
    try:
        idle, _ = _keep_alive(fe.url)
        begun, begun_h11 = _keep_alive(fe.url)
        body = orjson.dumps({"token_ids": [3, 4], "sampling_params": {"max_tokens": 1}} if path != "/generate"
                            else {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}})
        head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        begun.sendall(head[:30])
        wait_until(lambda: _rx_queued(fe.port, begun.getsockname()[1]) == 0, timeout=30)  # the server read it
        long_unary = socket.create_connection(("127.0.0.1", fe.port), timeout=30)
        long_h11 = h11.Connection(h11.CLIENT)
        long_h11.send(h11.Request(method="POST", target="/generate", headers=[("host", "x"), ("content-length", "0")]))
        long_h11.send(h11.EndOfMessage())
        raw = orjson.dumps(LONG_UNARY)
        long_unary.sendall(b"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(raw), raw))
        wait_until(lambda: stats(sim)["running"] == 1, timeout=30)
        fe.signal(signal.SIGTERM)
        assert _read_to_eof(idle) == b""  # closed at once, no byte of an answer
        begun.sendall(head[30:] + body)
        status, headers, answer = _answer(begun, begun_h11)
        assert _read_to_eof(begun) == b""
        long_status, long_headers, long_answer = _answer(long_unary, long_h11)
        assert _read_to_eof(long_unary) == b""
        assert fe.proc.wait(30) == 0
    finally:
        fe.stop()
        sim.stop()
        vsim.stop()
    if path == "/generate":
        shutdown = {"object": "error", "message": "server is shutting down", "type": "503", "param": None,
                    "code": 503}
    else:
        shutdown = {"error": {"message": "server is shutting down", "type": "Service Unavailable", "param": None,
                              "code": 503}}
    assert (status, headers.get("connection"), orjson.loads(answer)) == (503, "close", shutdown)
    assert (long_status, long_headers.get("connection"), orjson.loads(long_answer)) == (
        503, "close", {"object": "error", "message": "server is shutting down", "type": "503", "param": None,
                       "code": 503})


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_requests_racing_the_drain_are_answered_whole_or_never_read(worker_class, tmp_path):
    """Requests sent on 16 idle keep-alive connections as the drain begins:
    each is either answered whole (503 in SGLang's shape, ``connection:
    close``, then the close) or its connection ends before any byte of an
    answer, and then the server never read it: it wrote a record for each
    request it answered and no other (none for a request it read and cut
    off: a client disconnect)."""
    sim = start_sim(itl_ms=50)
    fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class,
                        extra=["--shutdown-grace", "1", "--trace-file", str(tmp_path / "t.jsonl"),
                               "--log-level", "info"])
    try:
        conns = [_keep_alive(fe.url)[0] for _ in range(16)]
        long_unary = socket.create_connection(("127.0.0.1", fe.port), timeout=30)
        raw = orjson.dumps(LONG_UNARY)
        long_unary.sendall(b"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(raw), raw))
        wait_until(lambda: stats(sim)["running"] == 1, timeout=30)
        fe.signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM: shutting down gracefully" in fe.log(), timeout=30)  # the drain began
        for sock in conns:
            try:
                sock.sendall(_unary())
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed already
        answers = [_read_to_eof(sock) for sock in conns]
        assert _read_to_eof(long_unary).startswith(b"HTTP/1.1 503 ")
        assert fe.proc.wait(30) == 0
    finally:
        fe.stop()
        sim.stop()
    shutdown = {"object": "error", "message": "server is shutting down", "type": "503", "param": None, "code": 503}
    statuses = []
    for raw_answer in answers:
        if not raw_answer:
            continue
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="POST", target="/generate", headers=[("host", "x"), ("content-length", "0")]))
        conn.send(h11.EndOfMessage())
        conn.receive_data(raw_answer)
        conn.receive_data(b"")
        head, body, end = conn.next_event(), conn.next_event(), conn.next_event()
        assert (head.status_code, dict(head.headers).get(b"connection"), orjson.loads(body.data)) == (
            503, b"close", shutdown)
        assert isinstance(end, h11.EndOfMessage) and isinstance(conn.next_event(), h11.ConnectionClosed)
        statuses.append(head.status_code)
    records = trace_records(str(tmp_path / "t.*.jsonl"))
    # the 16 first requests, the answered ones, the long one the grace ended
    assert sorted((r["status"], r["http_status"]) for r in records) == sorted(
        [("ok", 200)] * 16 + [("shutdown", 503)] * (len(statuses) + 1))
