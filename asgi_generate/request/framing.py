"""HTTP framing on both sides of the frontend, over raw ASGI and raw bytes.

Client side: a size-capped body reader, a unary responder and an SSE writer
(``text/event-stream``, one ``data:`` line per event ending ``\\n\\n``, the
format's terminal marker, ``:`` comments as keep-alives), following the
WHATWG HTML "Server-sent events" section.

Worker side: an incremental SSE decoder that turns response body bytes into
the payload of each ``data:`` event.
"""

from __future__ import annotations

import math
from typing import Awaitable, Callable, Iterable

import anyio

from ..exceptions import BodyTimeout, BodyTooLarge, ClientDisconnected

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
Headers = Iterable[tuple[bytes, bytes]]

JSON = b"application/json"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


async def read_body(
    receive: Receive, limit: int, content_length: int | None, timeout: float = math.inf,
    receive_nowait: Callable[[], dict | None] | None = None,
) -> bytes:
    """Read the whole request body, at most ``limit`` bytes, within
    ``timeout`` seconds.

    A declared ``content_length`` over the limit fails before the first
    ``receive()``; a chunked body fails as soon as the bytes received pass
    the limit. What was read is dropped when this raises. ``receive_nowait``
    (the server's :data:`asgi_generate.request.watchdog.RECEIVE_NOWAIT`)
    takes a message already queued: a body that is all there is read with
    no deadline to keep (no cancel scope: on asyncio, entering and leaving
    one looks the running task up, a ``getpid(2)`` each on CPython 3.11).

    Raises:
        BodyTooLarge: the body is larger than ``limit``.
        BodyTimeout: the body was not whole after ``timeout`` seconds.
        ClientDisconnected: the client went away mid-body.
    """
    if content_length is not None and content_length > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    # What the server has queued already is taken with no deadline to keep.
    while receive_nowait is not None and (message := receive_nowait()) is not None:
        size, more = _body_part(message, chunks, size, limit)
        if not more:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    # One deadline for the whole body. ASGI servers hand messages over
    # through queues: a receive() cut short by the deadline loses nothing.
    with anyio.move_on_after(timeout):
        while True:
            size, more = _body_part(await receive(), chunks, size, limit)
            if not more:
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    raise BodyTimeout()


def _body_part(message: dict, chunks: list[bytes], size: int, limit: int) -> tuple[int, bool]:
    """Add a ``receive()`` message's body bytes to ``chunks``; the bytes
    so far, and whether more are to come (raises as :func:`read_body`)."""
    if message["type"] == "http.disconnect":
        raise ClientDisconnected()
    chunk = message.get("body", b"")
    if chunk:
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return size, message.get("more_body", False)


async def send_unary(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: Headers = (),
) -> None:
    """Send one complete response: status, ``content-length``, body."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def sse_event(data: bytes) -> bytes:
    """Frame one payload as an SSE event: ``data: <payload>\\n\\n``.

    The payload must not contain a newline (JSON from orjson never does).
    """
    return b"".join(sse_parts(data))


def sse_parts(data: bytes) -> tuple[bytes, bytes, bytes]:
    """:func:`sse_event`'s bytes in three pieces, for a writer that joins
    several events into one write: the payload is copied once, there."""
    return (b"data: ", data, b"\n\n")


KEEPALIVE = b": keep-alive\n\n"


class SSEDecoder:
    """Incremental SSE parser: body bytes in, ``data`` payloads out.

    Lines may end ``\\n``, ``\\r\\n`` or ``\\r``; several ``data:`` lines in one
    event are joined with ``\\n``; comments and other fields are ignored.
    Engines send one ``data:`` line per event, which is taken in one step
    (a search for its line end, a check for the blank line, one slice);
    everything else goes line by line.
    """

    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        #: The line not yet ended.
        self._buf = b""
        #: ``data`` values of the event being read.
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """Consume ``chunk``; return the payloads of the events it completed."""
        buf = self._buf + chunk if self._buf else chunk
        tail = b""
        if b"\r" in buf:
            if buf.endswith(b"\r"):  # may be the first half of a CRLF
                buf, tail = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        out: list[bytes] = []
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            if buf[end + 1 : end + 2] == b"\n" and not self._data and buf.startswith(b"data:", start):
                # A whole one-line event: its value, then past the blank line.
                out.append(buf[start + 6 if buf[start + 5 : start + 6] == b" " else start + 5 : end])
                start = end + 2
                continue
            self._line(buf[start:end], out)
            start = end + 1
        self._buf = buf[start:] + tail
        return out

    def _line(self, line: bytes, out: list[bytes]) -> None:
        if not line:
            if self._data:
                out.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                self._data = []
        elif line.startswith(b"data:"):
            self._data.append(line[6:] if line[5:6] == b" " else line[5:])

    def close(self) -> list[bytes]:
        """End of body: return an event left without its blank line, if any."""
        out: list[bytes] = []
        self._line(self._buf.rstrip(b"\r"), out)
        self._line(b"", out)
        self._buf = b""
        return out
