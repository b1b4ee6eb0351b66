"""1,000 SSE clients hang up at once: every engine leg's abort is
acknowledged, the worker stays up, and a request sent during the storm is
answered. (bench/bench_streams.py runs the same storm with 5,000.)

1,000 is what the storm proves: two sockets a stream are past the common
soft limit of 1,024 open files, vLLM's aborts take two batches of at most
512, SGLang's 1,000 requests queue behind 8 in flight. The test measures no
time: every wait is bounded (by a deadline made explicit here) only so that
a hang fails, and the bounds hold on a machine loaded by other test runs.

Each hypercorn worker class runs it once, against a different engine
protocol (trio with SGLang, one abort per request; asyncio with vLLM,
batched aborts): the four combinations would take twice the time for no path
these two do not cover.
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from support import start_frontend, start_sim, stats
from swarm import Swarm, http_get, http_post, post_bytes, raise_fd_limit

pytestmark = pytest.mark.e2e

STREAMS = 1000
#: Seconds the request sent during the storm, and then the frontend's
#: counters, may take (a loaded machine takes the disconnects in slowly).
STORM_WAIT_S = 30.0
PROMPT = [11, 12, 13, 14]


def _request(protocol: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    if protocol == "sglang":
        return "/generate", {"input_ids": PROMPT, "stream": stream,
                             "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}
    return "/inference/v1/generate", {"token_ids": PROMPT, "stream": stream,
                                      "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}


def _tokens(protocol: str, obj: dict) -> list[int]:
    return obj["output_ids"] if protocol == "sglang" else obj["choices"][0]["token_ids"]


async def _json(port: int, path: str) -> dict:
    status, body = await http_get(port, path)
    assert status == 200
    return orjson.loads(body)


async def _storm(protocol: str, sim, fe) -> None:
    # The expected answer, straight from the engine (one token: the next
    # would come a minute later).
    path, unary = _request(protocol, 1, False)
    status, body = await http_post(sim.port, path, unary)
    assert status == 200
    expected = _tokens(protocol, orjson.loads(body))
    assert len(expected) == 1

    # First token at once, then a minute of silence: every stream stays live.
    path, streaming = _request(protocol, 1000, True)
    swarm = Swarm(fe.port)
    firsts = await swarm.open([post_bytes(path, streaming)] * STREAMS)
    assert {tuple(_tokens(protocol, orjson.loads(f))) for f in firsts} == {tuple(expected)}
    engine_ids = set(stats(sim)["running_rids"])
    assert len(engine_ids) == STREAMS

    swarm.close_all()
    # Sent while the frontend is taking the 1,000 disconnects in.
    status, body = await http_post(fe.port, *_request(protocol, 1, False), timeout=STORM_WAIT_S)
    assert status == 200 and _tokens(protocol, orjson.loads(body)) == expected

    deadline = time.monotonic() + STORM_WAIT_S
    while True:
        fe_stats = await _json(fe.port, "/stats")
        done = fe_stats["aborts_sent"] == STREAMS and fe_stats["by_status"].get("client_disconnect") == STREAMS
        if done or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert {k: fe_stats[k] for k in ("aborts_sent", "aborts_acknowledged", "aborts_unacknowledged",
                                     "aborts_worker_lost")} == {
        "aborts_sent": STREAMS, "aborts_acknowledged": STREAMS, "aborts_unacknowledged": 0,
        "aborts_worker_lost": 0}
    assert fe_stats["by_status"] == {"client_disconnect": STREAMS, "ok": 1}
    aborts = fe_stats["workers"]["w0"]["aborts"]
    assert 1 <= aborts["peak_in_flight"] <= 8  # --abort-concurrency
    assert (aborts["queued"], aborts["in_flight"], aborts["refused"], aborts["expired"]) == (0, 0, 0, 0)
    # The engine was told about every one of its legs, and nothing still runs.
    sim_stats = stats(sim)
    prefix = "generate-tokens-" if protocol == "vllm" else ""
    assert sorted(sim_stats["abort_named_ids"]) == sorted(prefix + rid if prefix and not rid.startswith(prefix)
                                                      else rid for rid in engine_ids)
    assert sim_stats["abort_requests"] == aborts["requests"]
    models = await _json(fe.port, "/v1/models")
    assert [(w["state"], w["last_error"]) for w in models["workers"]] == [("up", None)]


@pytest.mark.parametrize("worker_class,protocol", [("trio", "sglang"), ("asyncio", "vllm")])
def test_abort_storm(worker_class, protocol):
    raise_fd_limit()
    sim = start_sim(protocol, itl_ms=60_000)
    fe = start_frontend([f"{protocol}={sim.url}"], worker_class=worker_class)
    try:
        asyncio.run(_storm(protocol, sim, fe))
        # Once the sim drops the aborted legs, nothing of theirs runs on.
        assert stats(sim)["running"] == 0
    finally:
        fe.stop()
        sim.stop()
