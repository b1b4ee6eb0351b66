"""Routed-expert rows of vLLM answers: base64 ``.npy`` arrays, read, checked
and joined across prefill/decode legs.

Wire format: vLLM ``serve_tokens_full_generator`` and the stream generator
(``vllm/entrypoints/scale_out/token_in_token_out/serving.py``) send each
choice's ``routed_experts`` as the base64 of ``numpy.save`` bytes of an array
shaped ``(num_tokens - 1, num_layers, top_k)`` (``GenerateChoiceBase`` in
``protocol.py``: uint8, uint16 or int32), one row per forwarded position.
A P/D pair's rows are the prefill leg's (the prompt positions) followed by
the decode leg's output positions but the last (all its rows, or the last of
them when it answered every position) on axis 0; the joined
array is rendered as ``numpy.save`` (format 1.0, 64-byte aligned header with
the spare space for the growth axis, numpy 1.23 and later) renders the
aggregated one, so the client gets the aggregated engine's bytes.

Bounds (each leg's array): rank 1 to :data:`MAX_RANK`, at most
:data:`MAX_ELEMENTS` elements and :data:`MAX_ARRAY_BYTES` of data, so a
joined array holds at most twice that (64 MiB). Anything else is an error of
the request (HTTP 502), never a partial blob.
"""

from __future__ import annotations

import ast
import base64
import binascii
import struct
from dataclasses import dataclass

from asgi_generate.sdk import RequestError

MAGIC = b"\x93NUMPY"
ARRAY_ALIGN = 64
#: numpy leaves room for this many digits of the first axis in the header.
GROWTH_AXIS_MAX_DIGITS = 21
MAX_RANK = 8
MAX_ELEMENTS = 8 << 20
MAX_ARRAY_BYTES = 32 << 20
#: The longest ``.npy`` header read (numpy's own reader allows 10,000 bytes).
MAX_HEADER = 10_000
#: Little-endian integer dtypes (``descr``) and their item sizes in bytes.
ITEM_SIZES = {"|u1": 1, "|i1": 1, "<u2": 2, "<i2": 2, "<u4": 4, "<i4": 4, "<u8": 8, "<i8": 8}


@dataclass(frozen=True, slots=True)
class Rows:
    """One decoded ``.npy`` array: ``descr`` (e.g. ``|u1``), ``shape`` and
    its C-order ``data`` bytes."""

    descr: str
    shape: tuple[int, ...]
    data: bytes


def _bad(why: str) -> RequestError:
    return RequestError(502, f"a P/D leg sent routed experts that {why}", "engine")


def parse(value: object) -> Rows:
    """Decode a ``routed_experts`` value (base64 of ``.npy`` bytes).

    Raises:
        RequestError: 502, not base64, not a C-order little-endian integer
            ``.npy`` array, or over the bounds.
    """
    if type(value) is not str:
        raise _bad("are not a base64 string")
    if len(value) > (MAX_ARRAY_BYTES + MAX_HEADER) * 4 // 3 + 4:
        raise _bad(f"are over {MAX_ARRAY_BYTES} bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except binascii.Error:
        raise _bad("are not base64") from None
    if raw[:6] != MAGIC or len(raw) < 10:
        raise _bad("are not a .npy array")
    major = raw[6]
    if major == 1:
        (hlen,), start = struct.unpack_from("<H", raw, 8), 10
    elif major in (2, 3) and len(raw) >= 12:
        (hlen,), start = struct.unpack_from("<I", raw, 8), 12
    else:
        raise _bad("are not a .npy array of a known format version")
    if hlen > MAX_HEADER or start + hlen > len(raw):
        raise _bad("have a .npy header that is cut short or too long")
    try:
        header = ast.literal_eval(raw[start:start + hlen].decode("latin-1"))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise _bad("have a .npy header that does not parse") from None
    if type(header) is not dict or set(header) != {"descr", "fortran_order", "shape"}:
        raise _bad("have a .npy header without descr, fortran_order and shape")
    descr, shape = header["descr"], header["shape"]
    if descr not in ITEM_SIZES:
        raise _bad(f"have dtype {descr!r}, not a little-endian integer")
    if header["fortran_order"] is not False:
        raise _bad("are not in C order")
    if type(shape) is not tuple or not 1 <= len(shape) <= MAX_RANK or not all(
        type(n) is int and n >= 0 for n in shape
    ):
        raise _bad(f"have shape {shape!r}, not 1 to {MAX_RANK} axes")
    elements = 1
    for n in shape:
        elements *= n
    if elements > MAX_ELEMENTS:
        raise _bad(f"have {elements} elements, over {MAX_ELEMENTS}")
    data = raw[start + hlen:]
    if len(data) > MAX_ARRAY_BYTES:
        raise _bad(f"are over {MAX_ARRAY_BYTES} bytes")
    if len(data) != elements * ITEM_SIZES[descr]:
        raise _bad(f"hold {len(data)} data bytes for shape {shape!r} of {descr!r}")
    return Rows(descr, shape, data)


def last(rows: Rows, count: int) -> Rows:
    """The last ``count`` rows (axis 0) of ``rows``: a P/D decode leg's
    output positions, when it answered every position (its prompt rows are
    the slots its KV transfer filled, never rows it computed: vLLM 0.27
    ``RoutedExpertsManager.get`` in ``model_executor/layers/fused_moe/
    routed_experts_capturer.py``)."""
    per_row = len(rows.data) // rows.shape[0] if rows.shape[0] else 0
    return Rows(rows.descr, (count, *rows.shape[1:]), rows.data[len(rows.data) - count * per_row:] if count else b"")


def join(pre: Rows, own: Rows) -> str:
    """``pre``'s rows followed by ``own``'s on axis 0, as base64 ``.npy``.

    Raises:
        RequestError: 502, different dtypes or trailing shapes.
    """
    if pre.descr != own.descr:
        raise RequestError(
            502, f"prefill and decode legs sent routed experts of different dtypes ({pre.descr!r}, {own.descr!r})",
            "engine",
        )
    if pre.shape[1:] != own.shape[1:]:
        raise RequestError(
            502, f"prefill and decode legs sent routed experts of different trailing shapes "
            f"({pre.shape[1:]!r}, {own.shape[1:]!r})", "engine",
        )
    shape = (pre.shape[0] + own.shape[0], *pre.shape[1:])
    return base64.b64encode(render(pre.descr, shape, pre.data + own.data)).decode("ascii")


def render(descr: str, shape: tuple[int, ...], data: bytes) -> bytes:
    """``numpy.save``'s bytes of a C-order array (``numpy/lib/format.py``,
    ``_write_array_header``: sorted keys, growth-axis spare space, a header
    padded to 64 bytes; format 1.0 unless the header needs 2.0)."""
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    text += " " * (GROWTH_AXIS_MAX_DIGITS - len(repr(shape[0])))
    header = text.encode("latin-1")
    for version, fmt in ((1, "<H"), (2, "<I")):
        hlen = len(header) + 1
        prefix = len(MAGIC) + 2 + struct.calcsize(fmt)
        pad = ARRAY_ALIGN - (prefix + hlen) % ARRAY_ALIGN
        if hlen + pad < 1 << (8 * struct.calcsize(fmt)):
            return MAGIC + bytes((version, 0)) + struct.pack(fmt, hlen + pad) + header + b" " * pad + b"\n" + data
    raise ValueError("header too long")  # unreachable: bounded by MAX_RANK axes
