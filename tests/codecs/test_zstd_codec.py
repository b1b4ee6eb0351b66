"""The zstd codec, sans-IO: content type, frame guards, the decompression
bomb, and the laws (hypothesis): it decodes as the SGLang codec does, and its
answers are the engine's, with the client's id put back, compressed."""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import textwrap
import tracemalloc
from base64 import b64decode

import orjson
import pytest
import zstandard
from asgi_generate_sglang import SGLangCodec
from asgi_generate_sglang.request import MULTIMODAL
from asgi_generate_zstd import ZstdCodec, decode_body, decode_event, encode_request
import asgi_generate_zstd.frame as frame_module
from asgi_generate_zstd.frame import MAGIC, decompress_frame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asgi_generate.sdk._codec import Attempt, GenerateRequest, RequestError
from asgi_generate.sdk._ids import mint
from asgi_generate.sdk._token_ids import pack_token_ids

ZSTD = {b"content-type": b"application/zstd"}
MiB = 1024 * 1024
LAW = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome(codec, body: bytes, headers=ZSTD):
    """What ``codec.decode`` makes of ``body``: the request, or the error's
    (status, kind, message)."""
    try:
        return codec.decode(body, headers)
    except RequestError as exc:
        return (exc.status, exc.kind, exc.message)


def raw_frame(*blocks: bytes, content_size: int | None = None, last: bool = True) -> bytes:
    """A zstd frame built by hand (RFC 8878 3.1.1): single segment, a 1-byte
    content size, raw blocks."""
    size = sum(map(len, blocks)) if content_size is None else content_size
    out = MAGIC + bytes([0x20, size])
    for i, block in enumerate(blocks):
        is_last = last and i == len(blocks) - 1
        out += (len(block) << 3 | is_last).to_bytes(3, "little") + block
    return out


def rejected(body: bytes, limit: int = 1 * MiB) -> tuple[int, str]:
    with pytest.raises(RequestError) as info:
        decompress_frame(body, limit)
    return info.value.status, info.value.message


# -- content type --------------------------------------------------------------


def test_content_type_missing_or_wrong_is_415_in_sglang_shape():
    codec = ZstdCodec()
    body = encode_request({"input_ids": [1, 2]})
    assert outcome(codec, body, {}) == (
        415, "unsupported_media_type", "Content-Type must be application/zstd; the request has none"
    )
    err = (415, "unsupported_media_type", "Content-Type must be application/zstd, not 'application/json'")
    assert outcome(codec, body, {b"content-type": b"application/json"}) == err
    with pytest.raises(RequestError) as info:
        codec.decode(body, {b"content-type": b"application/json"})
    assert codec.error_body(info.value) == (
        b'{"object":"error","message":"Content-Type must be application/zstd, not \'application/json\'",'
        b'"type":"Unsupported Media Type","param":null,"code":415}'
    )


def test_content_type_is_case_insensitive_and_ignores_parameters():
    codec = ZstdCodec()
    body = encode_request({"input_ids": [1, 2]})
    want = GenerateRequest(stream=False, input_ids=[1, 2], max_new_tokens=128, native={"input_ids": [1, 2]},
                           input_ids_packed=pack_token_ids([1, 2]))
    assert codec.decode(body, {b"content-type": b" Application/ZSTD ; q=1"}) == want


# -- frame guards: exact causes ----------------------------------------------------

FRAME = raw_frame(b"abc", b"defg")  # 6-byte header, blocks of 3+3 and 3+4 bytes: 19 bytes


def test_well_formed_hand_built_frame():
    assert len(FRAME) == 19
    assert decompress_frame(FRAME, 7) == b"abcdefg"


