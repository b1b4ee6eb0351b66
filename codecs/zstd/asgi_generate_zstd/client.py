"""The client side of the zstd format: what a client sends and how it reads
the answers (see :mod:`asgi_generate_zstd.codec` for the wire format).

The frontend's own answers always carry their content size, so plain
one-shot decompression reads them.
"""

from __future__ import annotations

from base64 import b64decode
from typing import Any

import orjson
import zstandard


def encode_request(request: Any, level: int = 3) -> bytes:
    """The request body for ``POST /zstd/generate``: one zstd frame of the
    SGLang request, given as a JSON-able object or as JSON bytes."""
    raw = request if isinstance(request, bytes) else orjson.dumps(request)
    return zstandard.ZstdCompressor(level=level).compress(raw)


def decode_body(body: bytes, content_type: str) -> Any:
    """A unary answer's JSON: decompressed when ``content_type`` is
    ``application/zstd``, else (frontend errors) parsed as it is.

    Raises:
        zstandard.ZstdError, orjson.JSONDecodeError: the body is not what
            its content type says.
    """
    if content_type.split(";", 1)[0].strip().lower() == "application/zstd":
        body = zstandard.ZstdDecompressor().decompress(body)
    return orjson.loads(body)


def decode_event(data: bytes) -> Any:
    """One SSE event's JSON from its ``data`` payload (not ``[DONE]``).

    Raises:
        binascii.Error, zstandard.ZstdError, orjson.JSONDecodeError: the
            payload is not base64 of a zstd frame of JSON.
    """
    return orjson.loads(zstandard.ZstdDecompressor().decompress(b64decode(data, validate=True)))
