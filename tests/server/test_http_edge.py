"""Connection-level HTTP edge cases between a client and the frontend, on
raw loopback sockets, on both hypercorn worker classes: sockets released
when clients close, ``Connection: close`` followed by more bytes, half-close
at every phase of a request, unknown routes, requests with ambiguous
framing, the request head's deadline."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import time

import h11
import httpx
import orjson
import pytest

from support import (generating, post, reading_body, start_frontend, start_hypercorn, start_sim, stats, wait_until,
                     trace_records)

WORKER_CLASSES = ["trio", "asyncio"]


def _body(stream: bool, n: int, rid: str | None = None) -> bytes:
    obj = {"input_ids": [3, 4, 5], "stream": stream, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
    if rid is not None:
        obj["rid"] = rid
    return orjson.dumps(obj)


def _request(body: bytes, *headers: str, path: str = "/generate") -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_to_eof(sock: socket.socket, raw: bytes = b"") -> bytes:
    """Everything the server sends until it closes (bounded by the socket
    timeout)."""
    while data := sock.recv(65536):
        raw += data
    return raw


def _parse(raw: bytes, method: str = "POST") -> tuple[list[tuple[int, dict, bytes]], bytes]:
    """The complete HTTP/1.1 responses in ``raw`` (``(status, headers,
    body)`` each, chunked or not) and the bytes left after the last one."""
    out = []
    while raw:
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method=method, target="/", headers=[("host", "x"), ("content-length", "0")]))
        conn.send(h11.EndOfMessage())
        conn.receive_data(raw)
        head, body = None, b""
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                return out, raw  # incomplete
        out.append((head.status_code, {k.decode(): v.decode() for k, v in head.headers}, body))
        raw = conn.trailing_data[0]
    return out, raw


def _read_one(sock: socket.socket, method: str = "POST") -> tuple[int, dict, bytes]:
    """Read exactly one complete response from ``sock`` (keep-alive)."""
    raw = b""
    while True:
        data = sock.recv(65536)
        assert data, f"server closed mid-response: {raw[:200]!r}"
        raw += data
        done, rest = _parse(raw, method)
        if done:
            assert len(done) == 1 and rest == b""
            return done[0]


def _events(body: bytes) -> list[bytes]:
    """The ``data`` payloads of an SSE body."""
    return [block[6:] for block in body.split(b"\n\n") if block.startswith(b"data: ")]


class Traced:
    """A frontend process in front of ``sim`` with ``--trace-file``;
    :meth:`records` reads what its writer has flushed so far."""

    def __init__(self, tmp_path_factory, name: str, sim, worker_class: str, extra: list[str] = ()) -> None:
        self.base = str(tmp_path_factory.mktemp(f"{name}-{worker_class}") / "trace")
        self.proc = start_frontend([f"sglang={sim.url}"], worker_class=worker_class,
                                   extra=["--trace-file", self.base + ".jsonl", *extra])
        self.url = self.proc.url

    def records(self) -> list[dict]:
        return trace_records(f"{self.base}.*.jsonl")

    def next_record(self, seen: int) -> dict:
        """The record after the first ``seen`` ones (waits for it), and
        checks that no other one follows: once every record submitted to
        the writer so far is in the file, a second one of the request
        would be there too."""
        recs = wait_until(lambda: (r := self.records()) and len(r) > seen and r)
        wait_until(lambda: (t := httpx.get(self.url + "/stats", timeout=5).json()["trace"])["queued"] == 0
                   and t["submitted"] == len(self.records()))
        assert len(self.records()) == seen + 1
        return recs[seen]

    def open_fds(self) -> int:
        """File descriptors the frontend process holds."""
        return len(os.listdir(f"/proc/{self.proc.proc.pid}/fd"))

    def client_sockets(self) -> int:
        """Of those, the server sides of client connections (any TCP state
        but LISTEN) on the frontend's port."""
        inodes = set()
        for line in pathlib.Path(f"/proc/{self.proc.proc.pid}/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == self.proc.port and fields[3] != "0A":
                inodes.add(f"socket:[{fields[9]}]")
        fd_dir = f"/proc/{self.proc.proc.pid}/fd"
        count = 0
        for fd in os.listdir(fd_dir):
            try:
                count += os.readlink(f"{fd_dir}/{fd}") in inodes
            except FileNotFoundError:  # closed meanwhile
                pass
        return count

    def settled(self) -> int:
        """Wait until every record of the requests served so far is written;
        return how many there are."""
        served = httpx.get(self.url + "/stats", timeout=5).json()["request_items"]
        wait_until(lambda: len(self.records()) >= served)
        return len(self.records())


@pytest.fixture(scope="module")
def fast_sim():
    sim = start_sim()
    yield sim
    sim.stop()


@pytest.fixture(scope="module", params=[*WORKER_CLASSES, "uvloop"])
def fe(request, fast_sim, tmp_path_factory):
    traced = Traced(tmp_path_factory, "edge", fast_sim, request.param)
    yield traced
    traced.proc.stop()


# -- sockets released ---------------------------------------------------------


@pytest.mark.e2e
def test_connections_the_client_closed_release_their_fds(fe):
    """Keep-alive connections whose clients close after complete answers
    (unary, SSE, a control route) are closed by the server as they leave,
    not after hypercorn's keep-alive timeout (75 s)."""
    warm = _connect(fe.url)  # the worker connection gets pooled
    warm.sendall(_request(_body(False, 2)))
    assert _read_one(warm)[0] == 200
    warm.close()
    baseline = fe.open_fds() - fe.client_sockets()
    socks = []
    for i in range(30):
        sock = _connect(fe.url)
        if i % 3 == 2:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        else:
            sock.sendall(_request(_body(i % 3 == 1, 2)))
        assert _read_one(sock)[0] == 200
        socks.append(sock)
    assert fe.client_sockets() >= 30  # all kept alive while the clients hold them
    for sock in socks:
        sock.close()
    # Closed as the clients leave: the bound is a fraction of the keep-alive
    # timeout (75 s) that would otherwise close them.
    wait_until(lambda: fe.open_fds() <= baseline, timeout=20)


# -- Connection: close followed by more bytes ---------------------------------

TRAILING = {
    "crlf": b"\r\n",
    "pipelined": b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n",
    "garbage": b"\x00\x01 not http\r\n\r\n",
}


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
@pytest.mark.parametrize("trailing", list(TRAILING), ids=list(TRAILING))
def test_connection_close_then_more_bytes_gets_the_first_answer(fe, fast_sim, stream, trailing):
    """RFC 9112 section 9.6: the request with ``Connection: close`` is
    answered, the connection closed, the bytes after it ignored; the record
    says what the client got."""
    expected = post(fast_sim.url, _body(False, 4)).json()["output_ids"]
    seen = fe.settled()
    sock = _connect(fe.url)
    try:
        sock.sendall(_request(_body(stream, 4), "connection: close") + TRAILING[trailing])
        raw = _read_to_eof(sock)
    finally:
        sock.close()
    responses, rest = _parse(raw)
    assert [r[0] for r in responses] == [200] and rest == b"", raw[:300]
    ((_, headers, body),) = responses
    assert headers.get("connection") == "close"
    if stream:
        events = _events(body)
        assert events[-1] == b"[DONE]" and orjson.loads(events[-2])["output_ids"] == expected
    else:
        assert orjson.loads(body)["output_ids"] == expected
    rec = fe.next_record(seen)
    assert (rec["status"], rec["http_status"], rec["output_tokens"]) == ("ok", 200, 4)


@pytest.mark.e2e
def test_keep_alive_pipelining_still_answers_in_order(fe, fast_sim):
    """Without ``Connection: close``, requests sent back to back are all
    answered, in order, and the one with ``Connection: close`` ends it."""
    expected = post(fast_sim.url, _body(False, 3)).json()["output_ids"]
    sock = _connect(fe.url)
    try:
        sock.sendall(_request(_body(False, 3)) + _request(_body(True, 3))
                     + b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        raw = _read_to_eof(sock)
    finally:
        sock.close()
    responses, rest = _parse(raw)
    assert [r[0] for r in responses] == [200, 200, 200] and rest == b""
    assert orjson.loads(responses[0][2])["output_ids"] == expected
    assert orjson.loads(_events(responses[1][2])[-2])["output_ids"] == expected
    assert orjson.loads(responses[2][2])["status"] == "ok"


# -- half-close: a disconnect at every phase ----------------------------------


@pytest.fixture(scope="module")
def slow_sim():
    sim = start_sim(ttft_ms=400, itl_ms=40, extra=["--disconnect-abort-s", "60"])  # only our abort stops a job
    yield sim
    sim.stop()


@pytest.fixture(scope="module", params=WORKER_CLASSES)
def slow_fe(request, slow_sim, tmp_path_factory):
    traced = Traced(tmp_path_factory, "half", slow_sim, request.param, ["--sse-keepalive", "0"])
    yield traced
    traced.proc.stop()


def _half_close(sock: socket.socket) -> bytes:
    """``shutdown(SHUT_WR)``, then read until the server closes: what the
    server sent after the half-close (bounded by the socket timeout)."""
    sock.shutdown(socket.SHUT_WR)
    return _read_to_eof(sock)


def _tokens_in(raw: bytes) -> int:
    """Tokens in the complete SGLang SSE events of ``raw`` (cumulative)."""
    _, _, body = raw.partition(b"\r\n\r\n")
    best = 0
    for block in body.split(b"\n\n"):
        line = block.rsplit(b"\r\n", 1)[-1]  # after any chunk-size line
        if line.startswith(b"data: {"):
            best = max(best, len(orjson.loads(line[6:]).get("output_ids", [])))
    return best


def _running_rid(sim) -> str:
    (rid,) = wait_until(lambda: stats(sim)["running_rids"])
    return rid


def _assert_aborted(sim, rid: str) -> None:
    wait_until(lambda: rid in stats(sim)["aborted_rids"])
    assert stats(sim)["running"] == 0


@pytest.mark.e2e
def test_half_close_before_the_body_is_whole(slow_fe, slow_sim):
    seen, received = slow_fe.settled(), stats(slow_sim)["received"]
    sock = _connect(slow_fe.url)
    try:
        sock.sendall(_request(_body(True, 30))[:-10])
        reading_body(slow_fe.url)
        assert _half_close(sock) == b""  # nothing sent, connection closed
    finally:
        sock.close()
    rec = slow_fe.next_record(seen)
    assert (rec["status"], rec["output_tokens"], rec["attempts"]) == ("client_disconnect", 0, [])
    assert stats(slow_sim)["received"] == received


@pytest.mark.e2e
@pytest.mark.parametrize("stream,tokens", [(False, 0), (True, 0), (False, 1)],
                         ids=["first-token-unary", "first-token-sse", "unary-generating"])
def test_half_close_before_any_output(slow_fe, slow_sim, stream, tokens):
    """Waiting for the first token, or (``tokens`` generated, past the
    400 ms TTFT) while the engine generates a unary answer: nothing was
    sent, nothing is."""
    seen = slow_fe.settled()
    sock = _connect(slow_fe.url)
    try:
        sock.sendall(_request(_body(stream, 60)))
        rid = _running_rid(slow_sim)
        if tokens:
            generating(slow_sim, tokens=tokens)
        assert _half_close(sock) == b""
    finally:
        sock.close()
    _assert_aborted(slow_sim, rid)
    rec = slow_fe.next_record(seen)
    assert (rec["status"], rec["output_tokens"]) == ("client_disconnect", 0)
    assert [(a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [("aborted", True)]


@pytest.mark.e2e
@pytest.mark.parametrize("k,trailing", [(1, b""), (5, b""), (3, b"\r\n")], ids=["1", "5", "crlf-3"])
def test_half_close_mid_stream(slow_fe, slow_sim, k, trailing):
    """Also after a stray CRLF behind the request (which RFC 9112 section
    2.2 lets a server ignore)."""
    seen = slow_fe.settled()
    sock = _connect(slow_fe.url)
    try:
        sock.sendall(_request(_body(True, 200)) + trailing)
        raw = b""
        while _tokens_in(raw) < k:
            raw += sock.recv(65536)
        rid = _running_rid(slow_sim)
        raw += _half_close(sock)
        got = _tokens_in(raw)
    finally:
        sock.close()
    assert k <= got < 200 and b"[DONE]" not in raw
    _assert_aborted(slow_sim, rid)
    rec = slow_fe.next_record(seen)
    assert (rec["status"], rec["http_status"], rec["output_tokens"]) == ("client_disconnect", 200, got)
    assert [(a["outcome"], a["abort_acked"]) for a in rec["attempts"]] == [("aborted", True)]


# -- consistency: unknown routes, SGLang's 5xx type ---------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("method,path", [("GET", "/nope"), ("POST", "/v1/generate"), ("DELETE", "/"),
                                         ("POST", "/generate/"), ("GET", "/inference/v1/generate/x")])
def test_unknown_routes_are_fastapis_404(fe, method, path):
    """SGLang and vLLM serve FastAPI apps: an unknown route gets Starlette's
    404 through FastAPI's default handler, ``{"detail": "Not Found"}``."""
    resp = httpx.request(method, fe.url + path, timeout=10)
    assert resp.status_code == 404
    assert resp.headers["content-type"] == "application/json"
    assert resp.content == b'{"detail":"Not Found"}'


def test_sglang_5xx_has_one_type_unary_and_in_band():
    from asgi_generate.sdk._codec import RequestError
    from asgi_generate_sglang import SGLangCodec

    codec = SGLangCodec()
    for status in (500, 503):
        err = RequestError(status, "no healthy worker for protocol 'sglang'", "unavailable")
        assert orjson.loads(codec.error_body(err)) == {
            "object": "error", "message": err.message, "type": str(status), "param": None, "code": status}
        assert orjson.loads(codec.in_band_error(err)) == {
            "error": {"message": err.message, "type": str(status), "code": status}}


@pytest.mark.e2e
@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_sglang_unary_503_when_no_worker_is_up(worker_class):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        proc = start_frontend([f"sglang=http://127.0.0.1:{dead.getsockname()[1]}"], worker_class=worker_class,
                              health="/stats")
        try:
            for stream in (False, True):
                resp = post(proc.url, _body(stream, 2))
                assert resp.status_code == 503
                assert resp.json() == {"object": "error", "message": "no healthy worker for protocol 'sglang'",
                                       "type": "503", "param": None, "code": 503}
        finally:
            proc.stop()
    finally:
        dead.close()


# -- tokens counted are tokens written ----------------------------------------


async def _serve_in_process(url: str, send_hook) -> tuple[list[dict], "RequestState"]:
    """One SGLang SSE request (20 tokens) through an in-process App whose
    ASGI ``send`` calls ``send_hook(message, receive_queue)``, which may
    raise. Returns the messages that went out and the request's finished
    state."""
    import anyio

    from asgi_generate.server.app import App
    from asgi_generate.config import Settings

    app = App(Settings(workers=[("sglang", url)], sse_keepalive=0))
    finished = []
    app.recorder.request_finished = finished.append
    to_life, life_in = anyio.create_memory_object_stream(4)
    life_out, from_life = anyio.create_memory_object_stream(4)
    async with anyio.create_task_group() as tg:
        tg.start_soon(app, {"type": "lifespan"}, life_in.receive, life_out.send)
        await to_life.send({"type": "lifespan.startup"})
        assert (await from_life.receive())["type"] == "lifespan.startup.complete"
        to_app, app_in = anyio.create_memory_object_stream(16)
        await to_app.send({"type": "http.request", "body": _body(True, 20), "more_body": False})
        out: list[dict] = []

        async def send(message: dict) -> None:
            send_hook(message, to_app)
            out.append(message)

        scope = {"type": "http", "method": "POST", "path": "/generate", "headers": [], "query_string": b""}
        with anyio.fail_after(20):
            await app(scope, app_in.receive, send)
        await to_life.send({"type": "lifespan.shutdown"})
        assert (await from_life.receive())["type"] == "lifespan.shutdown.complete"
    (st,) = finished
    return out, st


@pytest.mark.e2e
@pytest.mark.parametrize("backend", WORKER_CLASSES)
@pytest.mark.parametrize("gone_at", [2, 5])
@pytest.mark.parametrize("when", ["before", "during"])
def test_tokens_counted_are_tokens_written_when_the_client_leaves_at_a_write(backend, gone_at, when, caplog):
    """The client goes away right before the handler's write number
    ``gone_at`` (its disconnect queued as the previous write returns, as
    hypercorn does on reading the end of stream) or during it; the server
    raises on that write and every later one (ASGI: send on a closed
    connection; our hypercorn, ``hypercorn_fixes._HTTPStream``, does for
    writes after the close). The record counts only what went out."""
    import anyio

    from asgi_generate.exceptions import ClientGone

    sim = start_sim(itl_ms=30)
    writes = 0

    def hook(message: dict, to_app) -> None:
        nonlocal writes
        if message["type"] != "http.response.body":
            return
        writes += 1
        if writes == gone_at - (when == "before"):
            to_app.send_nowait({"type": "http.disconnect"})
        if writes >= gone_at:
            raise ClientGone("the client closed the connection")

    try:
        out, st = anyio.run(_serve_in_process, sim.url, hook, backend=backend)
    finally:
        sim.stop()
    sent = b"".join(m["body"] for m in out if m["type"] == "http.response.body")
    counts = [len(orjson.loads(e)["output_ids"]) for e in _events(sent)]
    assert counts == list(range(1, len(counts) + 1)) and len(counts) >= gone_at - 1
    assert (st.status, st.output_tokens) == ("client_disconnect", counts[-1])
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


# -- one write per fixed-length answer ------------------------------------------


def _protocol_writes(events: list) -> list[bytes]:
    """The bytes our H11 protocol writes for a GET answered with ``events``."""
    import anyio
    from hypercorn.asyncio.worker_context import WorkerContext
    from hypercorn.config import Config
    from hypercorn.events import RawData

    from asgi_generate.server.hypercorn.fixes import _H11Protocol

    writes: list[bytes] = []

    async def send(event) -> None:
        if isinstance(event, RawData) and event.data:
            writes.append(event.data)

    async def main() -> None:
        proto = _H11Protocol(None, Config(), WorkerContext(None), None, None, False, None, None, send)
        proto.connection.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert type(proto.connection.next_event()) is h11.Request
        for event in events:
            await proto.stream_send(event)

    anyio.run(main)
    return writes


def test_a_fixed_length_answer_leaves_in_one_write_a_streamed_head_at_once():
    from hypercorn.protocol.events import Body, EndBody, Response, StreamClosed

    fixed = _protocol_writes([Response(stream_id=1, headers=[(b"content-length", b"5")], status_code=200),
                              Body(stream_id=1, data=b"hello"), EndBody(stream_id=1)])
    assert len(fixed) == 1
    head = rb"HTTP/1\.1 %d \r\n%sdate: [^\r]+\r\nserver: hypercorn-h11\r\n\r\n"
    assert re.fullmatch(head % (200, rb"content-length: 5\r\n") + b"hello", fixed[0])
    empty = _protocol_writes([Response(stream_id=1, headers=[(b"content-length", b"0")], status_code=204),
                              EndBody(stream_id=1)])
    assert len(empty) == 1 and re.fullmatch(head % (204, rb"content-length: 0\r\n"), empty[0])
    streamed = _protocol_writes([Response(stream_id=1, headers=[(b"content-type", b"text/event-stream")],
                                          status_code=200)])
    assert len(streamed) == 1  # not held for a body
    assert re.fullmatch(rb"HTTP/1\.1 200 \r\ncontent-type: text/event-stream\r\ndate: [^\r]+\r\n"
                        rb"server: hypercorn-h11\r\nTransfer-Encoding: chunked\r\n\r\n", streamed[0])
    abandoned = _protocol_writes([Response(stream_id=1, headers=[(b"content-length", b"5")], status_code=200),
                                  StreamClosed(stream_id=1)])
    assert len(abandoned) == 1 and re.fullmatch(head % (200, rb"content-length: 5\r\n"), abandoned[0])


@pytest.mark.e2e
@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_burst_of_connections_waits_in_the_listen_queue(worker_class):
    """400 clients connect at once while the frontend cannot accept (stopped):
    the kernel completes every handshake (a queue of LISTEN_BACKLOG, not the
    100 hypercorn would set again, which held 101 and reset the rest once
    trio fell behind), and each gets its answer once the frontend runs."""
    import select
    import signal

    from asgi_generate.server.serving import LISTEN_BACKLOG

    sim = start_sim()
    fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class)
    host, port = fe.url.removeprefix("http://").rsplit(":", 1)
    socks: list[socket.socket] = []
    try:
        fe.signal(signal.SIGSTOP)
        try:
            for _ in range(400):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex((host, int(port)))
                socks.append(s)
            time.sleep(0.5)  # a dropped SYN is sent again only after 1 s
            poller = select.poll()
            for s in socks:
                poller.register(s, select.POLLOUT)
            established = sum(1 for _fd, ev in poller.poll(0) if ev & select.POLLOUT and not ev & select.POLLERR)
        finally:
            fe.signal(signal.SIGCONT)
        for s in socks:
            s.setblocking(True)
            s.settimeout(30)
            s.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        heads = [s.recv(12) for s in socks]
        assert (LISTEN_BACKLOG, established) == (2048, 400)
        assert heads == [b"HTTP/1.1 200"] * 400
    finally:
        for s in socks:
            s.close()
        fe.stop()
        sim.stop()


# -- ambiguous framing: refused, the connection closed --------------------------

#: A request a client hides behind the framing header a proxy might not read.
SMUGGLED = b"GET /stats HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
_BODY = b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}'
_CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_BODY), _BODY)