@pytest.mark.parametrize(
    "body, message",
    [
        (b"", "the request body is empty; expected one zstd frame"),
        (b"\x28\xb5", "truncated zstd frame: the body ends after 2 bytes, inside the magic number"),
        (FRAME[:4], "truncated zstd frame: the body ends after 4 bytes, inside the frame header"),
        (FRAME[:5], "truncated zstd frame: the body ends after 5 bytes, inside the frame header"),
        (FRAME[:8], "truncated zstd frame: the body ends after 8 bytes, inside the header of block 1"),
        (FRAME[:10], "truncated zstd frame: the body ends after 10 bytes, inside block 1"),
        (FRAME[:12], "truncated zstd frame: the body ends after 12 bytes, inside the header of block 2"),
        (FRAME[:18], "truncated zstd frame: the body ends after 18 bytes, inside block 2"),
        (
            raw_frame(b"abc", content_size=3, last=False),
            "truncated zstd frame: the body ends after 12 bytes, inside the header of block 2",
        ),
        (
            FRAME + b"x",
            "trailing data after the zstd frame: the frame ends at byte 19 of 20; the body must be exactly one frame",
        ),
        (
            FRAME + FRAME,
            "trailing data after the zstd frame: the frame ends at byte 19 of 38; the body must be exactly one frame",
        ),
        (
            b'{"input_ids": [1]}',
            "the request body is not a zstd frame: it starts with 7b 22 69 6e, not the magic number 28 b5 2f fd",
        ),
        (
            b"\x50\x2a\x4d\x18\x04\x00\x00\x00abcd",
            "the request body starts with a skippable frame; expected one zstd frame",
        ),
        (MAGIC + b"\x28\x0a", "corrupt zstd frame header: Unsupported frame parameter"),
        (
            MAGIC + b"\x20\x0a" + (1 | 3 << 1 | 2 << 3).to_bytes(3, "little") + b"\xff\xff",
            "corrupt zstd frame: block 1 has the reserved block type 3",
        ),
        (raw_frame(b"abc", content_size=10), "corrupt zstd frame: Data corruption detected"),
        (raw_frame(b"abcdef", content_size=3), "corrupt zstd frame: Data corruption detected"),
        (MAGIC + b"\x21\x07\x00\x01\x00\x00", "the zstd frame needs dictionary 7; this format uses no dictionary"),
        (
            MAGIC + bytes([0x00, 21 << 3]) + b"\x01\x00\x00",
            "the zstd frame needs a 2147483648-byte window; the limit is 8388608 bytes",
        ),
    ],
)
def test_bad_frames_get_400_with_the_exact_cause(body, message):
    assert rejected(body) == (400, message)


def test_checksum_mismatch_and_truncated_checksum():
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(b'{"input_ids": [1, 2, 3]}')
    flipped = frame[:-1] + bytes([frame[-1] ^ 0xFF])
    assert rejected(flipped) == (400, "corrupt zstd frame: Restored data doesn't match checksum")
    assert rejected(frame[:-2]) == (
        400, f"truncated zstd frame: the body ends after {len(frame) - 2} bytes, inside the content checksum"
    )


def test_bad_frame_error_body_is_sglang_value_error_shape():
    codec = ZstdCodec()
    with pytest.raises(RequestError) as info:
        codec.decode(FRAME[:10], ZSTD)
    assert (info.value.status, info.value.kind) == (400, "invalid_request")
    assert codec.error_body(info.value) == (
        b'{"error":{"message":"truncated zstd frame: the body ends after 10 bytes, inside block 1"}}'
    )


def test_body_cap_is_exact_for_declared_and_undeclared_sizes():
    data = bytes(range(256)) * 20  # 5120 bytes
    declared = zstandard.ZstdCompressor().compress(data)
    cobj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    undeclared = cobj.compress(data) + cobj.flush()
    for frame in (declared, undeclared):
        assert decompress_frame(frame, 5120) == data
    assert rejected(declared, 5119) == (
        413, "the request body decompresses to 5120 bytes, over the limit of 5119 bytes"
    )
    assert rejected(undeclared, 5119) == (413, "the request body decompresses to more than the limit of 5119 bytes")


