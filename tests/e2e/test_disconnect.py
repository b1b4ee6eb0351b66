"""A client that goes away is an engine abort, at every point of a request,
on both hypercorn worker classes."""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest

from support import (RawClient, reading_body, start_frontend, start_hypercorn, start_sim, stats, tcp_states,
                     trace_records, wait_until)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def slow_sim():
    # The engine's own abort of a vanished client waits 60 s (SGLang: 2 s),
    # so a job that stops was stopped by the frontend's abort, however
    # loaded the machine.
    sim = start_sim(ttft_ms=400, itl_ms=40, extra=["--disconnect-abort-s", "60"])
    yield sim
    sim.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fe(request, slow_sim):
    proc = start_frontend([f"sglang={slow_sim.url}"], worker_class=request.param)
    yield proc
    proc.stop()


def _by_status(fe) -> dict:
    return httpx.get(fe.url + "/stats", timeout=5).json()["by_status"]


def _body(stream: bool, n: int = 30, rid: str = "a") -> bytes:
    return orjson.dumps({"input_ids": [3, 4, 5], "rid": rid, "stream": stream,
                         "sampling_params": {"max_new_tokens": n, "ignore_eos": True}})


def _running_rid(sim) -> str:
    rids = wait_until(lambda: stats(sim)["running_rids"])
    assert len(rids) == 1
    return rids[0]


def _assert_aborted(sim, rid: str) -> None:
    wait_until(lambda: stats(sim)["running"] == 0)
    assert rid in stats(sim)["aborted_rids"]


def test_disconnect_before_the_body_is_whole(fe, slow_sim):
    before, status = stats(slow_sim)["received"], _by_status(fe)
    c = RawClient(fe.url)
    c.send(_body(True), upto=10)
    reading_body(fe.url)
    c.close()
    wait_until(lambda: _by_status(fe).get("client_disconnect", 0) == status.get("client_disconnect", 0) + 1)
    assert stats(slow_sim)["received"] == before


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
def test_disconnect_while_waiting_for_the_first_token(fe, slow_sim, stream):
    status = _by_status(fe)
    c = RawClient(fe.url)
    c.send(_body(stream))
    rid = _running_rid(slow_sim)
    assert rid != "a" and len(rid) == 32
    c.close()
    _assert_aborted(slow_sim, rid)
    assert _by_status(fe).get("client_disconnect", 0) == status.get("client_disconnect", 0) + 1


@pytest.mark.parametrize("k", [1, 4, 9])
def test_disconnect_after_k_events(fe, slow_sim, k):
    c = RawClient(fe.url)
    c.send(_body(True))
    got = c.events(k)
    rid = _running_rid(slow_sim)
    assert [len(orjson.loads(e)["output_ids"]) for e in got] == list(range(1, k + 1))
    assert c.status == 200
    c.close()
    _assert_aborted(slow_sim, rid)


def test_unary_disconnect_while_generating(fe, slow_sim):
    c = RawClient(fe.url)
    c.send(_body(False, n=40))
    rid = _running_rid(slow_sim)
    # Past TTFT: the engine is generating the answer's tokens.
    wait_until(lambda: stats(slow_sim)["running_output_tokens"].get(rid, 0) >= 2)
    c.close()
    _assert_aborted(slow_sim, rid)


