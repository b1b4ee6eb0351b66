"""orjson results without orjson's spare buffer, for serialized values a
request holds while it streams."""

from __future__ import annotations

from typing import Any

import orjson

#: orjson 3.11 builds every result in a buffer of at least 1 KiB, doubled
#: as it grows, and hands it over unshrunk (a 10 KB result holds 16 KiB);
#: results below this size are copied to their own size (about 1 us per
#: 10 KB). Larger ones (request bodies of many MiB) are not: the copy would
#: briefly hold the body twice.
_COMPACT_BELOW = 1 << 20


def dumps_compact(obj: Any) -> bytes:
    """``orjson.dumps(obj)`` without the spare buffer orjson 3.11 keeps
    behind a result below 1 MiB (at least 1 KiB, up to half of it): for
    serialized values a request holds while it streams (tags, worker bodies,
    a packed prompt's JSON text), about 1 KB of RSS each per open stream,
    more for long prompts.

    Raises:
        orjson.JSONEncodeError: as :func:`orjson.dumps`.
    """
    data = orjson.dumps(obj)
    return bytes(memoryview(data)) if len(data) < _COMPACT_BELOW else data
