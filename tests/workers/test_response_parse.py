"""The worker client's response parse, byte for byte: exact bytes in (one
socket read per piece, from an in-memory connection), exact status,
headers and body pieces out, and whether the connection went back to the
pool. Content-Length, chunked (split at every byte, and anywhere), trailers,
1xx, no body (HEAD, 204, 304), a body delimited by the close, the head's
bound, malformed and cut answers; and the request's own bytes."""

from __future__ import annotations

import math
import re

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate.exceptions import TimedOut, Unanswered, WorkerDisconnected
from asgi_generate.workers import http
from asgi_generate.workers.http import ConnectionPool

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    return request.param


class Wire:
    """A worker connection in memory: each read returns the next of
    ``pieces`` (``None``: the read's deadline passed), then ``b""`` (the
    worker's close, which makes it stale) once they run out. ``sent`` has
    what was written."""

    def __init__(self, pieces: list[bytes | None]) -> None:
        self.pieces = list(pieces)
        self.sent: list[bytes] = []
        self.closed = self.eof = False

    async def receive(self, max_bytes: int, deadline: float = math.inf, wait_first: bool = False) -> bytes | None:
        await anyio.lowlevel.checkpoint()
        if self.pieces:
            return self.pieces.pop(0)
        self.eof = True
        return b""

    async def send(self, data: bytes) -> None:
        self.sent.append(data)

    def stale(self) -> bool:
        return self.eof

    async def aclose(self) -> None:
        self.closed = True


def pool_on(*wires: Wire) -> ConnectionPool:
    """A pool whose connections are ``wires``, in order."""
    pool = ConnectionPool("127.0.0.1", 8000)
    queue = list(wires)

    async def connect():
        pool.opened += 1
        return http._Connection(queue.pop(0))

    pool._connect = connect
    return pool


async def exchange(pool: ConnectionPool, method: bytes = b"POST") -> tuple[int, bytes | None, bytes | None, list]:
    """One request: ``(status, content_type, retry_after, [each read_some's bytes])``."""
    async with pool.request(method, b"/generate", b"{}") as resp:
        reads = []
        while (data := await resp.read_some()) is not None:
            reads.append(data)
        return resp.status, resp.content_type, resp.retry_after, reads


SSE = b"data: {\"text\": \"a\", \"output_ids\": [5]}\n\n"