def _framed(version: str, lines: list[str], body: bytes) -> bytes:
    head = "".join(f"{line}\r\n" for line in lines)
    return (f"POST /generate HTTP/{version}\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"{head}\r\n").encode("latin-1") + body


#: name: (HTTP version, header lines after content-type, body, the status).
#: Each request is followed, on the same connection, by SMUGGLED.
AMBIGUOUS = {
    # The smuggling of RFC 9112 section 11.2: a proxy framing by
    # Content-Length forwards SMUGGLED as part of this body.
    "te-and-cl": ("1.1", [f"content-length: {5 + len(SMUGGLED)}", "transfer-encoding: chunked"],
                  b"0\r\n\r\n" + SMUGGLED, 400),
    "cl-after-te": ("1.1", ["transfer-encoding: chunked", f"content-length: {len(_CHUNKED)}"], _CHUNKED, 400),
    "te-and-cl-http10": ("1.0", ["transfer-encoding: chunked", f"content-length: {len(_CHUNKED)}"], _CHUNKED, 400),
    "te-http10": ("1.0", ["transfer-encoding: chunked"], _CHUNKED, 400),
    "chunked-twice": ("1.1", ["transfer-encoding: chunked, chunked"], _CHUNKED, 400),
    "chunked-on-two-lines": ("1.1", ["transfer-encoding: chunked", "transfer-encoding: chunked"], _CHUNKED, 400),
    "chunked-not-last": ("1.1", ["transfer-encoding: chunked, gzip"], _CHUNKED, 400),
    "unknown-coding": ("1.1", ["transfer-encoding: gzip"], _CHUNKED, 400),
    "identity": ("1.1", ["transfer-encoding: identity", f"content-length: {len(_BODY)}"], _BODY, 400),
    "empty-coding": ("1.1", ["transfer-encoding: , chunked"], _CHUNKED, 400),
    "coding-with-parameter": ("1.1", ["transfer-encoding: chunked;q=1"], _CHUNKED, 400),
    "no-coding": ("1.1", ["transfer-encoding:"], _CHUNKED, 400),
    "coding-before-chunked": ("1.1", ["transfer-encoding: gzip, chunked"], _CHUNKED, 501),
    "te-space-before-colon": ("1.1", ["transfer-encoding : chunked", f"content-length: {len(_CHUNKED)}"],
                              _CHUNKED, 400),
    "te-vertical-tab": ("1.1", ["transfer-encoding:\x0bchunked"], _CHUNKED, 400),
    "te-folded": ("1.1", ["transfer-encoding:", " chunked"], _CHUNKED, 400),
    "te-leading-space": ("1.1", [" transfer-encoding: chunked"], _CHUNKED, 400),
    "cl-plus": ("1.1", [f"content-length: +{len(_BODY)}"], _BODY, 400),
    "cl-minus": ("1.1", [f"content-length: -{len(_BODY)}"], _BODY, 400),
    "cl-list-differing": ("1.1", [f"content-length: {len(_BODY)},{len(_BODY) + 1}"], _BODY, 400),
    "cl-lines-differing": ("1.1", [f"content-length: {len(_BODY)}", f"content-length: {len(_BODY) + 1}"],
                           _BODY, 400),
    "cl-empty-element": ("1.1", [f"content-length: {len(_BODY)},"], _BODY, 400),
    "cl-leading-junk": ("1.1", [f"content-length: x{len(_BODY)}"], _BODY, 400),
    "cl-trailing-junk": ("1.1", [f"content-length: {len(_BODY)}x"], _BODY, 400),
    "cl-hex": ("1.1", [f"content-length: 0x{len(_BODY):x}"], _BODY, 400),
    "cl-inner-space": ("1.1", [f"content-length: {len(_BODY)} 0"], _BODY, 400),
    "cl-space-before-colon": ("1.1", [f"content-length : {len(_BODY)}"], _BODY, 400),
    "cl-folded": ("1.1", ["content-length:", f"\t{len(_BODY)}"], _BODY, 400),
    "other-header-folded": ("1.1", ["x-note: a", " b", f"content-length: {len(_BODY)}"], _BODY, 400),
}

#: Framing read one way only: answered, and SMUGGLED after it too.
UNAMBIGUOUS = {
    "cl-with-whitespace": ("1.1", [f"Content-Length:\t {len(_BODY)} \t"], _BODY),
    "cl-repeated": ("1.1", [f"content-length: {len(_BODY)}", f"content-length: {len(_BODY)}, {len(_BODY)}"],
                    _BODY),
    "chunked-any-case-with-whitespace": ("1.1", ["Transfer-Encoding:\t ChUnKeD \t"], _CHUNKED),
}


def _closes(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=10).json()["connections_closed"]


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(AMBIGUOUS), ids=list(AMBIGUOUS))
def test_ambiguous_framing_is_refused_and_the_connection_closed(fe, case):
    """RFC 9112 sections 5.2, 6.1, 6.3: a request whose length could be read
    two ways gets an empty 400 (501 for a coding before chunked) with
    ``connection: close`` before the app sees it (no request counted, no
    body budget), and the request behind it on the connection is not
    served."""
    version, lines, body, status = AMBIGUOUS[case]
    before = httpx.get(fe.url + "/stats", timeout=10).json()
    sock = _connect(fe.url)
    try:
        sock.sendall(_framed(version, lines, body) + SMUGGLED)
        raw = _read_to_eof(sock)
    finally:
        sock.close()
    responses, rest = _parse(raw)
    assert len(responses) == 1 and rest == b"", raw[:400]
    got, headers, answer = responses[0]
    assert (got, headers["connection"], headers["content-length"], answer) == (status, "close", "0", b"")
    after = httpx.get(fe.url + "/stats", timeout=10).json()
    assert after["connections_closed"]["ambiguous_framing"] == before["connections_closed"]["ambiguous_framing"] + 1
    assert (after["http_requests"], after["body_budget"]["in_use_bytes"]) == (before["http_requests"], 0)


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(UNAMBIGUOUS), ids=list(UNAMBIGUOUS))
def test_framing_read_one_way_is_served_with_the_next_request(fe, case):
    """Whitespace around a value, ``chunked`` in any case and a
    ``Content-Length`` repeated with its own value (RFC 9110 section 8.6)
    are one framing: answered, and the connection kept for the next
    request."""
    version, lines, body = UNAMBIGUOUS[case]
    before = _closes(fe.url)["ambiguous_framing"]
    sock = _connect(fe.url)
    try:
        sock.sendall(_framed(version, lines, body) + SMUGGLED)
        raw, responses = b"", []
        while len(responses) < 2:
            data = sock.recv(65536)
            assert data, f"server closed: {raw[:400]!r}"
            raw += data
            responses, rest = _parse(raw)
        first, second = responses
        assert rest == b""
    finally:
        sock.close()
    assert (first[0], len(orjson.loads(first[2])["output_ids"])) == (200, 1)
    assert second[0] == 200 and "connections_closed" in orjson.loads(second[2])
    assert _closes(fe.url)["ambiguous_framing"] == before


