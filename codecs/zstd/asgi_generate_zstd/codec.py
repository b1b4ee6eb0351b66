"""The zstd codec: SGLang's native ``/generate``, zstd-compressed.

Wire format (docs/writing-a-codec.md of asgi-generate is the full description):

- Request: ``POST /zstd/generate`` with ``Content-Type: application/zstd``
  (parameters ignored, case-insensitive) and a body of exactly one zstd frame
  (RFC 8878) holding an SGLang ``/generate`` request JSON (SGLang
  ``io_struct.GenerateReqInput``). Another or no content type gets
  415; a frame that is empty, not zstd, truncated, corrupt, followed by more
  bytes, or needing a dictionary gets 400 naming the cause; a frame that
  decompresses past the frontend's body cap gets 413.
- Unary answer: one zstd frame of the SGLang response JSON, ``Content-Type:
  application/zstd``.
- SSE answer: each event's ``data`` is the standard base64 (RFC 4648 section
  4, padded) of one zstd frame of the SGLang event JSON; the stream ends with
  ``data: [DONE]``, uncompressed.
- Errors: the body is compressed exactly when ``Content-Type`` is
  ``application/zstd``. Errors the frontend makes before the engine answers
  (415, 400, 413, 404/405, 503, ...) are plain SGLang error JSON with
  ``Content-Type: application/json`` (the handler labels them so, and a
  client whose zstd is broken can still read why); errors the engine
  reports are its SGLang error JSON, compressed like any other answer; an
  error after an SSE stream started is an event like any other.

Everything SGLang-specific (checks, worker bodies, chunk parsing, rid
restoration, error shapes) is :class:`asgi_generate_sglang.SGLangCodec`'s;
this codec only adds the compression layer around it.
"""

from __future__ import annotations

from base64 import b64encode
from typing import Mapping

import zstandard
from asgi_generate_sglang import SGLangCodec
from asgi_generate_sglang.codec import SGLangExchange

from asgi_generate.sdk import (
    Attempt,
    Codec,
    Event,
    Exchange,
    GenerateRequest,
    RequestError,
    Route,
    WorkerRequest,
)

from .frame import decompress_frame

MEDIA_TYPE = b"application/zstd"


def _media_type(value: bytes) -> bytes:
    return value.split(b";", 1)[0].strip().lower()


def _pack_event(cctx: zstandard.ZstdCompressor, data: bytes) -> bytes:
    return b64encode(cctx.compress(data))


class ZstdCodec(Codec):
    """SGLang ``/generate`` compressed with zstd, on ``POST /zstd/generate``,
    over SGLang workers. See the module docstring for the wire format."""

    name = "zstd"
    routes = (Route("POST", "/zstd/generate"),)
    worker_protocol = "sglang"
    content_type = MEDIA_TYPE

    def __init__(self) -> None:
        self._sglang = SGLangCodec()

    def decode(self, body: bytes, headers: Mapping[bytes, bytes]) -> GenerateRequest:
        """Check the content type, decompress the frame (at most
        ``max_body_bytes`` out), then check it as an SGLang request.

        Raises:
            RequestError: 415 for a content type other than
                ``application/zstd``; 400/413 from
                :func:`asgi_generate_zstd.frame.decompress_frame`; anything
                :meth:`SGLangCodec.decode` raises for the JSON inside.
        """
        content_type = headers.get(b"content-type")
        if content_type is None:
            raise RequestError(
                415, "Content-Type must be application/zstd; the request has none", "unsupported_media_type"
            )
        if _media_type(content_type) != MEDIA_TYPE:
            shown = content_type.decode("latin-1")[:64]
            raise RequestError(
                415, f"Content-Type must be application/zstd, not {shown!r}", "unsupported_media_type"
            )
        self._sglang.max_items = self.max_items  # the app set this codec's bound, not the inner one's
        return self._sglang.decode(decompress_frame(body, self.max_body_bytes), headers)

    def exchange(self, request: GenerateRequest, request_id: str) -> "ZstdExchange":
        """The SGLang exchange for ``request``, with a compressing layer."""
        return ZstdExchange(self._sglang.exchange(request, request_id))

    def error_body(self, error: RequestError) -> bytes:
        """SGLang's error JSON, uncompressed: the handler sends it as
        ``application/json``."""
        return self._sglang.error_body(error)

    def in_band_error(self, error: RequestError) -> bytes:
        """SGLang's in-band error event, framed like every other event
        (base64 of one zstd frame)."""
        return _pack_event(zstandard.ZstdCompressor(), self._sglang.in_band_error(error))


class ZstdExchange(Exchange):
    """One request's :class:`SGLangExchange` plus a zstd compressor (level 3,
    content size in every frame header, no checksum) reused for its answer.

    Not thread-safe, like every exchange: the handler drives it from one task.
    """

    __slots__ = ("sglang", "cctx")

    def __init__(self, sglang: SGLangExchange) -> None:
        self.sglang = sglang
        self.cctx = zstandard.ZstdCompressor()

    def worker_request(self, attempt: Attempt) -> WorkerRequest:
        """The SGLang worker request (workers speak plain SGLang)."""
        return self.sglang.worker_request(attempt)

    def feed(self, attempt: Attempt, payload: bytes) -> Event:
        """Parse one SGLang worker chunk; see :meth:`SGLangExchange.feed`."""
        return self.sglang.feed(attempt, payload)

    def client_event(self, event: Event) -> bytes | None:
        """SGLang's event for the client as base64 of one zstd frame."""
        data = self.sglang.client_event(event)
        return None if data is None else _pack_event(self.cctx, data)

    def unary_body(self) -> tuple[int, bytes]:
        """SGLang's status and body, the body as one zstd frame."""
        status, body = self.sglang.unary_body()
        return status, self.cctx.compress(body)

    def worker_error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """SGLang's answer to a worker's error, the body as one zstd frame
        (the handler sends it as ``application/zstd``)."""
        status, body = self.sglang.worker_error(status, body)
        return status, self.cctx.compress(body)
