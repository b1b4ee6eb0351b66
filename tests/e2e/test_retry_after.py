"""When an engine is full, the client hears it as the engine said it: an
engine's 429 or 503 with ``Retry-After`` reaches the client with its
``Retry-After`` (unary and SSE, both formats: a stream's error comes before
the 200, as the frontend's own non-200 answer), and the frontend's own 503
for no healthy worker carries one too (the health probe interval). Both
worker classes.

Neither engine sends ``Retry-After`` itself (vLLM 0.33.0's
vllm/entrypoints/openai/api_server.py and SGLang 0.5.23's
sglang/srt/entrypoints/http_server.py never set the header), so the
simulator, which answers as they do, does not either: the full engine here
is tests/wire_proxy.py's :class:`WireProxy` in front of a simulator,
answering the generate requests marked by their first prompt token in the
engine's place (``answer``) and passing every other request (health,
server info) through."""

from __future__ import annotations

import httpx
import orjson
import pytest

from support import free_port, post, start_frontend, start_sim, wait_until
from wire_proxy import WireProxy

pytestmark = pytest.mark.e2e

VLLM = "/inference/v1/generate"
GENERATE = {"sglang": "/generate", "vllm": VLLM}
#: What a full engine answers, by the prompt's first token: (status, Retry-After).
FULL = {429: (429, b"7"), 503: (503, b"30")}


def _full_engine(seen):
    """A full engine's answer to a generate request whose prompt starts with
    429 or 503 (in the format's error shape), else ``None`` (forwarded)."""
    body = seen.body
    if seen.path not in GENERATE.values() or type(body) is not dict:
        return None
    ids = body.get("input_ids") or body.get("token_ids") or [None]
    if ids[0] not in FULL:
        return None
    status, retry_after = FULL[ids[0]]
    error = {"error": {"message": "the engine is full", "type": "Overloaded", "param": None, "code": status}}
    return status, [(b"content-type", b"application/json"), (b"retry-after", retry_after)], orjson.dumps(error)


@pytest.fixture(scope="module")
def fleet():
    sims = {"sglang": start_sim(), "vllm": start_sim("vllm")}
    proxies = {p: WireProxy(s.url, answer=_full_engine) for p, s in sims.items()}
    yield proxies
    for proxy in proxies.values():
        proxy.stop()
    for sim in sims.values():
        sim.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fe(request, fleet):
    proc = start_frontend([f"{p}={proxy.url}" for p, proxy in fleet.items()], worker_class=request.param)
    wait_until(lambda: [w["state"] for w in httpx.get(proc.url + "/v1/models", timeout=5).json()["workers"]]
               == ["up", "up"])
    yield proc
    proc.stop()


def _body(engine: str, first: int, stream: bool, n: int = 1) -> dict:
    if engine == "sglang":
        return {"input_ids": [first, 2, 3], "stream": stream, "sampling_params": {"max_new_tokens": 2, "n": n}}
    return {"token_ids": [first, 2, 3], "stream": stream, "sampling_params": {"max_tokens": 2, "n": n}}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [429, 503])
def test_an_engines_retry_after_reaches_the_client(fe, engine, stream, status):
    got = post(fe.url, _body(engine, status, stream), GENERATE[engine])
    want, retry_after = FULL[status]
    assert (got.status_code, got.headers.get("retry-after"), got.json()) == (want, retry_after.decode(), {
        "error": {"message": "the engine is full", "type": "Overloaded", "param": None, "code": want}})


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_an_answer_without_retry_after_gets_none(fe, engine):
    got = post(fe.url, _body(engine, 1, False), GENERATE[engine])
    assert (got.status_code, got.headers.get("retry-after")) == (200, None)


#: The frontend's own 503 in each format's error shape.
NO_WORKER = {
    "sglang": {"object": "error", "message": "no healthy worker for protocol 'sglang'", "type": "503", "param": None,
               "code": 503},
    "vllm": {"error": {"message": "no healthy worker for protocol 'vllm'", "type": "Service Unavailable",
                       "param": None, "code": 503}},
}


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_the_frontends_own_no_healthy_worker_503_says_when_to_retry(worker_class):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: never up
    fe = start_frontend([f"sglang={dead}", f"vllm={dead}"], worker_class=worker_class,
                        extra=["--health-interval", "2.5"], health="/stats")
    try:
        for engine in ("sglang", "vllm"):
            for stream in (False, True):
                for n in (1, 2):  # one item; a request with items
                    got = post(fe.url, _body(engine, 1, stream, n), GENERATE[engine])
                    assert (got.status_code, got.headers.get("retry-after")) == (503, "3"), (engine, stream, n)
                    assert got.json() == NO_WORKER[engine], (engine, stream, n)
    finally:
        fe.stop()
