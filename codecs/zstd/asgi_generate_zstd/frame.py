"""One zstd frame in, at most ``limit`` bytes out, or a :class:`RequestError`
naming the exact cause.

Wire format: RFC 8878 (Zstandard), section 3.1.1: magic number
``28 b5 2f fd``, frame header, blocks (3-byte little-endian header: bit 0
``Last_Block``, bits 1-2 ``Block_Type``, bits 3-23 ``Block_Size``), then a
4-byte content checksum when the header's checksum flag is set.

The frame's extent is read from its block headers before any decompression,
so a truncated frame or bytes after it are told apart from corruption (the
``zstandard`` binding does not expose ``ZSTD_findFrameCompressedSize``, and
its streaming reader ends a truncated frame silently). Decompression then
streams in chunks and stops as soon as the output passes ``limit``: a
decompression bomb costs at most ``limit + 1`` bytes of output plus the
decoder's window buffer, which is touched only as far as it decoded.
"""

from __future__ import annotations

import zstandard

from asgi_generate.sdk import RequestError

MAGIC = b"\x28\xb5\x2f\xfd"
#: RFC 8878 3.1.1.1.2 recommends every decoder accept windows up to 8 MiB;
#: larger windows are accepted up to the body cap.
MIN_WINDOW_LIMIT = 8 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024
_RLE, _RESERVED = 1, 3


def _bad(message: str) -> RequestError:
    return RequestError(400, message, "invalid_request")


def _too_large(message: str) -> RequestError:
    return RequestError(413, message, "too_large")


def _cause(exc: zstandard.ZstdError) -> str:
    # "zstd decompress error: Data corruption detected" -> the library's cause.
    return str(exc).rpartition(": ")[2]


def _truncated(data: bytes, where: str) -> RequestError:
    return _bad(f"truncated zstd frame: the body ends after {len(data)} bytes, inside {where}")


def frame_length(data: bytes) -> int:
    """The length in bytes of the zstd frame that ``data`` starts with, read
    from its header and block headers without decompressing anything.

    Args:
        data: the request body.

    Returns:
        The frame's length; ``data`` may be longer.

    Raises:
        RequestError: 400 when ``data`` is empty, is not a zstd frame (wrong
            magic number, skippable frame), has a corrupt header or reserved
            block type, or ends before the frame does (naming the part it ends in).
    """
    if not data:
        raise _bad("the request body is empty; expected one zstd frame")
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):
            raise _truncated(data, "the magic number")
        if len(data) >= 4 and data[0] & 0xF0 == 0x50 and data[1:4] == b"\x2a\x4d\x18":
            raise _bad("the request body starts with a skippable frame; expected one zstd frame")
        raise _bad(
            f"the request body is not a zstd frame: it starts with {data[:4].hex(' ')}, "
            f"not the magic number {MAGIC.hex(' ')}"
        )
    if len(data) < 5:
        raise _truncated(data, "the frame header")
    header = zstandard.frame_header_size(data)
    if len(data) < header:
        raise _truncated(data, "the frame header")
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as exc:
        raise _bad(f"corrupt zstd frame header: {_cause(exc)}") from None
    pos, block = header, 0
    while True:
        block += 1
        if pos + 3 > len(data):
            raise _truncated(data, f"the header of block {block}")
        bits = int.from_bytes(data[pos : pos + 3], "little")
        kind = (bits >> 1) & 3
        if kind == _RESERVED:
            raise _bad(f"corrupt zstd frame: block {block} has the reserved block type 3")
        pos += 3 + (1 if kind == _RLE else bits >> 3)
        if pos > len(data):
            raise _truncated(data, f"block {block}")
        if bits & 1:
            break
    if params.has_checksum:
        pos += 4
        if pos > len(data):
            raise _truncated(data, "the content checksum")
    return pos


def decompress_frame(data: bytes, limit: int) -> bytes:
    """Decompress ``data``, which must be exactly one zstd frame, into at
    most ``limit`` bytes.

    Args:
        data: the compressed request body.
        limit: the most decompressed bytes accepted (the frontend's body cap,
            ``Codec.max_body_bytes``).

    Returns:
        The decompressed bytes, ``len <= limit``.

    Raises:
        RequestError: 400 for every cause :func:`frame_length` names, bytes
            after the frame, a dictionary id, a window over
            ``max(8 MiB, limit)`` and corrupt data (zstd's own cause); 413
            when the header declares, or decompression reaches, more than
            ``limit`` bytes.
    """
    end = frame_length(data)
    if end < len(data):
        raise _bad(
            f"trailing data after the zstd frame: the frame ends at byte {end} of {len(data)}; "
            "the body must be exactly one frame"
        )
    params = zstandard.get_frame_parameters(data)
    if params.dict_id:
        raise _bad(f"the zstd frame needs dictionary {params.dict_id}; this format uses no dictionary")
    window_limit = max(MIN_WINDOW_LIMIT, limit)
    if params.window_size > window_limit:
        raise _bad(
            f"the zstd frame needs a {params.window_size}-byte window; the limit is {window_limit} bytes"
        )
    declared = params.content_size != zstandard.CONTENTSIZE_UNKNOWN
    if declared and params.content_size > limit:
        raise _too_large(
            f"the request body decompresses to {params.content_size} bytes, over the limit of {limit} bytes"
        )
    reader = zstandard.ZstdDecompressor(max_window_size=window_limit).stream_reader(data)
    chunks: list[bytes] = []
    total = 0
    try:
        while True:
            # Never ask for more than one byte past the limit.
            chunk = reader.read(min(CHUNK_BYTES, limit + 1 - total))
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                raise _too_large(f"the request body decompresses to more than the limit of {limit} bytes")
            chunks.append(chunk)
    except zstandard.ZstdError as exc:
        cause = _cause(exc)
        if declared and cause == "Destination buffer is too small":  # zstd's words for it
            cause = f"it decompresses to more than the {params.content_size} bytes its header declares"
        raise _bad(f"corrupt zstd frame: {cause}") from None
    return b"".join(chunks)
