"""SGLang's cumulative stream chunk, read from its new tail.

Without ``--incremental-streaming-output`` each chunk of an SGLang stream
carries the whole answer so far: ``{"text":"...","output_ids":[...],
"meta_info":{...}}`` (the object ``managers/tokenizer_manager.py``
``_handle_batch_output`` builds, in that key order, which
``entrypoints/http_server.py`` ``generate_request`` writes with
``orjson.dumps``). Chunk n+1 repeats chunk n's text and output ids and
adds the new tokens': parsing it whole each event makes a stream's work
grow with the square of its length.

:func:`layout` finds where a chunk's text ends and where its output ids
lie; :func:`read_tail` checks that the next chunk begins with the same text
and the same ids, byte for byte, and parses only what follows them: the new
text (checked as a JSON string, not kept), the new ids and the
``meta_info`` object. It accepts exactly what a whole parse would, with the
same values; any other shape (another key order, whitespace, an extra key,
a text or ids that are not extensions) is ``None``, and the caller parses
the chunk whole.
"""

from __future__ import annotations

import orjson

TEXT = b'{"text":"'
IDS = b'","output_ids":['
META = b'],"meta_info":'
_BACKSLASH = 92
_BRACE = 125


class Layout:
    """What the next chunk must begin with, from the last one's bytes.

    Attributes:
        data: the last chunk's bytes (the engine's, as received).
        text: its bytes up to the quote closing ``text``.
        ids: its bytes from that quote to the bracket closing
            ``output_ids`` (``","output_ids":[`` and the ids).
        count: how many output ids it holds.
        meta: the offset of its ``meta_info`` object.
    """

    __slots__ = ("data", "text", "ids", "count", "meta")

    def __init__(self, data: bytes, text_end: int, ids_end: int, count: int) -> None:
        self.data = data
        self.text = data[:text_end]
        self.ids = data[text_end:ids_end]
        self.count = count
        self.meta = ids_end + len(META)


def _string_end(data: bytes, start: int) -> int:
    """The offset of the first quote at or after ``start`` that no
    backslash escapes (``start`` is inside a string, on a character
    boundary); -1 if there is none."""
    quote = data.find(b'"', start)
    while quote >= 0:
        i = quote
        while i > start and data[i - 1] == _BACKSLASH:
            i -= 1
        if not (quote - i) & 1:
            return quote
        quote = data.find(b'"', quote + 1)
    return -1


def layout(data: bytes, chunk: dict) -> Layout | None:
    """The layout of ``data``, already parsed whole into ``chunk``, if it is
    SGLang's ``{"text","output_ids","meta_info"}`` with integer ids and
    nothing else; ``None`` otherwise."""
    ids = chunk.get("output_ids")
    if len(chunk) != 3 or type(chunk.get("text")) is not str or type(ids) is not list \
            or type(chunk.get("meta_info")) is not dict or not data.startswith(TEXT) \
            or not all(type(i) is int for i in ids):
        return None
    text_end = _string_end(data, len(TEXT))
    if text_end < 0 or not data.startswith(IDS, text_end):
        return None
    start = text_end + len(IDS)
    end = data.find(META, start)  # integer ids hold neither bracket nor quote
    if end < 0 or data[-1] != _BRACE or (data.count(b",", start, end) + 1 if end > start else 0) != len(ids):
        return None  # (a count that differs: another "output_ids" key)
    return Layout(data, text_end, end, len(ids))


def read_tail(data: bytes, prev: Layout) -> tuple[list, dict] | None:
    """Read ``data``, the chunk after ``prev``'s, from its new tail, and
    make ``prev`` its layout.

    Returns:
        The output ids after ``prev``'s and the ``meta_info`` object;
        ``None`` (``prev`` unchanged) if ``data`` does not extend ``prev``
        as SGLang's cumulative chunks do (see the module docstring), or if
        a quote in the new text makes it ambiguous where the text ends.
        Bytes that are not JSON are ``None`` too: a whole parse reports them.
    """
    text = prev.text
    if not data.startswith(text):
        return None
    text_end = data.find(b'"', len(text))
    if text_end < 0 or data[text_end - 1] == _BACKSLASH or not data.startswith(prev.ids, text_end):
        return None
    after = text_end + len(prev.ids)
    # The first such bytes end the ids: no JSON string holds them (its
    # quotes are escaped), and an id that did would not parse below.
    end = data.find(META, after)
    if end < 0 or data[-1] != _BRACE:
        return None
    try:
        # The new text (checked, then dropped) and the new ids, which
        # follow the known ones after a comma: ["new text",id,...].
        new = orjson.loads(b"".join((b'["', data[len(text) : text_end], b'"', data[after:end], b"]")))
        meta = orjson.loads(data[end + len(META) : -1])  # one value: nothing after it
    except orjson.JSONDecodeError:
        return None
    if type(meta) is not dict:
        return None
    del new[0]
    prev.data, prev.text, prev.ids = data, data[:text_end], data[text_end:end]
    prev.count += len(new)
    prev.meta = end + len(META)
    return new, meta