def chunked(*chunks: bytes, trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n" + trailers + b"\r\n"


HEAD_SSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_content_length_answer_exactly():
    wire = Wire([b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 7\r\n"
                 b"content-length: 11\r\n\r\n{\"a\": true}"])
    pool = pool_on(wire)
    assert await exchange(pool) == (503, b"application/json", b"7", [b'{"a": true}'])
    assert (pool.opened, pool.idle, pool.retired, wire.closed) == (1, 1, 0, False)


async def test_each_read_hands_on_all_it_brought_and_the_connection_is_reused():
    first = Wire([HEAD_SSE + b"%x\r\n%s\r\n" % (len(SSE), SSE) * 2, chunked(SSE, b"data: [DONE]\n\n")])
    pool = pool_on(first)
    assert await exchange(pool) == (200, b"text/event-stream; charset=utf-8", None,
                                    [SSE * 2, SSE + b"data: [DONE]\n\n"])
    first.pieces = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    assert await exchange(pool) == (200, None, None, [b"ok"])
    assert (pool.opened, pool.idle, pool.retired) == (1, 1, 0)


async def test_the_request_goes_out_as_h11_wrote_it():
    wire = Wire([b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"])
    pool = pool_on(wire)
    async with pool.request(b"POST", b"/generate?x=1", b'{"rid": "e0"}', [(b"content-type", b"application/json")]):
        pass
    assert b"".join(wire.sent) == (b"POST /generate?x=1 HTTP/1.1\r\nhost: 127.0.0.1:8000\r\ncontent-length: 13\r\n"
                                   b"content-type: application/json\r\n\r\n" + b'{"rid": "e0"}')


@pytest.mark.parametrize(("path", "headers"), [(b"/x\r\nhost: evil", []), (b"/a b", []),
                                               (b"/", [(b"x-a", b"1\r\nhost: evil")]), (b"/", [(b"x a", b"1")])])
async def test_a_request_that_cannot_be_written_as_itself_is_refused_unsent(path, headers):
    wire = Wire([b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"])
    pool = pool_on(wire)
    with pytest.raises(Exception) as exc:
        async with pool.request(b"GET", path, b"", headers):
            pass
    # h11 refused it with its LocalProtocolError; httptools' client with a ValueError.
    assert type(exc.value).__name__ in ("ValueError", "LocalProtocolError")
    assert wire.sent == []


#: A whole SGLang-like SSE answer, with which of its bytes are body bytes.
SEGMENTS = [(HEAD_SSE, False)]
for _event in (SSE, SSE, b"data: [DONE]\n\n"):
    SEGMENTS += [(b"%x\r\n" % len(_event), False), (_event, True), (b"\r\n", False)]
SEGMENTS += [(b"0\r\nx-trailer: 1\r\n\r\n", False)]
RAW = b"".join(s for s, _ in SEGMENTS)
IS_BODY = [body for s, body in SEGMENTS for _ in s]
BODY = b"".join(s for s, body in SEGMENTS if body)


def reads_of(cuts: list[int]) -> list[bytes]:
    """What each read_some returns when RAW arrives in pieces cut at ``cuts``:
    the body bytes each piece brought, the pieces that brought none skipped."""
    bounds = [0, *sorted(cuts), len(RAW)]
    pieces = [bytes(RAW[i] for i in range(a, b) if IS_BODY[i]) for a, b in zip(bounds, bounds[1:])]
    return [p for p in pieces if p]


def pieces_of(cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(RAW)]
    return [RAW[a:b] for a, b in zip(bounds, bounds[1:])]


async def test_an_answer_split_in_two_at_every_byte_boundary():
    for cut in range(1, len(RAW)):
        pool = pool_on(Wire(pieces_of([cut])))
        got = await exchange(pool)
        assert got == (200, b"text/event-stream; charset=utf-8", None, reads_of([cut])), cut
        assert b"".join(got[3]) == BODY
        assert (pool.idle, pool.retired) == (1, 0), cut


async def test_an_answer_one_byte_per_read():
    pool = pool_on(Wire([RAW[i:i + 1] for i in range(len(RAW))]))
    assert await exchange(pool) == (200, b"text/event-stream; charset=utf-8", None, list(BODY[i:i + 1]
                                                                                       for i in range(len(BODY))))
    assert (pool.idle, pool.retired) == (1, 0)


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(min_value=1, max_value=len(RAW) - 1), max_size=40))
def test_an_answer_split_anywhere_reads_back_exactly(cuts):
    async def run():
        pool = pool_on(Wire(pieces_of(list(cuts))))
        return await exchange(pool), (pool.idle, pool.retired)

    assert anyio.run(run) == ((200, b"text/event-stream; charset=utf-8", None, reads_of(list(cuts))), (1, 0))


async def test_trailers_are_read_past_and_change_no_header():
    pool = pool_on(Wire([HEAD_SSE + chunked(b"ab", trailers=b"content-type: evil\r\nx-usage: 3\r\n")]))
    assert await exchange(pool) == (200, b"text/event-stream; charset=utf-8", None, [b"ab"])
    assert (pool.idle, pool.retired) == (1, 0)


@pytest.mark.parametrize("size", [b"zz", b"-1", b"1x"])
async def test_a_malformed_chunk_size_breaks_http_and_retires_the_connection(size):
    wire = Wire([HEAD_SSE + b"3\r\nabc\r\n", size + b"\r\nabc\r\n0\r\n\r\n"])
    pool = pool_on(wire)
    async with pool.request(b"POST", b"/generate", b"{}") as resp:
        assert await resp.read_some() == b"abc"
        with pytest.raises(WorkerDisconnected) as exc:
            await resp.read_some()
    assert re.fullmatch(r"worker broke HTTP/1\.1: .*chunk.*", str(exc.value), re.IGNORECASE), str(exc.value)
    assert (pool.idle, pool.retired, wire.closed) == (0, 1, True)


async def test_a_head_still_incomplete_past_16_kib_is_refused():
    # 16 KiB: h11's max_incomplete_event_size default, now the client's MAX_HEAD_BYTES.
    line = b"x-filler: " + b"a" * 1014 + b"\r\n"  # 1 KiB
    wire = Wire([b"HTTP/1.1 200 OK\r\n"] + [line] * 17)
    pool = pool_on(wire)
    with pytest.raises(Unanswered) as exc:
        async with pool.request(b"POST", b"/generate", b"{}"):
            pass
    assert str(exc.value) == "worker broke HTTP/1.1: Receive buffer too long"
    assert (pool.idle, pool.retired, wire.closed) == (0, 1, True)


async def test_a_head_of_15_kib_is_taken():
    line = b"x-filler: " + b"a" * 1014 + b"\r\n"
    pool = pool_on(Wire([b"HTTP/1.1 200 OK\r\n"] + [line] * 15 + [b"content-length: 2\r\n\r\nok"]))
    assert await exchange(pool) == (200, None, None, [b"ok"])
    assert pool.idle == 1


async def test_trailers_past_16_kib_are_refused():
    line = b"x-filler: " + b"a" * 1014 + b"\r\n"
    wire = Wire([HEAD_SSE + b"2\r\nab\r\n0\r\n"] + [line] * 17)
    pool = pool_on(wire)
    async with pool.request(b"POST", b"/generate", b"{}") as resp:
        assert await resp.read_some() == b"ab"
        with pytest.raises(WorkerDisconnected) as exc:
            await resp.read_some()
    assert str(exc.value) == "worker broke HTTP/1.1: Receive buffer too long"
    assert (pool.idle, pool.retired) == (0, 1)


@pytest.mark.parametrize(("head", "rest", "message"), [
    (b"content-length: 10\r\n\r\n", b"abcd",
     "peer closed connection without sending complete message body (received 4 bytes, expected 10)"),
    (b"transfer-encoding: chunked\r\n\r\n", b"a\r\nabcd",
     "peer closed connection without sending complete message body (incomplete chunked read)"),
])
async def test_an_answer_cut_mid_body_breaks_http_and_retires_the_connection(head, rest, message):
    wire = Wire([b"HTTP/1.1 200 OK\r\n" + head + rest])
    pool = pool_on(wire)
    async with pool.request(b"POST", b"/generate", b"{}") as resp:
        assert await resp.read_some() == b"abcd"
        with pytest.raises(WorkerDisconnected) as exc:
            await resp.read_some()
    assert str(exc.value) == f"worker broke HTTP/1.1: {message}"
    assert (pool.idle, pool.retired, wire.closed) == (0, 1, True)


async def test_a_body_left_unread_retires_the_connection():
    wire = Wire([HEAD_SSE + b"2\r\nab\r\n", chunked(b"cd")])
    pool = pool_on(wire)
    async with pool.request(b"POST", b"/generate", b"{}") as resp:
        assert await resp.read_some() == b"ab"
    assert (pool.idle, pool.retired, wire.closed) == (0, 1, True)


async def test_a_read_past_its_deadline_retires_the_connection():
    wire = Wire([HEAD_SSE + b"2\r\nab\r\n", None, chunked(b"cd")])
    pool = pool_on(wire)
    async with pool.request(b"POST", b"/generate", b"{}") as resp:
        assert await resp.read_some() == b"ab"
        with pytest.raises(TimedOut):
            await resp.read_some(anyio.current_time() + 10)
    assert (pool.idle, pool.retired, wire.closed) == (0, 1, True)


@pytest.mark.parametrize("pieces", [[], [b"HTTP/1.1 200 OK\r\ncontent-le"], [b"HTTP/1.1 100 Continue\r\n\r\n"]])
async def test_a_close_before_the_final_head_is_unanswered(pieces):
    wire = Wire(pieces)
    pool = pool_on(wire)
    with pytest.raises(Unanswered) as exc:
        async with pool.request(b"POST", b"/generate", b"{}"):
            pass
    assert str(exc.value) == "worker closed the connection before answering"
    assert (pool.idle, pool.retired, wire.closed, len(wire.sent)) == (0, 1, True, 1)


@pytest.mark.parametrize("head", [b"HTTP/1.1 2OO OK\r\n\r\n", b"HTPP/1.1 200 OK\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"])
async def test_a_malformed_head_is_unanswered_as_broken_http(head):
    wire = Wire([head])
    pool = pool_on(wire)
    with pytest.raises(Unanswered) as exc:
        async with pool.request(b"POST", b"/generate", b"{}"):
            pass
    assert str(exc.value).startswith("worker broke HTTP/1.1: ")
    assert (pool.idle, pool.retired, wire.closed) == (0, 1, True)


async def test_interim_answers_are_skipped_with_their_headers():
    pool = pool_on(Wire([b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\ncontent-type: text/html\r\n"
                         b"link: </a>\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]))
    assert await exchange(pool) == (200, None, None, [b"ok"])
    assert (pool.idle, pool.retired) == (1, 0)


@pytest.mark.parametrize(("method", "head"), [
    (b"HEAD", b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-type: text/plain\r\n\r\n"),
    (b"POST", b"HTTP/1.1 204 No Content\r\ncontent-type: text/plain\r\n\r\n"),
    (b"GET", b"HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\ncontent-type: text/plain\r\n\r\n"),
])
async def test_an_answer_without_a_body_ends_at_its_head(method, head):
    wire = Wire([head])
    pool = pool_on(wire)
    assert (await exchange(pool, method))[1:] == (b"text/plain", None, [])
    wire.pieces = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    assert await exchange(pool) == (200, None, None, [b"ok"])
    assert (pool.opened, pool.idle, pool.retired) == (1, 1, 0)


async def test_connection_close_is_read_whole_then_retired():
    wire = Wire([b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"])
    pool = pool_on(wire)
    assert await exchange(pool) == (200, None, None, [b"ok"])
    assert (pool.idle, pool.retired, wire.closed) == (0, 1, True)


@pytest.mark.parametrize("version", [b"1.0", b"1.1"])
async def test_a_body_delimited_by_the_close_ends_there(version):
    first = Wire([b"HTTP/" + version + b" 200 OK\r\ncontent-type: text/plain\r\n\r\nhel", b"lo"])
    second = Wire([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"])
    pool = pool_on(first, second)
    assert await exchange(pool) == (200, b"text/plain", None, [b"hel", b"lo"])
    assert await exchange(pool) == (200, None, None, [b"ok"])
    assert (pool.opened, pool.retired, first.closed) == (2, 1, True)


@pytest.mark.parametrize("excess", [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale", b"garbage"])
async def test_bytes_after_the_end_retire_the_connection_never_read_as_the_next_answer(excess):
    # h11 kept them for the connection's next cycle: the next request read
    # the first answer's tail as its own.
    first = Wire([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" + excess])
    second = Wire([b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfresh"])
    pool = pool_on(first, second)
    assert await exchange(pool) == (200, None, None, [b"ok"])
    assert await exchange(pool) == (200, None, None, [b"fresh"])
    assert (pool.opened, pool.retired, first.closed, len(first.sent)) == (2, 1, True, 1)