def test_framing_problem_reads_each_case_as_the_frontend_answers_it():
    """:func:`framing_problem` (no process): the status of every case above,
    ``None`` for the unambiguous ones, on lines ended by LF alone too."""
    from asgi_generate.server.hypercorn.fixes import framing_problem

    for cases, status_of in ((AMBIGUOUS, lambda case: case[3]), (UNAMBIGUOUS, lambda case: None)):
        for name, case in cases.items():
            head = _framed(case[0], case[1], b"")
            for text in (head, head.replace(b"\r\n", b"\n")):
                problem = framing_problem(text)
                assert (problem and problem[0]) == status_of(case), (name, text, problem)


@pytest.mark.parametrize("pipelined", [False, True], ids=["first", "after-a-request"])
def test_a_head_read_a_byte_at_a_time_is_refused_once_whole(pipelined):
    """:class:`fixes._EdgeConnection` (no process) reads a head that comes a
    byte at a time (its blank line split between reads), or behind a
    request on a keep-alive connection, as a whole one: each ambiguous
    head is refused with its status once its blank line is in, exactly
    once, and nothing after it is read; an unambiguous one is parsed."""
    from asgi_generate.server.hypercorn.fixes import _EdgeConnection

    good = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    for cases, status_of in ((AMBIGUOUS, lambda case: case[3]), (UNAMBIGUOUS, lambda case: None)):
        for name, case in cases.items():
            conn = _EdgeConnection(h11.SERVER)
            head = _framed(case[0], case[1], b"")
            if pipelined:
                conn.receive_data(good + head[:5])
                assert type(conn.next_event()) is h11.Request and type(conn.next_event()) is h11.EndOfMessage
                conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                conn.send(h11.EndOfMessage())
                conn.start_next_cycle()
                head = head[5:]
            refusals, requests = [], []
            for i in range(len(head)):
                conn.receive_data(head[i:i + 1])
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    refusals.append((i, exc.error_status_hint))
                else:
                    requests += [i] if type(event) is h11.Request else []
            if status_of(case) is None:
                assert (refusals, requests) == ([], [len(head) - 1]), name
            else:
                assert (refusals, requests) == ([(len(head) - 1, status_of(case))], []), name
                conn.receive_data(SMUGGLED)
                assert conn.next_event() is h11.NEED_DATA, name


