"""Unit and property tests of the sans-IO pieces: SSE decoding, the
simulator's model, id minting, the router's policy, settings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate.sdk import ids
from asgi_generate.config import Settings
from asgi_generate.request.framing import SSEDecoder, sse_event
from asgi_generate.sim.model import Model, experts_base64
from asgi_generate.workers.router import Router
from asgi_generate.worker_specs import parse_worker_spec

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


def _model() -> Model:
    return Model(vocab_size=4096, eos_id=2, num_special=7)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=7, max_value=4095), min_size=1, max_size=30),
       st.integers(min_value=1, max_value=20))
def test_model_resume_continues_where_the_run_left_off(prompt, k):
    """Greedy decoding from prompt+generated[:k] yields generated[k:]."""
    m = _model()
    state, gen = m.fold(prompt), []
    for _ in range(25):
        tok = m.step(state).token
        gen.append(tok)
        state = m.advance(state, tok)
    resumed = m.fold(prompt + gen[:k])
    rest = []
    for _ in range(25 - k):
        tok = m.step(resumed).token
        rest.append(tok)
        resumed = m.advance(resumed, tok)
    assert rest == gen[k:]


def test_model_candidates_are_ranked_and_distinct():
    m = _model()
    step = m.step(m.fold([100, 200]))
    toks = [t for t, _ in step.candidates]
    lps = [lp for _, lp in step.candidates]
    assert len(set(toks)) == len(toks) == 20
    assert lps == sorted(lps, reverse=True) and -1.0 < lps[0] <= 0.0
    assert m.logprob(step.state, toks[3]) == lps[3]
    assert m.rank(step.state, toks[3]) == 4
    assert m.logprob(step.state, 5) < lps[-1]


def test_experts_base64_is_little_endian_int32():
    assert experts_base64([[1, 2], [3, 258]]) == "AQAAAAIAAAADAAAAAgEAAA=="


def test_minted_ids_are_fixed_width_and_never_prefixes():
    got = [ids.mint() for _ in range(1000)]
    assert {len(i) for i in got} == {32}
    assert len(set(got)) == 1000
    assert not any(a != b and b.startswith(a) for a in got[:50] for b in got)


def test_router_least_outstanding_then_round_robin():
    r = Router([("sglang", "http://127.0.0.1:1"), ("sglang", "http://127.0.0.1:2"),
                ("sglang", "http://127.0.0.1:3"), ("vllm", "http://127.0.0.1:4")])
    for w in r.workers:
        w.healthy = True
    assert [r.pick("sglang").id for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    r.workers[1].inflight.add(object())
    r.workers[2].inflight.add(object())
    assert [r.pick("sglang").id for _ in range(2)] == ["w0", "w0"]
    r.workers[0].healthy = False
    assert r.pick("sglang").id == "w1"
    assert r.pick("sglang", exclude=[r.workers[1], r.workers[2]]) is None
    assert r.pick("vllm").id == "w3"
    assert r.pick("other") is None


@pytest.mark.parametrize("spec,error", [
    ("sglang", "worker 'sglang': expected PROTOCOL=http://HOST:PORT"),
    ("tgi=http://h:1", "worker 'tgi=http://h:1': unknown protocol 'tgi' (known: sglang, vllm)"),
    ("sglang=ftp://h:1", "worker 'sglang=ftp://h:1': expected an http(s)://HOST:PORT or dns://NAME:PORT URL"),
    ("sglang=http://h", "worker 'sglang=http://h': expected an http(s)://HOST:PORT or dns://NAME:PORT URL"),
])
def test_bad_worker_specs(spec, error):
    with pytest.raises(ValueError) as exc:
        parse_worker_spec(spec)
    assert str(exc.value) == error


def test_settings_round_trip_through_the_environment():
    s = Settings(workers=[("sglang", "http://127.0.0.1:9"), ("sglang", "http://127.0.0.1:10")],
                 max_body_bytes=1234, inter_token_timeout=7.5, request_timeout=600.0,
                 health_failures=5, skip_broken_codecs=True)
    assert Settings.from_env(s.to_env()) == s
    assert Settings.from_env({}) == Settings()
    # The old name of the inter-token timeout still works; the new one wins.
    assert Settings.from_env({"ASGI_GENERATE_READ_TIMEOUT": "9"}).inter_token_timeout == 9.0
    both = {"ASGI_GENERATE_READ_TIMEOUT": "9", "ASGI_GENERATE_INTER_TOKEN_TIMEOUT": "4"}
    assert Settings.from_env(both).inter_token_timeout == 4.0
    with pytest.raises(ValueError) as exc:
        Settings.from_env({"ASGI_GENERATE_READ_TIMEOUT": "soon"})
    assert str(exc.value) == "ASGI_GENERATE_READ_TIMEOUT='soon' is not a number"


def test_no_codec_to_serve_is_refused(monkeypatch):
    from asgi_generate.sdk import registry
    from asgi_generate.protocols import PROTOCOLS

    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    with pytest.raises(registry.CodecLoadError) as exc:
        registry.load_codecs(protocols=PROTOCOLS)
    assert str(exc.value) == "no codec to serve: none is installed in the entry point group asgi_generate.codecs"