def test_codec_uses_the_body_cap_the_app_sets_and_413_is_sglang_shaped():
    codec = ZstdCodec()
    codec.max_body_bytes = 100
    body = encode_request({"input_ids": list(range(100))})
    with pytest.raises(RequestError) as info:
        codec.decode(body, ZSTD)
    assert (info.value.status, info.value.kind) == (413, "too_large")
    assert codec.error_body(info.value) == (
        b'{"object":"error","message":"the request body decompresses to 305 bytes, over the limit of 100 bytes",'
        b'"type":"Request Entity Too Large","param":null,"code":413}'
    )


# -- the decompression bomb --------------------------------------------------------


def zeros_frame(size: int, declare: int | None) -> bytes:
    """``size`` zero bytes compressed by zstd itself, declaring ``declare`` as
    the content size (``None``: no content size)."""
    sink = io.BytesIO()
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=declare is not None)
    with cctx.stream_writer(sink, size=-1 if declare is None else size, closefd=False) as writer:
        chunk = bytes(MiB)
        for _ in range(size // MiB):
            writer.write(chunk)
    frame = sink.getvalue()
    if declare is not None and declare != size:
        # Lie in the 4-byte Frame_Content_Size field (descriptor 0x80, window byte, then FCS).
        assert frame[4] == 0x80
        frame = frame[:6] + declare.to_bytes(4, "little") + frame[10:]
    return frame


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    return {
        "undeclared": zeros_frame(1024 * MiB, None),
        "declared": zeros_frame(1024 * MiB, 1024 * MiB),
        "lying": zeros_frame(1024 * MiB, 1000),
    }


LIMIT = 32 * MiB  # the frontend's default body cap


class _CountingZstd:
    """``zstandard`` as :mod:`asgi_generate_zstd.frame` sees it, with every
    decompressed byte its stream readers hand out counted in ``read``: how
    much of a bomb was inflated, whatever the machine's speed."""

    def __init__(self) -> None:
        self.read = 0

    def __getattr__(self, name: str):
        return getattr(zstandard, name)

    def ZstdDecompressor(self, **kwargs):  # noqa: N802 (zstandard's name)
        counter, decompressor = self, zstandard.ZstdDecompressor(**kwargs)

        class Counted:
            def stream_reader(self, data: bytes):
                reader = decompressor.stream_reader(data)

                class Reader:
                    def read(self, size: int) -> bytes:
                        chunk = reader.read(size)
                        counter.read += len(chunk)
                        return chunk

                return Reader()

        return Counted()


@pytest.mark.parametrize(
    "kind, status, message, peak_bound, inflated",
    [
        # The cap plus one byte; its peak, the cap plus one 1 MiB read chunk.
        ("undeclared", 413, f"the request body decompresses to more than the limit of {LIMIT} bytes", LIMIT + 2 * MiB,
         LIMIT + 1),
        # Refused from the header: nothing is decompressed.
        (
            "declared", 413, f"the request body decompresses to {1024 * MiB} bytes, over the limit of {LIMIT} bytes",
            64 * 1024, 0,
        ),
        # zstd stops at the declared size: one read chunk.
        ("lying", 400, "corrupt zstd frame: it decompresses to more than the 1000 bytes its header declares", 2 * MiB,
         0),
    ],
)
def test_gib_of_zeros_is_rejected_within_the_cap(bombs, kind, status, message, peak_bound, inflated, monkeypatch):
    """A GiB bomb costs at most the cap: its peak memory and the bytes
    decompressed, counted rather than timed."""
    frame = bombs[kind]
    assert len(frame) < 64 * 1024  # 1 GiB of zeros in < 64 KiB
    counting = _CountingZstd()
    monkeypatch.setattr(frame_module, "zstandard", counting)
    codec = ZstdCodec()
    codec.max_body_bytes = LIMIT
    tracemalloc.start()
    try:
        got = outcome(codec, frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got[0::2] == (status, message)
    assert peak < peak_bound, peak
    assert counting.read == inflated


@pytest.mark.e2e
def test_bomb_peak_rss_including_zstd_own_buffers(bombs, tmp_path: pathlib.Path):
    """tracemalloc does not see libzstd's malloc; a fresh process's peak RSS does."""
    path = tmp_path / "bomb.zst"
    path.write_bytes(bombs["undeclared"])
    script = textwrap.dedent(
        f"""
        import resource, sys
        from asgi_generate_zstd import ZstdCodec
        from asgi_generate.sdk._codec import RequestError
        body = open({str(path)!r}, "rb").read()
        codec = ZstdCodec()
        codec.max_body_bytes = {LIMIT}
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            codec.decode(body, {{b"content-type": b"application/zstd"}})
        except RequestError as exc:
            print(exc.status, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, env=os.environ)
    status, grown_kib = out.stdout.split()
    assert status == "413", out.stderr
    # The cap plus one read chunk and zstd's window, never the GiB.
    assert int(grown_kib) * 1024 < LIMIT + 8 * MiB, grown_kib


# -- laws --------------------------------------------------------------------------

token_ids = st.lists(st.integers(0, 300_000), min_size=1, max_size=40)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
valid_sampling_params = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.integers(0, 4096) | st.none(),
        "temperature": st.floats(0, 2),
        "top_k": st.integers(-1, 50),
        "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 100), max_size=3),
        "ignore_eos": st.booleans(),
        "custom": json_values,
    },
)
valid_requests = st.tuples(
    st.sampled_from(["input_ids", "text"]), token_ids, st.text(max_size=40)
).flatmap(
    lambda t: st.fixed_dictionaries(
        {t[0]: st.just(t[1] if t[0] == "input_ids" else t[2])},
        optional={
            "sampling_params": valid_sampling_params,
            "stream": st.booleans(),
            "rid": st.text(max_size=12),
            "return_logprob": st.booleans(),
            "top_logprobs_num": st.integers(0, 5),
            "return_routed_experts": st.booleans(),
            "image_data": st.just("data:,"),
            "extra_key": json_values,
        },
    )
)
# Valid requests with one field replaced by anything: near misses.
near_misses = st.tuples(
    valid_requests,
    st.sampled_from(["input_ids", "text", "sampling_params", "stream", "rid", "top_logprobs_num", "bootstrap_room"]),
    json_values,
).map(lambda t: t[0] | {t[1]: t[2]})
request_bodies = st.one_of(
    valid_requests.map(orjson.dumps),
    near_misses.map(orjson.dumps),
    json_values.map(orjson.dumps),
    st.binary(max_size=64),
)


@st.composite
def frames(draw, data: bytes) -> bytes:
    """``data`` as one zstd frame the way some client might make it: any
    level, with or without content size and checksum, one block or several."""
    cctx = zstandard.ZstdCompressor(
        level=draw(st.integers(-5, 19)),
        write_content_size=draw(st.booleans()),
        write_checksum=draw(st.booleans()),
    )
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    if not cuts:
        return cctx.compress(data)
    cobj = cctx.compressobj(size=len(data))  # a pledged size keeps level 19's tables small
    out, start = [], 0
    for cut in cuts:  # each flush ends a block
        out.append(cobj.compress(data[start:cut]) + cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
        start = cut
    out.append(cobj.compress(data[start:]) + cobj.flush())
    return b"".join(out)


def test_law_request_decodes_exactly_as_sglang():
    """Any body, compressed any way, decodes to what the SGLang codec makes
    of it: the same request (native payload included) or the same error. An
    accepted request is also checked against the body itself, and a fair
    share of the bodies must be accepted (else the law checked only refusals)."""
    seen = {"accepted": 0, "refused": 0}

    @LAW
    @given(data=st.data(), body=request_bodies)
    def law(data, body):
        frame = data.draw(frames(body))
        assert decompress_frame(frame, len(body)) == body
        got = outcome(ZstdCodec(), frame)
        assert got == outcome(SGLangCodec(), body, {})
        if isinstance(got, GenerateRequest):
            obj = orjson.loads(body)
            assert got.native == obj
            assert (got.stream, got.public_id) == (obj.get("stream") is True, obj.get("rid"))
            by_ids = obj.get("text") is None and not any(obj.get(k) is not None for k in MULTIMODAL)
            assert got.input_ids == (obj["input_ids"] if by_ids else None)
        seen["accepted" if isinstance(got, GenerateRequest) else "refused"] += 1

    law()
    assert seen["accepted"] >= 0.2 * (seen["accepted"] + seen["refused"]), seen


@LAW
@given(data=st.data(), body=valid_requests.map(orjson.dumps))
def test_law_mangled_frames_never_crash(data, body):
    """Truncating, extending or flipping a byte of a frame gets a request or
    a 400/413 in the format's shape, never another exception."""
    frame = bytearray(data.draw(frames(body)))
    how = data.draw(st.sampled_from(["cut", "append", "flip"]))
    if how == "cut":
        frame = frame[: data.draw(st.integers(0, len(frame) - 1))]
    elif how == "append":
        frame += data.draw(st.binary(min_size=1, max_size=8))
    else:
        frame[data.draw(st.integers(0, len(frame) - 1))] ^= data.draw(st.integers(1, 255))
    codec = ZstdCodec()
    got = outcome(codec, bytes(frame))
    if isinstance(got, tuple):
        assert got[0] in (400, 413), got
        orjson.loads(codec.error_body(RequestError(got[0], got[2], got[1])))


#: A real minted engine id: the laws' engine chunks carry it, so the codec's
#: swap of it for the client's id in the engine's own bytes is exercised.
ENGINE_ID = mint()


def meta(prompt: int, done: int, finish: dict | None, extra: dict) -> dict:
    return {
        "id": ENGINE_ID,
        "finish_reason": finish,
        "prompt_tokens": prompt,
        "completion_tokens": done,
        "cached_tokens": 0,
        **extra,
    }


@st.composite
def worker_streams(draw) -> tuple[bool, list[bytes]]:
    """An SGLang worker's SSE payloads for one request: cumulative or
    incremental chunks, ending in a finish reason (stop, length, or an abort
    with an error status) or an engine error object."""
    incremental = draw(st.booleans())
    ids = draw(st.lists(st.integers(0, 50_000), min_size=0, max_size=12))
    steps = sorted(set(draw(st.lists(st.integers(1, max(1, len(ids))), max_size=4))) | {len(ids)})
    extra = draw(st.fixed_dictionaries({}, optional={"weight_version": st.text(max_size=4),
                                                      "e2e_latency": json_values}))
    if draw(st.booleans()):  # SGLang's [logprob, token_id, text] triples
        triple = st.tuples(st.none() | st.floats(-20, 0), st.integers(0, 50_000), st.none() | st.text(max_size=3))
        extra["output_token_logprobs"] = draw(st.lists(triple.map(list), max_size=3))
    prompt = draw(st.integers(1, 100))
    end = draw(
        st.sampled_from(
            [
                {"type": "stop", "matched": 2},
                {"type": "length", "length": len(ids)},
                {"type": "abort", "message": "gone", "status_code": 503},
                {"type": "abort", "message": "bad", "status_code": 400},
                "engine_error",
            ]
        )
    )
    payloads, before = [], 0
    for i, upto in enumerate(steps):
        last = i == len(steps) - 1
        if last and end == "engine_error":
            payloads.append(orjson.dumps({"error": {"message": draw(st.text(max_size=10)), "code": 400}}))
            break
        chunk_ids = ids[before:upto] if incremental else ids[:upto]
        text = draw(st.text(max_size=6))
        payloads.append(
            orjson.dumps(
                {"text": text, "output_ids": chunk_ids, "meta_info": meta(prompt, upto, end if last else None, extra)}
            )
        )
        before = upto
    return incremental, payloads


def run_both(request: dict, incremental: bool, payloads: list[bytes]):
    """Drive an SGLang and a zstd exchange through the same worker stream;
    yield each payload and event with both exchanges."""
    sg, zs = SGLangCodec(), ZstdCodec()
    body = orjson.dumps(request)
    ex_sg = sg.exchange(sg.decode(body, {}), "fe-1")
    ex_zs = zs.exchange(zs.decode(encode_request(body), ZSTD), "fe-1")
    attempt = Attempt(ENGINE_ID, worker_info={"incremental_streaming_output": incremental})
    wreq = ex_zs.worker_request(attempt)
    assert orjson.loads(wreq.body) == request | {"rid": ENGINE_ID}
    assert wreq == ex_sg.worker_request(attempt)
    for payload in payloads:
        event = ex_sg.feed(attempt, payload)
        assert ex_zs.feed(attempt, payload) == event
        yield payload, event, ex_sg, ex_zs


def client_view(payload: bytes, public_id: str) -> dict:
    """What the client must get for an engine payload, built independently
    of the codecs: the payload's object with ``meta_info.id`` put back to
    the client's id (an error object has none and passes as it is)."""
    obj = orjson.loads(payload)
    if "meta_info" in obj:
        obj["meta_info"]["id"] = public_id
    return obj


@LAW
@given(stream=worker_streams(), rid=st.none() | st.text(max_size=8))
def test_law_unary_answer_is_the_engine_answer_with_the_clients_id(stream, rid):
    """The zstd unary answer decompresses to the engine's last payload with
    the client's id put back (the rid, else the frontend's id), status 200
    for an answer and the error's code for an engine error object; the
    SGLang codec's answer is those bytes uncompressed."""
    request = {"input_ids": [1, 2, 3]} | ({} if rid is None else {"rid": rid})
    for payload, _, ex_sg, ex_zs in run_both(request, *stream):
        pass
    status, body = ex_zs.unary_body()
    want = client_view(payload, "fe-1" if rid is None else rid)
    assert status == (want["error"]["code"] if "error" in want else 200)
    assert decode_body(body, "application/zstd") == want
    assert (status, zstandard.ZstdDecompressor().decompress(body)) == ex_sg.unary_body()


@LAW
@given(stream=worker_streams(), error=st.tuples(st.sampled_from([400, 500, 502, 503]), st.text(max_size=20)))
def test_law_sse_events_are_the_engine_events_with_the_clients_id(stream, error):
    """Every SSE data payload is base64 of one zstd frame holding the
    engine's event with the client's id put back; in-band errors and worker
    error bodies are SGLang's shapes, compressed the same way."""
    request = {"input_ids": [7], "stream": True, "rid": "client-7"}
    for payload, event, ex_sg, ex_zs in run_both(request, *stream):
        data = ex_zs.client_event(event)
        assert b"\n" not in data
        assert decode_event(data) == client_view(payload, "client-7")
        assert zstandard.ZstdDecompressor().decompress(b64decode(data, validate=True)) == ex_sg.client_event(event)
    err = RequestError(error[0], error[1], "engine")
    want = {"error": {"message": error[1]}} if error[0] == 400 else {
        "error": {"message": error[1], "type": str(error[0]), "code": error[0]}}
    assert decode_event(ZstdCodec().in_band_error(err)) == want
    body = orjson.dumps({"error": {"message": error[1]}})
    status, packed = ex_zs.worker_error(error[0], body)
    assert (status, zstandard.ZstdDecompressor().decompress(packed)) == (error[0], body)
