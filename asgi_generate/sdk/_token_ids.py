"""A token prompt checked and packed in C loops, once, on the request path.

A Python-level check of a prompt (``type(t) is int`` and ``min``) costs
about 28 ns per token; packing it into ``array('I')`` (which refuses
non-ints, negatives and ids from ``2**32`` on) and serializing it with
orjson (whose text shows any bool as ``true``/``false``) cost about 11 ns,
and both results are reused: the JSON text goes into the engine request
body as it is (``orjson.Fragment``), the packed ids are the little-endian
u32 bytes the replay block hashes read (:mod:`asgi_generate.tracing.hashing`),
so the trace writer never converts Python ints again.
"""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass

from ._compact import dumps_compact

_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True, slots=True)
class PackedIds:
    """A checked token prompt, two ways.

    Attributes:
        u32: the ids as an ``array('I')``, whose bytes are little-endian u32
            (4 bytes per id).
        json: the ids' JSON text, ``orjson.dumps(ids)`` (copied to its size
            when short, :func:`asgi_generate.sdk.dumps_compact`).
    """

    u32: array.array
    json: bytes


def as_u32(ids: list[int] | array.array) -> array.array:
    """``ids`` as an ``array('I')`` (native byte order): ``ids`` itself when it
    is one (a :class:`PackedIds`' ``u32``), else a packed copy.

    Raises:
        OverflowError: an id is negative or at least ``2**32``.
        TypeError: an id is not an int.
    """
    return ids if type(ids) is array.array and ids.typecode == "I" else array.array("I", ids)


def pack_token_ids(ids: list) -> PackedIds | None:
    """``ids`` packed and serialized, when each is an ``int`` in ``[0, 2**32)``.

    Args:
        ids: a decoded JSON list (any element types).

    Returns:
        The :class:`PackedIds`; ``None`` when an element is not an ``int``
        (a bool included), is negative or at least ``2**32``, or the host is
        big-endian: the caller then checks the list itself.
    """
    if not _LITTLE:
        return None
    try:
        packed = array.array("I", ids)  # 4-byte items on every CPython platform
    except (TypeError, OverflowError):
        return None
    text = dumps_compact(ids)  # held for the request's life
    if b"e" in text:  # ints serialize as digits only: this is a true or false
        return None
    return PackedIds(packed, text)
