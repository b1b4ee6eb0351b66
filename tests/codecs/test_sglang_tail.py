"""SGLang's cumulative stream chunks read from their new tail
(asgi_generate_sglang.tail), and the law (hypothesis): whatever bytes follow a
chunk, a tail read that succeeds gives what a whole parse gives, and the
codec's events and answers are the same whether it reads tails or parses
every chunk whole."""

from __future__ import annotations

import orjson
from asgi_generate_sglang import SGLangCodec
from asgi_generate_sglang.tail import layout, read_tail
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asgi_generate.sdk._codec import Attempt

LAW = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ENGINE_ID = "e" * 32

# Token texts that test the text's end: quotes, backslashes, escapes, non-ASCII.
PIECES = st.sampled_from(["a", " b", '"', "\\", '\\"', "\n", "\u00e9", "\U0001f600", "\x01", "]", ',"meta_info":', "}"])


def chunk(text: str, ids: list[int], finish: dict | None = None, **meta) -> dict:
    """An SGLang cumulative chunk, keys in SGLang's order."""
    return {"text": text, "output_ids": ids, "meta_info": {
        "id": ENGINE_ID, "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(ids),
        "cached_tokens": 0, **meta}}


def stream(pieces: list[str], per_chunk: list[int]) -> list[bytes]:
    """The chunks of a stream whose i-th chunk adds ``per_chunk[i]`` tokens."""
    out, text, ids = [], "", []
    for i, n in enumerate(per_chunk):
        for _ in range(n):
            text += pieces[len(ids) % len(pieces)]
            ids.append(1000 + len(ids))
        last = i == len(per_chunk) - 1
        out.append(orjson.dumps(chunk(text, list(ids), {"type": "length", "length": len(ids)} if last else None)))
    return out


def events(chunks: list[bytes], whole: bool) -> list[tuple]:
    """What the codec makes of a stream: each event's fields and the client's bytes."""
    codec = SGLangCodec()
    ex = codec.exchange(codec.decode(b'{"input_ids":[1,2,3],"stream":true}', {}), "pub")
    attempt = Attempt(ENGINE_ID, "aggregated", worker_info={})
    ex.worker_request(attempt)
    out = []
    for data in chunks:
        if whole:
            ex.tail = None
        event = ex.feed(attempt, data)
        out.append((event.token_ids, event.finish_reason, event.prompt_tokens, event.completion_tokens,
                    event.cached_tokens, ex.client_event(event)))
    return out


def test_a_chunk_is_read_from_where_the_last_one_ended():
    first = orjson.dumps(chunk('say "hi', [5, 6]))
    prev = layout(first, orjson.loads(first))
    assert (prev.text, prev.ids, prev.count) == (b'{"text":"say \\"hi', b'","output_ids":[5,6', 2)
    nxt = orjson.dumps(chunk('say "hi there', [5, 6, 7, 8]))
    new, meta = read_tail(nxt, prev)
    assert new == [7, 8] and meta == orjson.loads(nxt)["meta_info"]
    assert (prev.data, prev.count, nxt[prev.meta:prev.meta + 6]) == (nxt, 4, b'{"id":')
    # A quote in the new text: where the text ends takes a whole parse.
    assert read_tail(orjson.dumps(chunk('say "hi there"', [5, 6, 7, 8, 9])), prev) is None


def test_what_is_not_an_extension_is_left_to_a_whole_parse():
    first = orjson.dumps(chunk("ab", [5, 6]))
    for data in (
        orjson.dumps(chunk("ax", [5, 6, 7])),  # the text changed
        orjson.dumps(chunk("abc", [5, 9, 7])),  # the ids changed
        orjson.dumps(chunk("abc", [5, 67])),  # an id grew
        orjson.dumps(chunk("abc", [5, 6, 7])).replace(b',"meta_info"', b', "meta_info"'),  # whitespace
        orjson.dumps({**chunk("abc", [5, 6, 7]), "index": 0}),  # another key
        orjson.dumps(chunk("abc", [5, 6, 7])).replace(b"[5,6,7]", b"[5,6,]"),  # not JSON
        orjson.dumps(chunk("abc", [5, 6, 7])).replace(b"abc", b"ab\x01"),  # a raw control character
    ):
        prev = layout(first, orjson.loads(first))
        assert read_tail(data, prev) is None
        assert prev.data is first
    # Layouts only for SGLang's own: its three keys, in order, integer ids.
    for obj in ({"output_ids": [1], "text": "a", "meta_info": {}}, {**chunk("a", [1]), "x": 1},
                chunk("a", [1.5]), {"text": "a", "output_ids": [1], "meta_info": {}, "output_ids": [2, 3]}):
        data = orjson.dumps(obj).replace(b'"output_ids":[2,3]', b'"output_ids":[1],"output_ids":[2,3]')
        assert layout(data, orjson.loads(data)) is None


@LAW
@given(pieces=st.lists(PIECES, min_size=1, max_size=6),
       per_chunk=st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_reading_tails_answers_as_whole_parses_do(pieces, per_chunk):
    chunks = stream(pieces, per_chunk)
    assert events(chunks, whole=False) == events(chunks, whole=True)


@LAW
@given(pieces=st.lists(PIECES, min_size=1, max_size=4), grow=st.integers(0, 3),
       at=st.integers(0, 10_000), byte=st.integers(0, 255), cut=st.booleans())
def test_a_tail_read_that_succeeds_is_the_whole_parse(pieces, grow, at, byte, cut):
    first, nxt = stream(pieces, [2, grow])
    at %= len(nxt)
    # Any one byte changed or dropped: a read either declines or agrees.
    data = nxt[:at] + (b"" if cut else bytes([byte])) + nxt[at + 1:]
    prev = layout(first, orjson.loads(first))
    known = orjson.loads(first)["output_ids"]
    read = read_tail(data, prev)
    if read is not None:
        whole = orjson.loads(data)
        assert list(whole) == ["text", "output_ids", "meta_info"]
        assert whole["output_ids"] == known + read[0] and whole["meta_info"] == read[1]
        assert prev.count == len(whole["output_ids"])


def test_a_held_aborting_chunk_is_rendered_as_a_running_chunk():
    """The engine's abort of a stream held across a pause (the handler sets
    ``Event.held``): its tokens as a running chunk, no finish; read from its
    tail or parsed whole alike; not held, the engine's own bytes."""
    abort = {"type": "abort", "message": "Abort in waiting queue", "status_code": 200, "err_type": None}
    first = orjson.dumps(chunk("ab", [5, 6]))
    last = orjson.dumps(chunk("abcd", [5, 6, 7, 8], abort, e2e_latency=0.5))
    for whole in (False, True):
        for held in (False, True):
            codec = SGLangCodec()
            ex = codec.exchange(codec.decode(b'{"input_ids":[1,2,3],"stream":true}', {}), "pub")
            attempt = Attempt(ENGINE_ID, "aggregated", worker_info={})
            ex.worker_request(attempt)
            ex.client_event(ex.feed(attempt, first))
            if whole:
                ex.tail = None
            event = ex.feed(attempt, last)
            assert (event.token_ids, event.finish_reason) == ([7, 8], "abort")
            if held:
                event.finish_reason, event.held = None, True
            shown = orjson.loads(last)
            shown["meta_info"]["id"] = "pub"
            if held:
                shown["meta_info"]["finish_reason"] = None
                del shown["meta_info"]["e2e_latency"]
            assert ex.client_event(event) == orjson.dumps(shown)
