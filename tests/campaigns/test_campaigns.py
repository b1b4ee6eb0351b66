"""Load-shaped scenarios: many concurrent streams with random disconnects,
and a graceful shutdown with streams in flight."""

from __future__ import annotations

import random
import signal

import anyio
import httpx
import orjson
import pytest

from support import campaign_size, post, start_frontend, start_sim, stats, wait_until

pytestmark = pytest.mark.e2e


def _body(i: int, n: int) -> dict:
    return {"input_ids": [50 + i, 60 + i % 7], "rid": f"c{i}", "stream": True,
            "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}


async def _stream(client: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None) -> list[bytes]:
    """Read SSE payloads; with ``hang_up_after``, disconnect after that many."""
    events: list[bytes] = []
    async with client.stream("POST", url + "/generate", content=orjson.dumps(body)) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:].encode())
                if hang_up_after is not None and len(events) == hang_up_after:
                    break
    return events


@pytest.fixture(scope="module")
def itl_sims():
    # Only the frontend's aborts stop jobs: the engines' own abort of a
    # vanished client waits 60 s (SGLang: 2 s), beyond any load delay.
    extra = ["--disconnect-abort-s", "60"]
    procs = [start_sim(ttft_ms=100, itl_ms=100, extra=extra), start_sim(ttft_ms=100, itl_ms=100, extra=extra)]
    yield procs
    for p in procs:
        p.stop()


#: Streams in the half-disconnected campaign (bench/bench_campaigns.py: 200).
STREAMS = campaign_size(100, 200)


def test_streams_half_disconnected(itl_sims):
    """:data:`STREAMS` concurrent streams, every other one hanging up after
    1-10 tokens: every hang-up aborts its engine request once, every other
    stream is the engine's exact answer."""
    fe = start_frontend([f"sglang={s.url}" for s in itl_sims], extra=["--sse-keepalive", "0"])
    try:
        rng = random.Random(7)
        n_tokens = 20
        # A stream that hangs up asks for ten times as many tokens (20 s of
        # decode), so every hang-up meets a live engine request however
        # late a loaded machine's client reads.
        plan = [rng.randint(1, 10) if i % 2 else None for i in range(STREAMS)]
        budget = [n_tokens if hang_up is None else 10 * n_tokens for hang_up in plan]
        fast = start_sim()  # same deterministic engine, no delays: the expected answers
        try:
            expected = {
                i: post(fast.url, {**_body(i, n_tokens), "stream": False}).json()["output_ids"]
                for i in range(0, STREAMS, 2)
            }
        finally:
            fast.stop()
        aborted_before = sum(len(stats(s)["aborted_rids"]) for s in itl_sims)
        abort_calls_before = sum(stats(s)["abort_requests"] for s in itl_sims)
        results: dict[int, list[bytes]] = {}

        async def main() -> None:
            limits = httpx.Limits(max_connections=STREAMS + 50, max_keepalive_connections=0)
            async with httpx.AsyncClient(limits=limits, timeout=60) as client:
                async with anyio.create_task_group() as tg:
                    for i in range(STREAMS):
                        async def one(i: int = i) -> None:
                            results[i] = await _stream(client, fe.url, _body(i, budget[i]), plan[i])
                        tg.start_soon(one)

        anyio.run(main)
        for i in range(STREAMS):
            if plan[i] is None:
                assert results[i][-1] == b"[DONE]"
                assert orjson.loads(results[i][-2])["output_ids"] == expected[i]
                assert len(results[i]) == n_tokens + 1
            else:
                assert [len(orjson.loads(e)["output_ids"]) for e in results[i]] == list(range(1, plan[i] + 1))
        wait_until(lambda: sum(stats(s)["running"] for s in itl_sims) == 0)
        aborted = sum(len(stats(s)["aborted_rids"]) for s in itl_sims) - aborted_before
        assert aborted == STREAMS // 2
        assert sum(stats(s)["abort_requests"] for s in itl_sims) - abort_calls_before == STREAMS // 2
        wait_until(lambda: httpx.get(fe.url + "/stats").json()["request_items"] == STREAMS)
        fe_stats = httpx.get(fe.url + "/stats").json()
        assert fe_stats["by_status"] == {"ok": STREAMS // 2, "client_disconnect": STREAMS // 2}
        assert fe_stats["aborts_sent"] == STREAMS // 2 and fe_stats["aborts_unacknowledged"] == 0
    finally:
        fe.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_graceful_shutdown_with_50_streams_in_flight(itl_sims, worker_class):
    fe = start_frontend([f"sglang={s.url}" for s in itl_sims], worker_class=worker_class,
                        extra=["--shutdown-grace", "3", "--sse-keepalive", "0"])
    try:
        aborted_before = sum(len(stats(s)["aborted_rids"]) for s in itl_sims)
        results: dict[int, list[bytes]] = {}

        async def main() -> None:
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
            async with httpx.AsyncClient(limits=limits, timeout=60) as client:
                async with anyio.create_task_group() as tg:
                    for i in range(55):
                        n = 5 if i >= 50 else 400  # 5 finish within the grace period

                        async def one(i: int = i, n: int = n) -> None:
                            results[i] = await _stream(client, fe.url, _body(1000 + i, n), None)
                        tg.start_soon(one)
                    with anyio.fail_after(20):
                        while sum(stats(s)["received"] for s in itl_sims) < 55 or len(results) < 5 and any(
                            stats(s)["running"] == 0 for s in itl_sims):
                            await anyio.sleep(0.05)
                    await anyio.sleep(0.3)
                    fe.signal(signal.SIGTERM)

        anyio.run(main)
        assert fe.proc.wait(20) == 0
        shutdown = {"error": {"message": "server is shutting down", "type": "503", "code": 503}}
        for i in range(50):
            assert results[i][-1] == b"[DONE]"
            assert orjson.loads(results[i][-2]) == shutdown
        for i in range(50, 55):
            assert orjson.loads(results[i][-2])["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
        wait_until(lambda: sum(stats(s)["running"] for s in itl_sims) == 0)
        assert sum(len(stats(s)["aborted_rids"]) for s in itl_sims) - aborted_before == 50
    finally:
        fe.stop()
