"""Legs given up under load: a stream silent past the inter-token deadline
moves to another worker and its stalled leg is aborted at once, not when
the request ends; concurrent migrations are bounded fleet-wide.

The simulators' fault hook (``POST /sim/faults``, ``"stall": true``) makes
a leg fall silent after a number of tokens with its worker healthy, as an
engine stuck on one request does; it generates again only once aborted.
"""

from __future__ import annotations

import anyio
import httpx
import orjson
import pytest

from support import PROMPT, RawClient, start_frontend, start_sim, stats, trace_records, wait_until

GEN = {"sglang": "/generate", "vllm": "/inference/v1/generate"}


def _stream(protocol: str, budget: int) -> dict:
    if protocol == "sglang":
        return {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": budget, "ignore_eos": True}}
    return {"token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": budget, "ignore_eos": True}}


def _output_ids(protocol: str, events: list[bytes]) -> list[int]:
    """A stream's output ids (SGLang's are cumulative, vLLM's per chunk)."""
    objs = [o for e in events if e != b"[DONE]" and "error" not in (o := orjson.loads(e))]
    if protocol == "sglang":
        return objs[-1]["output_ids"]
    return [t for o in objs for c in o["choices"] for t in c["token_ids"]]


def _stall(sims, after_tokens: int, count: int = 1) -> None:
    for s in sims:
        httpx.post(s.url + "/sim/faults", json={"after_tokens": after_tokens, "input_len": len(PROMPT),
                                                "stall": True, "count": count}, timeout=5).raise_for_status()


@pytest.mark.e2e
@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_stalled_leg_is_aborted_when_the_stream_moves_on(protocol, worker_class, tmp_path):
    """Two tokens, then silence past ``--inter-token-timeout``: the stream
    continues on the other worker from those tokens, and the stalled leg's
    engine has its abort before the continuation's first token reached the
    client (the continuation still has 0.75 s to run)."""
    sims = [start_sim(protocol, itl_ms=150) for _ in range(2)]
    fe = None
    try:
        _stall(sims, 2)
        fe = start_frontend([f"{protocol}={s.url}" for s in sims], worker_class=worker_class,
                            extra=["--inter-token-timeout", "0.5", "--trace-file", str(tmp_path / "t.jsonl")])
        client = RawClient(fe.url)
        client.send(orjson.dumps(_stream(protocol, 8)), path=GEN[protocol])
        events = client.events(3)
        (stalled,) = [s for s in sims if stats(s)["faults_fired"]]
        at_resume = stats(stalled)
        events += client.events(100)
        client.close()
        rec = wait_until(lambda: (r := trace_records(str(tmp_path / "t") + ".*.jsonl")) and r[-1])
    finally:
        if fe is not None:
            fe.stop()
        for s in sims:
            s.stop()
    assert (at_resume["running"], len(at_resume["abort_named_ids"])) == (0, 1)
    assert len(_output_ids(protocol, events)) == 8
    assert (rec["status"], rec["output_tokens"], rec["migrations"]) == ("ok", 8, 1)
    assert [(a["role"], a["outcome"], a.get("tokens"), a.get("abort_acked")) for a in rec["attempts"]] == [
        ("aggregated", "timeout", 2, True), ("resumed", "finished", 6, None)]


def _in_band_error(protocol: str, events: list[bytes]) -> str | None:
    """The in-band error message a stream ended with, if any."""
    errors = [o["error"] for e in events if e != b"[DONE]" and "error" in (o := orjson.loads(e))]
    return errors[0]["message"] if errors else None


@pytest.mark.e2e
@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_migration_storm_runs_within_the_bound(protocol, worker_class, tmp_path):
    """Four streams stall at once and migrate, two slots: two resume (each
    holding its slot for its whole resumed leg, 1.2 s, not only to its
    first token) and two wait past ``--migration-wait`` and end with the
    in-band error; /stats and /metrics count them."""
    sims = [start_sim(protocol, itl_ms=150) for _ in range(2)]
    fe = None
    try:
        _stall(sims, 2, count=4)
        fe = start_frontend([f"{protocol}={s.url}" for s in sims], worker_class=worker_class,
                            extra=["--inter-token-timeout", "0.3", "--max-concurrent-migrations", "2",
                                   "--migration-wait", "0.4", "--trace-file", str(tmp_path / "t.jsonl")])
        clients = [RawClient(fe.url) for _ in range(4)]
        for c in clients:
            c.send(orjson.dumps(_stream(protocol, 10)), path=GEN[protocol])
        answers = [c.events(100) for c in clients]
        for c in clients:
            c.close()
        recs = wait_until(lambda: len(r := trace_records(str(tmp_path / "t") + ".*.jsonl")) == 4 and r)
        fe_stats = httpx.get(fe.url + "/stats", timeout=5).json()
        metrics = httpx.get(fe.url + "/metrics", timeout=5).text
    finally:
        if fe is not None:
            fe.stop()
        for s in sims:
            s.stop()
    ended = sorted((len(_output_ids(protocol, a)), _in_band_error(protocol, a)) for a in answers)
    refused = ("no migration slot within 0.4 s: 2 streams already migrating (--max-concurrent-migrations 2)")
    assert ended == [(2, refused), (2, refused), (10, None), (10, None)]
    assert sorted((r["status"], r["output_tokens"], r.get("migrations", 0)) for r in recs) == [
        ("ok", 10, 1), ("ok", 10, 1), ("unavailable", 2, 0), ("unavailable", 2, 0)]
    assert fe_stats["migration_slots"] == {"limit": 2, "active": 0, "peak": 2, "waiting": 0}
    assert (fe_stats["migration_waits_taken"], fe_stats["migration_waits_timed_out"]) == (0, 2)
    fmt = "sglang" if protocol == "sglang" else "vllm"
    assert f'asgi_generate_migration_waits_total{{format="{fmt}",result="timed_out"}} 2.0' in metrics


def test_migration_slots_are_taken_in_turn_and_held_until_given_back():
    """Two slots, five streams: the first two take one at once, the rest
    wait in arrival order and each takes the slot given back; one whose
    wait runs out leaves the queue without taking one."""
    from asgi_generate.tracing.state import RequestState
    from asgi_generate.request.migrations import MigrationSlots

    slots = MigrationSlots(lambda: 2)
    order: list[tuple[int, bool]] = []
    states = [RequestState(f"r{i}", "sglang", "/generate", "POST") for i in range(5)]

    async def stream(i: int, wait: float) -> None:
        taken = await slots.acquire(wait, states[i])
        order.append((i, taken))
        if taken:
            await anyio.sleep(0.6)
            slots.give_back()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i, wait in enumerate((5, 5, 5, 0.3, 5)):
                tg.start_soon(stream, i, wait)
                await anyio.sleep(0.01)
            assert (slots.active, slots.waiting) == (2, 3)

    anyio.run(main)
    assert order == [(0, True), (1, True), (3, False), (2, True), (4, True)]
    assert [s.migration_wait for s in states] == [None, None, "taken", "timed_out", "taken"]
    assert slots.stats() == {"limit": 2, "active": 0, "peak": 2, "waiting": 0}