# -- the request head's deadline --------------------------------------------------


@pytest.mark.parametrize("sent,writable,answered", [
    (b"GET / HTTP/1.1\r\nhost: x\r\n", True, True),
    (b"GET / HTTP/1.1\r\nhost: x\r\n", False, False),
    (b"", True, False),
], ids=["part-of-a-head", "part-of-a-head-no-room", "nothing"])
def test_the_protocol_at_the_head_deadline(monkeypatch, sent, writable, answered):
    """:class:`fixes._H11Protocol` (no process): its first head is due from
    ``initiate()``, and again once a read leaves part of a head; at the
    deadline it answers 408 with ``connection: close`` only if part of the
    head came and the connection has room for it, then closes; counted
    once either way."""
    import anyio
    from hypercorn.asyncio.worker_context import WorkerContext
    from hypercorn.config import Config
    from hypercorn.events import Closed, RawData

    from asgi_generate.server.hypercorn import edge_counts, fixes

    monkeypatch.setattr(fixes, "header_read_timeout", 1.0)
    monkeypatch.setitem(edge_counts.closed, "header_timeout", 0)
    events: list = []

    async def send(event) -> None:
        events.append(event)

    async def main() -> None:
        proto = fixes._H11Protocol(None, Config(), WorkerContext(None), None, None, False, None, None, send)
        await proto.initiate()
        if sent:
            await proto.handle(RawData(sent))
        await proto.handle(fixes.HeadTimedOut(writable))
        await proto.handle(RawData(b"x-more: 1\r\n\r\n"))  # after the deadline: not read

    anyio.run(main)
    due = [fixes.HeadDeadline()] * (2 if sent else 1)
    assert events[:len(due)] == due and type(events[-1]) is Closed
    writes = [e.data for e in events[len(due):-1]]
    if answered:
        assert len(writes) == 1 and re.fullmatch(
            rb"HTTP/1\.1 408 \r\ncontent-length: 0\r\nconnection: close\r\ndate: [^\r]+\r\n"
            rb"server: hypercorn-h11\r\n\r\n", writes[0]), writes
    else:
        assert writes == []
    assert edge_counts.closed["header_timeout"] == 1

