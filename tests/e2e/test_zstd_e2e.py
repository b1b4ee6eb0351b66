"""The zstd route end to end: real hypercorn (trio and asyncio) in front of
SGLang simulator processes, its answers compared with the simulator's own
answers, asked directly (not with the frontend's SGLang route, which shares
the zstd route's code)."""

from __future__ import annotations

import os

import httpx
import orjson
import pytest
import zstandard
from asgi_generate_zstd import decode_event, encode_request

from support import post, sse, start_frontend, without_timing

pytestmark = pytest.mark.e2e

ZSTD = {"content-type": "application/zstd"}
PATH = "/zstd/generate"
MiB = 1024 * 1024

REQUESTS = {
    "input_ids": {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 8}, "rid": "z-ids"},
    "text_logprobs": {
        "text": "hello zstd",
        "sampling_params": {"max_new_tokens": 5},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "rid": "z-text",
    },
    "long_prompt_experts": {
        "input_ids": list(range(1, 3000)),
        "sampling_params": {"max_new_tokens": 4},
        "return_routed_experts": True,
        "rid": "z-long",
    },
    # The engine refuses it (in-band, after its 200): an engine-made error.
    "engine_error": {"input_ids": [10**9], "rid": "z-bad"},
}


def zstd_sse(url: str, request: dict) -> tuple[int, str, list[bytes]]:
    """POST ``request`` compressed to the zstd route; return the status,
    content type and every SSE ``data`` payload."""
    with httpx.stream("POST", url + PATH, content=encode_request(request), headers=ZSTD, timeout=30) as resp:
        raw = b"".join(resp.iter_bytes())
        status, content_type = resp.status_code, resp.headers["content-type"]
    events = [block[6:] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]
    return status, content_type, events


@pytest.mark.parametrize("name", REQUESTS)
def test_unary_answer_is_the_engine_answer_compressed(frontend, sims, name):
    request = REQUESTS[name]
    direct = post(sims[0].url, request)
    packed = post(frontend.url, encode_request(request), PATH, headers=ZSTD)
    assert (packed.status_code, packed.headers["content-type"]) == (direct.status_code, "application/zstd")
    assert direct.status_code == (400 if name == "engine_error" else 200)
    body = orjson.loads(zstandard.ZstdDecompressor().decompress(packed.content))
    assert without_timing(body) == without_timing(direct.json())
    if name == "engine_error":
        assert body == {"error": {"message": "Token id out of range [0, 4096)."}}
    else:
        assert body["meta_info"]["id"] == request["rid"]


@pytest.mark.parametrize("name", REQUESTS)
def test_sse_events_are_the_engine_events_compressed(frontend, sims, name):
    request = REQUESTS[name] | {"stream": True}
    status, direct = sse(sims[0].url, request)
    zstatus, content_type, packed = zstd_sse(frontend.url, request)
    assert (zstatus, content_type) == (status, "text/event-stream; charset=utf-8") == (200, content_type)
    assert direct[-1] == packed[-1] == b"[DONE]"
    assert len(packed) == len(direct) >= 2
    got = [without_timing(decode_event(data)) for data in packed[:-1]]
    assert got == [without_timing(orjson.loads(data)) for data in direct[:-1]]


def test_frontend_errors_are_plain_sglang_json(frontend):
    frame = encode_request({"input_ids": [1]})
    wrong_type = post(frontend.url, frame, PATH, headers={"content-type": "application/json"})
    assert (wrong_type.status_code, wrong_type.headers["content-type"]) == (415, "application/json")
    assert wrong_type.content == (
        b'{"object":"error","message":"Content-Type must be application/zstd, not \'application/json\'",'
        b'"type":"Unsupported Media Type","param":null,"code":415}'
    )
    truncated = post(frontend.url, frame[:-3], PATH, headers=ZSTD)
    assert (truncated.status_code, truncated.headers["content-type"]) == (400, "application/json")
    assert truncated.json() == {
        "error": {"message": f"truncated zstd frame: the body ends after {len(frame) - 3} bytes, inside block 1"}
    }
    invalid = post(frontend.url, encode_request({"input_ids": []}), PATH, headers=ZSTD)
    assert (invalid.status_code, invalid.content) == (
        400, b'{"error":{"message":"input_ids cannot be empty."}}'
    )
    streamed = zstd_sse(frontend.url, {"input_ids": [], "stream": True})
    assert streamed[:2] == (200, "text/event-stream; charset=utf-8")  # in-band, as SGLang streams it
    assert [decode_event(streamed[2][0]), streamed[2][1]] == [{"error": {"message": "input_ids cannot be empty."}}, b"[DONE]"]
    method = httpx.get(frontend.url + PATH, timeout=10)
    assert (method.status_code, method.headers["allow"]) == (405, "POST")
    assert method.json() == {
        "object": "error", "message": "Method Not Allowed", "type": "Method Not Allowed", "param": None, "code": 405
    }


def test_the_format_is_listed_with_its_distribution(frontend):
    formats = httpx.get(frontend.url + "/v1/models", timeout=10).json()["formats"]
    assert {
        "name": "zstd",
        "routes": ["POST /zstd/generate"],
        "worker_protocol": "sglang",
        "distribution": "asgi-generate-zstd",
        "version": "0.1.0",
    } in formats


@pytest.fixture(scope="module")
def gib_of_zeros() -> bytes:
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    chunk = bytes(MiB)
    return b"".join([cobj.compress(chunk) for _ in range(1024)] + [cobj.flush()])


def peak_rss(pid: int) -> int:
    """A process's peak resident set size in bytes (``VmHWM``)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def cpu_seconds(pid: int) -> float:
    """The CPU seconds (user and system) a process has used: unlike the
    wall clock, what a busy machine's other work does not add to."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def fresh_frontend(sims):
    """A frontend that has served nothing yet, so its peak RSS (VmHWM) is not
    already at a height an earlier test reached."""
    proc = start_frontend([f"sglang={s.url}" for s in sims])
    yield proc
    proc.stop()


def test_decompression_bomb_gets_413_fast_and_costs_at_most_the_cap(fresh_frontend, gib_of_zeros):
    frontend = fresh_frontend
    cap = 32 * MiB  # the frontend's default body cap
    before = peak_rss(frontend.proc.pid)
    start = cpu_seconds(frontend.proc.pid)
    resp = post(frontend.url, gib_of_zeros, PATH, headers=ZSTD)
    elapsed = cpu_seconds(frontend.proc.pid) - start
    assert (resp.status_code, resp.headers["content-type"]) == (413, "application/json")
    assert resp.json() == {
        "object": "error",
        "message": f"the request body decompresses to more than the limit of {cap} bytes",
        "type": "Request Entity Too Large",
        "param": None,
        "code": 413,
    }
    assert elapsed < 5.0, elapsed
    grown = peak_rss(frontend.proc.pid) - before
    # The compressed upload is buffered (~1 MiB) and at most the cap is
    # decompressed: a bound the GiB inside cannot meet.
    assert grown < cap + 16 * MiB, grown
