"""Decoding a worker's SSE body (the WHATWG event-stream rules): cut
anywhere, any line endings, fields and comments, an unterminated last event."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate.request.framing import SSEDecoder, sse_event

payloads = st.lists(st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b),
                    max_size=12)


def _decode_cut(body: bytes, cuts: list[int]) -> list[bytes]:
    """Every payload of ``body`` fed to one decoder in pieces of the ``cuts``' sizes."""
    dec = SSEDecoder()
    out, pos = [], 0
    for c in cuts:
        out += dec.feed(body[pos : pos + c])
        pos += c
    return out + dec.feed(body[pos:]) + dec.close()


@settings(max_examples=300, deadline=None)
@given(payloads, st.lists(st.integers(min_value=1, max_value=50), max_size=30), st.booleans())
def test_sse_decoder_is_split_invariant(events, cuts, crlf):
    """However the body is cut into chunks, the same payloads come out in order."""
    body = b"".join(sse_event(e) for e in events)
    if crlf:
        body = body.replace(b"\n", b"\r\n")
    assert _decode_cut(body, cuts) == events


def _sse_reference(body: bytes) -> list[bytes]:
    """The WHATWG rules, line by line over the whole body (the decoder's oracle)."""
    out, data = [], []
    for line in body.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
        if not line:
            if data:
                out.append(b"\n".join(data))
            data = []
        elif line.startswith(b"data:"):
            data.append(line[6:] if line[5:6] == b" " else line[5:])
    return out + ([b"\n".join(data)] if data else [])


sse_lines = st.lists(st.one_of(
    st.builds(lambda p: b"data: " + p, st.binary(max_size=12).filter(lambda b: b"\n" not in b and b"\r" not in b)),
    st.builds(lambda p: b"data:" + p, st.binary(max_size=12).filter(lambda b: b"\n" not in b and b"\r" not in b)),
    st.sampled_from([b"", b"", b": keep-alive", b"event: x", b"id: 7", b"data", b"retry: 5"]),
), max_size=20)


@settings(max_examples=400, deadline=None)
@given(sse_lines, st.lists(st.sampled_from([b"\n", b"\r\n", b"\r"]), min_size=1, max_size=20),
       st.lists(st.integers(min_value=1, max_value=30), max_size=20))
def test_sse_decoder_follows_the_line_rules(lines, endings, cuts):
    """Any mix of data lines (one or several per event), comments, other
    fields, blank lines and line endings, cut anywhere: the payloads of the
    line-by-line rules, in order (the one-line-event fast path included)."""
    body = b"".join(line + endings[i % len(endings)] for i, line in enumerate(lines))
    assert _decode_cut(body, cuts) == _sse_reference(body)


def test_sse_decoder_fields_and_comments():
    dec = SSEDecoder()
    got = dec.feed(b": keep-alive\n\nevent: x\ndata: a\ndata:b\nid: 7\n\ndata: [DONE]\n\n")
    assert got == [b"a\nb", b"[DONE]"]


def test_sse_decoder_close_returns_an_unterminated_event():
    dec = SSEDecoder()
    assert dec.feed(b"data: tail") == []
    assert dec.close() == [b"tail"]
