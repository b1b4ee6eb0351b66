"""The simulator's own HTTP framing over raw ASGI, as the engines' servers
frame their answers (FastAPI on uvicorn in both SGLang and vLLM). It shares
nothing with the frontend's framing (:mod:`asgi_generate.request.framing`),
so a framing bug of the frontend's shows in the parity tests instead of
being made on both sides.

- A unary answer is Starlette's ``Response``/``ORJSONResponse``: one
  ``content-type`` and a ``content-length``.
- A stream is Starlette's ``StreamingResponse(media_type=
  "text/event-stream")`` and no other header (sglang 0.5.23
  ``srt/entrypoints/http_server.py`` ``generate_request``; vllm 0.33.0
  ``entrypoints/scale_out/token_in_token_out/api_router.py``):
  ``content-type: text/event-stream; charset=utf-8`` (Starlette's
  ``Response.init_headers`` adds the charset to a ``text/`` type), no
  length; each event is ``data: <json>\\n\\n``.
- A request body is read from ``http.request`` messages up to a cap
  (Starlette's ``Request.body`` has none; the cap keeps a test's simulator
  bounded).
"""

from __future__ import annotations

from typing import Awaitable, Callable, Iterable

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

#: The headers of a streamed answer (Starlette's ``StreamingResponse``).
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


class ClientDisconnected(Exception):
    """``http.disconnect`` arrived before the request body was whole."""


class BodyTooLarge(Exception):
    """The request body is over the cap."""


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body, at most ``limit`` bytes.

    Raises:
        BodyTooLarge: more than ``limit`` bytes arrived.
        ClientDisconnected: the client went away first.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_unary(send: Send, status: int, body: bytes, content_type: bytes = b"application/json",
                     headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """One whole answer: ``status``, its ``content-type``, ``content-length``
    and ``headers``, then ``body``."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *headers]})
    await send({"type": "http.response.body", "body": body})


def sse_event(data: bytes) -> bytes:
    """One SSE event: ``data: <data>\\n\\n`` (``data`` holds no newline)."""
    return b"data: " + data + b"\n\n"