#: --header-read-timeout of the frontends below, seconds.
HEAD_DEADLINE = 2


@pytest.fixture(scope="module", params=[*WORKER_CLASSES, "uvloop"])
def head_fe(request, fast_sim):
    proc = start_frontend([f"sglang={fast_sim.url}"], worker_class=request.param,
                          extra=["--header-read-timeout", str(HEAD_DEADLINE)])
    yield proc
    proc.stop()


def _trickle_until_answered(sock: socket.socket, lines: list[bytes], bound: float = 40.0) -> bytes:
    """Send one of ``lines`` (then the last again and again) each time the
    server has said nothing for 0.2 s, until it answers or closes; all it
    sent then, to its end. Bounded by ``bound`` seconds, below hypercorn's
    keep-alive timeout (75 s), which would close the connection too."""
    import select

    def rest() -> bytes:
        # A line sent as the server closed makes its kernel reset the
        # connection: what came before the reset is the answer.
        raw = b""
        try:
            while data := sock.recv(65536):
                raw += data
        except ConnectionResetError:
            pass
        return raw

    end = time.monotonic() + bound
    sent = 0
    while time.monotonic() < end:
        if select.select([sock], [], [], 0.2)[0]:
            return rest()
        try:
            sock.sendall(lines[min(sent, len(lines) - 1)])
        except OSError:  # closed meanwhile
            return rest()
        sent += 1
    raise AssertionError(f"no answer within {bound} s")