def test_hanging_up_after_the_last_token_is_not_an_abort(fe, slow_sim):
    status = _by_status(fe)
    aborted = len(stats(slow_sim)["aborted_rids"])
    c = RawClient(fe.url)
    c.send(_body(True, n=3))
    got = c.events(3)
    assert orjson.loads(got[-1])["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    c.close()
    wait_until(lambda: stats(slow_sim)["running"] == 0)
    wait_until(lambda: _by_status(fe).get("ok", 0) == status.get("ok", 0) + 1)
    assert len(stats(slow_sim)["aborted_rids"]) == aborted


def test_prefix_sharing_and_duplicate_rids_abort_only_the_disconnected(fe, slow_sim):
    """Clients ``a`` (twice) and ``ab`` run together; ``a``'s first copy
    hangs up: only its engine request is aborted."""
    clients = {}
    for name, rid in (("a1", "a"), ("a2", "a"), ("ab", "ab")):
        c = RawClient(fe.url)
        c.send(_body(True, n=12, rid=rid))
        clients[name] = c
    first = clients["a1"].events(1)
    assert orjson.loads(first[0])["meta_info"]["id"] == "a"
    wait_until(lambda: stats(slow_sim)["running"] == 3)
    running_before = set(stats(slow_sim)["running_rids"])
    aborted_before = set(stats(slow_sim)["aborted_rids"])
    clients["a1"].close()
    wait_until(lambda: stats(slow_sim)["running"] <= 2)
    newly = set(stats(slow_sim)["aborted_rids"]) - aborted_before
    assert len(newly) == 1 and newly < running_before
    for name in ("a2", "ab"):
        events = clients[name].events(100)
        assert events[-1] == b"[DONE]"
        final = orjson.loads(events[-2])
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        assert final["meta_info"]["id"] == ("a" if name == "a2" else "ab")
        clients[name].close()
    assert set(stats(slow_sim)["aborted_rids"]) - aborted_before == newly


def _h2_events(sock, conn, bufs: dict, stream_id: int, count: int) -> list[bytes]:
    """Read until ``stream_id`` has ``count`` SSE ``data`` payloads in
    ``bufs`` (stream id -> bytes, every stream's data kept); take them."""
    import h2.events

    while bufs.get(stream_id, b"").count(b"\n\n") < count:
        for event in conn.receive_data(sock.recv(65536)):
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                bufs[event.stream_id] = bufs.get(event.stream_id, b"") + event.data
        sock.sendall(conn.data_to_send())
    events = bufs[stream_id].split(b"\n\n")
    bufs[stream_id] = b"\n\n".join(events[count:])
    return [e.removeprefix(b"data: ") for e in events[:count]]


@pytest.mark.parametrize("how", ["reset", "close"])
def test_h2_stream_reset_or_closed_connection_aborts_the_engine(fe, slow_sim, how):
    """Over h2 (prior knowledge), a stream the client resets (RST_STREAM
    CANCEL) or whose connection it closes is a disconnect: its engine
    request is aborted and recorded so; a sibling stream on the same
    connection runs on to its end (reset) or is aborted too (close)."""
    import socket

    import h2.config
    import h2.connection

    status = _by_status(fe)
    seen = set(stats(slow_sim)["seen_rids"])
    host, port = fe.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    streams = {}
    for rid, n in (("gone", 30), ("stays", 4 if how == "reset" else 30)):
        sid = conn.get_next_available_stream_id()
        body = _body(True, n=n, rid=rid)
        conn.send_headers(sid, [(":method", "POST"), (":path", "/generate"), (":scheme", "http"),
                                (":authority", "127.0.0.1"), ("content-length", str(len(body)))])
        conn.send_data(sid, body, end_stream=True)
        streams[rid] = sid
    sock.sendall(conn.data_to_send())
    try:
        bufs: dict[int, bytes] = {}
        got = _h2_events(sock, conn, bufs, streams["gone"], 2)
        assert [orjson.loads(e)["meta_info"]["id"] for e in got] == ["gone", "gone"]
        # Both streams' engine requests (the short one may have finished on
        # a loaded machine: seen, not necessarily still running).
        running = wait_until(lambda: len(r := set(stats(slow_sim)["seen_rids"]) - seen) == 2 and r)
        aborted = set(stats(slow_sim)["aborted_rids"])
        if how == "reset":
            conn.reset_stream(streams["gone"])
            sock.sendall(conn.data_to_send())
            rest = _h2_events(sock, conn, bufs, streams["stays"], 5)
            assert rest[-1] == b"[DONE]"
            assert orjson.loads(rest[-2])["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
            expect = {"client_disconnect": 1, "ok": 1}
        else:
            sock.close()
            expect = {"client_disconnect": 2}
        wait_until(lambda: stats(slow_sim)["running"] == 0)
        newly = set(stats(slow_sim)["aborted_rids"]) - aborted
        assert newly <= running and len(newly) == (1 if how == "reset" else 2)
        wait_until(lambda: {k: v - status.get(k, 0) for k, v in _by_status(fe).items() if v != status.get(k, 0)}
                   == expect)
    finally:
        sock.close()


@pytest.mark.parametrize("items", [1, 2])  # 2: a batch, each item aborted by its own id
@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_slow_reader_is_cut_off_and_the_engine_aborted(worker_class, items):
    sim = start_sim()
    fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class, extra=["--slow-client-timeout", "1"])
    try:
        c = RawClient(fe.url, rcvbuf=4096)
        if items == 1:
            c.send(_body(True, n=20000))
        else:
            c.send(orjson.dumps({"input_ids": [[5, 6], [7, 8]], "rid": "slow", "stream": True,
                                 "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True}}))
        rids = wait_until(lambda: len(r := stats(sim)["seen_rids"]) == items and r)
        deadline = time.monotonic() + 45  # far past the 1 s timeout, on any machine
        # Read one byte every 0.2 s (the slow client's pace, not a wait):
        # far slower than the stream, and too little for the kernel to
        # reopen the window the frontend writes into.
        while True:
            try:
                if not c.sock.recv(1):
                    break
            except OSError:
                break
            if stats(sim)["running"] == 0:
                break
            assert time.monotonic() < deadline, "the slow reader was not cut off"
            time.sleep(0.2)
        wait_until(lambda: stats(sim)["running"] == 0)
        assert sorted(stats(sim)["aborted_rids"]) == sorted(rids)
        wait_until(lambda: _by_status(fe) == {"slow_client": items})  # counted as the handler ends
        c.close()
    finally:
        fe.stop()
        sim.stop()


@pytest.mark.parametrize("server,worker_class", [("serve", "trio"), ("serve", "asyncio"), ("serve", "uvloop"),
                                                 ("hypercorn", "trio"), ("hypercorn", "asyncio")])
def test_a_client_cut_off_for_being_slow_loses_its_connection_and_frees_its_slot(server, worker_class):
    """A client that never reads, cut off by ``--slow-client-timeout``: at
    the cut its connection is reset (the server's socket and what it queued
    are gone, the client reads a reset) and the worker's slot is free
    (``outstanding`` 0, the engine aborted), while the client still holds
    its end open."""
    sim = start_sim()
    if server == "serve":
        fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class, extra=["--slow-client-timeout", "1"])
    else:
        fe = start_hypercorn([f"sglang={sim.url}"], worker_class=worker_class,
                             env={"ASGI_GENERATE_SLOW_CLIENT_TIMEOUT": "1"})
    try:
        c = RawClient(fe.url, rcvbuf=4096)
        peer = c.sock.getsockname()[1]
        c.send(_body(True, n=20000))
        (rid,) = wait_until(lambda: stats(sim)["seen_rids"])
        assert wait_until(lambda: tcp_states(fe.port, peer) == [], timeout=10)
        (worker,) = httpx.get(fe.url + "/stats", timeout=5).json()["workers"].values()
        assert worker["outstanding"] == 0
        wait_until(lambda: stats(sim)["running"] == 0, timeout=5)
        assert stats(sim)["aborted_rids"] == [rid]
        wait_until(lambda: _by_status(fe) == {"slow_client": 1})  # counted as the handler ends
        c.sock.settimeout(5)
        with pytest.raises(ConnectionResetError):
            while c.sock.recv(65536):  # what the client's own buffer held, then the reset
                pass
        c.sock.close()
    finally:
        fe.stop()
        sim.stop()


def test_unacknowledged_abort_is_counted_and_recorded(tmp_path):
    """The engine freezes mid-stream and the client leaves: the abort, sent
    once (a slow engine gets no copy), is reported unanswered after
    ``--abort-timeout`` (counter, record) instead of hanging the handler."""
    import signal

    sim = start_sim(itl_ms=50)
    trace = tmp_path / "t.jsonl"
    fe = start_frontend([f"sglang={sim.url}"], extra=["--abort-timeout", "0.3", "--health-interval", "30",
                                                     "--trace-file", str(trace)])
    try:
        c = RawClient(fe.url)
        c.send(_body(True, n=200))
        assert len(c.events(2)) == 2
        sim.proc.send_signal(signal.SIGSTOP)
        c.close()
        wait_until(lambda: httpx.get(fe.url + "/stats").json()["aborts_unacknowledged"] == 1, timeout=10)
        fe_stats = httpx.get(fe.url + "/stats").json()
        assert (fe_stats["aborts_sent"], fe_stats["by_status"]) == (1, {"client_disconnect": 1})
        (worker,) = fe_stats["workers"].values()
        assert (worker["aborts"]["requests"], worker["state"]) == (1, "up")
    finally:
        sim.proc.send_signal(signal.SIGCONT)
        fe.stop()
        sim.stop()
    (rec,) = trace_records(str(tmp_path / "t.*.jsonl"))
    assert rec["status"] == "client_disconnect"
    assert [(a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [("aborted", False)]
