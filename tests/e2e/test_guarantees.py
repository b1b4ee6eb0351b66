"""Claims of docs/guarantees.md that no other test proves, each proven end
to end: the id a vLLM unary answer carries when the client named none, the
simulator's open-file limit, and a half-close that only follows a complete
answer or a pipelined request."""

from __future__ import annotations

import re
import resource
import socket

import orjson
import pytest

from support import Proc, listening_socket, post, start_frontend, start_sim, stats, trace_records, wait_until

pytestmark = pytest.mark.e2e
WORKER_CLASSES = ["trio", "asyncio"]
GEN = "/inference/v1/generate"


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_a_vllm_unary_answer_without_a_client_id_carries_the_frontends_request_id(worker_class, tmp_path):
    # vLLM 0.25+ answers ``generate-tokens-`` plus the X-Request-Id header,
    # else the body's request_id, else a random uuid
    # (vllm/entrypoints/scale_out/token_in_token_out/serving.py,
    # ``_base_request_id``); with neither, the frontend's request id (the
    # record's) stands in for the uuid, never the id minted for the engine.
    sim = start_sim("vllm")
    try:
        fe = start_frontend([f"vllm={sim.url}"], worker_class=worker_class,
                            extra=["--trace-file", str(tmp_path / "t.jsonl")])
        try:
            resp = post(fe.url, {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}, GEN)
        finally:
            fe.stop()
        (engine_rid,) = stats(sim)["seen_rids"]
    finally:
        sim.stop()
    (rec,) = trace_records(str(tmp_path / "t.*.jsonl"))
    assert resp.status_code == 200
    assert "public_id" not in rec and re.fullmatch(r"[0-9a-f]{32}", rec["request_id"])
    assert resp.json()["request_id"] == f"generate-tokens-{rec['request_id']}"
    assert engine_rid == f"generate-tokens-{rec['attempts'][0]['engine_id']}" != resp.json()["request_id"]


def test_the_simulator_raises_the_soft_fd_limit_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(512, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # inherited by the child
    try:
        # A fresh interpreter started by this process: it inherits the lowered limit.
        sim = Proc("sim-sglang", ["sim", "--protocol", "sglang", "--log-level", "info"], listening_socket(),
                   "/health", fork=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        with open(f"/proc/{sim.proc.pid}/limits") as f:
            assert int(re.search(r"Max open files\s+(\d+)", f.read())[1]) == hard
        assert f"INFO asgi_generate: open-file limit raised from {low} to {hard} (the hard limit)" in sim.log()
    finally:
        sim.stop()


def _request(body: dict) -> bytes:
    raw = orjson.dumps(body)
    return b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(raw), raw)


def _read_to_eof(sock: socket.socket) -> bytes:
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    return raw


@pytest.fixture(scope="module")
def slow_sim():
    sim = start_sim(itl_ms=20)
    yield sim
    sim.stop()


@pytest.fixture(scope="module", params=WORKER_CLASSES)
def traced(request, slow_sim, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"half-{request.param}") / "t"
    fe = start_frontend([f"sglang={slow_sim.url}"], worker_class=request.param,
                        extra=["--trace-file", f"{base}.jsonl", "--sse-keepalive", "0"])
    yield fe, f"{base}.*.jsonl"
    fe.stop()


def _records_after(pattern: str, seen: int, n: int) -> list[dict]:
    recs = wait_until(lambda: (r := trace_records(pattern)) and len(r) >= seen + n and r, timeout=30)
    return recs[seen:]


def test_a_half_close_after_the_complete_answer_is_not_a_disconnect(traced, slow_sim):
    fe, pattern = traced
    seen, aborted = len(trace_records(pattern)), len(stats(slow_sim)["aborted_rids"])
    with socket.create_connection(("127.0.0.1", fe.port), timeout=30) as sock:
        sock.sendall(_request({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "stream": True}))
        raw = b""
        while not raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk, raw
            raw += chunk
        sock.shutdown(socket.SHUT_WR)
        assert _read_to_eof(sock) == b""
    (rec,) = _records_after(pattern, seen, 1)
    assert (rec["status"], rec["output_tokens"]) == ("ok", 4)
    assert len(stats(slow_sim)["aborted_rids"]) == aborted


def test_a_half_close_behind_a_pipelined_request_applies_to_that_request(traced, slow_sim):
    # The first request is answered whole; the half-close is read after it,
    # with the second request, which it ends as a client disconnect.
    fe, pattern = traced
    seen = len(trace_records(pattern))
    first = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "first"}
    second = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 200}, "stream": True, "rid": "second"}
    with socket.create_connection(("127.0.0.1", fe.port), timeout=30) as sock:
        sock.sendall(_request(first) + _request(second))
        sock.shutdown(socket.SHUT_WR)
        raw = _read_to_eof(sock)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    length = int(re.search(rb"content-length: (\d+)", head, re.I)[1])
    answer = orjson.loads(body[:length])
    assert (answer["meta_info"]["id"], len(answer["output_ids"])) == ("first", 4)
    assert b"[DONE]" not in body[length:]
    recs = sorted(_records_after(pattern, seen, 2), key=lambda r: r["public_id"])
    assert [(r["public_id"], r["status"]) for r in recs] == [("first", "ok"), ("second", "client_disconnect")]