def _metric(url: str, reason: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf'^asgi_generate_connections_closed_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(match.group(1))


_HEAD_LINES = [b"POST /generate HTTP/1.1\r\n", b"host: 127.0.0.1\r\n", b"x-slow: 1\r\n"]


@pytest.mark.e2e
def test_a_head_sent_a_line_at_a_time_gets_408_at_its_deadline(head_fe):
    """A client sending its head a line at a time, faster than any idle
    timeout would notice, gets 408 with ``connection: close`` once the
    whole head is past --header-read-timeout, and the connection is closed;
    /stats and /metrics count it."""
    before = _closes(head_fe.url)
    sock = _connect(head_fe.url)
    try:
        raw = _trickle_until_answered(sock, _HEAD_LINES)
    finally:
        sock.close()
    responses, rest = _parse(raw)
    assert len(responses) == 1 and rest == b"", raw[:300]
    status, headers, body = responses[0]
    assert (status, headers["connection"], headers["content-length"], body) == (408, "close", "0", b"")
    after = _closes(head_fe.url)
    assert after == {**before, "header_timeout": before["header_timeout"] + 1}
    assert _metric(head_fe.url, "header_timeout") == after["header_timeout"]


@pytest.mark.e2e
def test_a_connection_that_sends_nothing_is_closed_unanswered_at_the_deadline(head_fe):
    """The first request's head is due from accept: a connection that sends
    nothing is closed at --header-read-timeout (not after the keep-alive
    timeout), with no answer, and counted."""
    before = _closes(head_fe.url)["header_timeout"]
    sock = _connect(head_fe.url)
    sock.settimeout(40)  # below the keep-alive timeout (75 s)
    try:
        assert sock.recv(65536) == b""
    finally:
        sock.close()
    assert _closes(head_fe.url)["header_timeout"] == before + 1


@pytest.mark.e2e
def test_a_later_heads_deadline_starts_at_its_first_byte(head_fe):
    """On a keep-alive connection the next head's deadline starts at its
    first byte: a connection idle for longer than the deadline (since before
    another connection's head timed out) still serves a request, and then a
    head trickled on it gets its 408."""
    before = _closes(head_fe.url)["header_timeout"]
    kept = _connect(head_fe.url)
    try:
        kept.sendall(_request(_body(False, 2)))
        assert _read_one(kept)[0] == 200
        other = _connect(head_fe.url)
        try:
            assert _parse(_trickle_until_answered(other, _HEAD_LINES))[0][0][0] == 408
        finally:
            other.close()
        kept.sendall(_request(_body(False, 2)))  # idle longer than the deadline: still open
        assert _read_one(kept)[0] == 200
        responses, rest = _parse(_trickle_until_answered(kept, _HEAD_LINES))
    finally:
        kept.close()
    assert ([r[0] for r in responses], rest) == ([408], b"")
    assert _closes(head_fe.url)["header_timeout"] == before + 2


@pytest.mark.e2e
def test_part_of_a_pipelined_head_has_its_deadline_from_the_answer_before_it(head_fe):
    """Part of a head that came with the request before it: that request is
    answered, then the rest of the head is due within the deadline; never
    sent, it gets 408 and the connection closes."""
    before = _closes(head_fe.url)["header_timeout"]
    sock = _connect(head_fe.url)
    sock.settimeout(40)  # below the keep-alive timeout (75 s)
    try:
        sock.sendall(_request(_body(False, 2)) + b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        raw = _read_to_eof(sock)
    finally:
        sock.close()
    responses, rest = _parse(raw)
    assert ([r[0] for r in responses], rest) == ([200, 408], b"")
    assert responses[1][1]["connection"] == "close"
    assert _closes(head_fe.url)["header_timeout"] == before + 1


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["hypercorn-trio", "hypercorn-asyncio", "serve-workers-2"])
def test_the_head_deadline_and_the_framing_check_under_every_entry_point(fast_sim, how):
    """The setting reaches the patches however the app is served: a
    hypercorn run by hand (``ASGI_GENERATE_HEADER_READ_TIMEOUT``) and
    ``serve --workers 2`` (each process): a trickled head gets its 408, a
    request with both framing headers its 400."""
    if how == "serve-workers-2":
        proc = start_frontend([f"sglang={fast_sim.url}"], worker_class="trio",
                              extra=["--workers", "2", "--header-read-timeout", str(HEAD_DEADLINE)])
    else:
        proc = start_hypercorn([f"sglang={fast_sim.url}"], worker_class=how.split("-")[1],
                               env={"ASGI_GENERATE_HEADER_READ_TIMEOUT": str(HEAD_DEADLINE)})
    try:
        sock = _connect(proc.url)
        try:
            responses, rest = _parse(_trickle_until_answered(sock, _HEAD_LINES))
        finally:
            sock.close()
        assert ([r[0] for r in responses], rest) == ([408], b"")
        version, lines, body, status = AMBIGUOUS["te-and-cl"]
        sock = _connect(proc.url)
        try:
            sock.sendall(_framed(version, lines, body) + SMUGGLED)
            responses, rest = _parse(_read_to_eof(sock))
        finally:
            sock.close()
        assert ([(r[0], r[1]["connection"]) for r in responses], rest) == ([(400, "close")], b"")
    finally:
        proc.stop()
