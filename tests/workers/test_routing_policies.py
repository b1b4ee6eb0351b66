"""Routing policies end to end: real frontends and simulators on loopback.
Two frontend processes agree on every session key's worker; a policy only
chooses the worker (answers and records unchanged); the simulator's prefix
cache reports cached tokens as SGLang and vLLM do, and the record carries them."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from support import (campaign_size, post, sse, start_frontend, start_sim, stats, wait_until, without_timing,
                     trace_records)

BODY = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}


@pytest.fixture(scope="module")
def two_sims():
    procs = [start_sim(), start_sim()]
    yield procs
    for p in procs:
        p.stop()


def landed(sims, send) -> int:
    """Which simulator ``send()``'s one request reached."""
    before = [stats(s)["received"] for s in sims]
    send()
    after = [stats(s)["received"] for s in sims]
    moved = [i for i, (b, a) in enumerate(zip(before, after)) if a != b]
    assert len(moved) == 1 and after[moved[0]] == before[moved[0]] + 1
    return moved[0]


#: Session keys: a home that differs between two processes (a per-process
#: hash seed) shows on most keys. Homes hash the workers' URLs, whose ports
#: differ each run: past these, keys are sent until both workers were a home.
KEYS = campaign_size(6, 12)


@pytest.mark.e2e
def test_two_frontend_processes_agree_on_every_key(two_sims):
    urls = [f"sglang={s.url}" for s in two_sims]
    a = start_frontend(urls, extra=["--policy", "session"])
    b = start_frontend(list(reversed(urls)), worker_class="asyncio", extra=["--policy", "session"])
    try:
        # Ready may mean one worker up: a key's home is chosen among the
        # workers up, so both must be before the first key is sent.
        for fe in (a, b):
            wait_until(lambda: httpx.get(fe.url + "/health", timeout=5).json()["healthy_workers"] == 2)
        homes = []
        for i in range(40):  # 40 keys on one worker by chance: 2 ** -39
            if i >= KEYS and set(homes) == {0, 1}:
                break
            key = {"x-session-id": f"agent-{i}"}
            via_a = landed(two_sims, lambda: post(a.url, BODY, headers=key).raise_for_status())
            via_b = landed(two_sims, lambda: post(b.url, BODY, headers=key).raise_for_status())
            again = landed(two_sims, lambda: post(a.url, BODY, headers=key).raise_for_status())
            assert via_a == via_b == again
            homes.append(via_a)
        assert set(homes) == {0, 1}  # the keys spread over both workers
        routing = httpx.get(a.url + "/stats").json()["routing"]
        assert routing == {"policy": "session", "requests": 2 * len(homes), "keyless": 0,
                           "headers": ["x-session-id", "x-smg-routing-key"], "epsilon": 1.0,
                           "affinity_hits": 2 * len(homes), "spills": 0}
    finally:
        a.stop()
        b.stop()


def _records(base: str) -> list[dict]:
    return trace_records(f"{base}.*.jsonl")


def _comparable(rec: dict) -> dict:
    """A record less what differs between runs by nature: ids, clocks and
    which worker (what a policy chooses)."""
    drop = {"request_id", "event_time_unix_ms", "received_unix_ms", "dispatch_wait_ms", "ttft_ms", "total_ms",
            "mean_itl_ms"}
    out = {k: v for k, v in rec.items() if k not in drop}
    out["attempts"] = [{k: v for k, v in a.items() if k not in ("engine_id", "worker_id")} for a in rec["attempts"]]
    return out


@pytest.mark.e2e
def test_answers_and_records_unchanged_by_the_policy(two_sims, tmp_path):
    urls = [f"sglang={s.url}" for s in two_sims]
    session = {"x-session-id": "s1"}
    requests = [
        ({**BODY, "rid": "u1"}, session, False),
        ({"input_ids": list(range(40, 90)), "stream": True, "rid": "s1",
          "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}, session, True),
        ({"text": "Hello there, agent.", "rid": "t1", "sampling_params": {"max_new_tokens": 4}}, {}, False),
        ({"input_ids": [5, 6], "rid": "bad", "sampling_params": {"max_new_tokens": -1}}, session, False),
    ]
    answers, records = {}, {}
    for policy in ("least-outstanding", "session", "cache-aware"):
        base = str(tmp_path / policy)
        fe = start_frontend(urls, extra=["--policy", policy, "--trace-file", base + ".jsonl"])
        try:
            got = []
            for body, headers, stream in requests:
                if stream:
                    status, events = sse(fe.url, body, headers=headers)
                    got.append((status, [without_timing(orjson.loads(e)) if e != b"[DONE]" else e for e in events]))
                else:
                    r = post(fe.url, body, headers=headers)
                    got.append((r.status_code, without_timing(r.json())))
            answers[policy] = got
        finally:
            fe.stop()
        records[policy] = [_comparable(r) for r in _records(base)]
    assert [status for status, _ in answers["least-outstanding"]] == [200, 200, 200, 400]
    assert answers["session"] == answers["cache-aware"] == answers["least-outstanding"]
    assert len(records["least-outstanding"]) == 4
    assert records["session"] == records["cache-aware"] == records["least-outstanding"]


@pytest.mark.e2e
def test_flush_through_the_frontend_empties_the_trees(two_sims):
    fe = start_frontend([f"sglang={s.url}" for s in two_sims], extra=["--policy", "cache-aware"])
    try:
        for _ in range(3):
            assert post(fe.url, BODY).status_code == 200
        routing = httpx.get(fe.url + "/stats").json()["routing"]
        assert (routing["affinity_hits"], routing["misses"], routing["imbalanced"]) == (2, 1, 0)
        assert list(routing["trees"].values()) == [{"tokens": 4, "nodes": 1, "evicted_tokens": 0}]
        assert httpx.post(fe.url + "/flush_cache").status_code == 200
        assert httpx.get(fe.url + "/stats").json()["routing"]["trees"] == {}
    finally:
        fe.stop()


@pytest.mark.e2e
def test_sglang_sim_prefix_cache_reports_cached_tokens_and_the_record_carries_them(tmp_path):
    sim = start_sim(extra=["--cache-tokens", "64"])
    base = str(tmp_path / "trace")
    fe = start_frontend([f"sglang={sim.url}"], extra=["--trace-file", base + ".jsonl"])
    try:
        def cached(ids: list[int], n: int = 4) -> tuple[int, list[int]]:
            r = post(fe.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}})
            assert r.status_code == 200
            return r.json()["meta_info"]["cached_tokens"], r.json()["output_ids"]

        a = list(range(100, 120))
        assert cached(a)[0] == 0
        hit, out = cached(a)
        assert hit == 19  # all but the last prompt token (SGLang computes it for its logits)
        assert cached(a + out + [7, 8])[0] == 24  # the prompt and its answer were cached at the end
        b = list(range(300, 360))  # 60 + 4 output: the cache (64 tokens) then holds b alone
        assert cached(b)[0] == 0
        assert cached(a)[0] == 0  # evicted (least recently used)
        assert cached(b)[0] == 0  # and b in turn, to make room for a again
        assert httpx.post(sim.url + "/flush_cache").status_code == 200
        assert cached(a)[0] == 0
        st = stats(sim)["cache"]
        assert (st["capacity_tokens"], st["prompt_tokens"], st["cached_tokens"], st["flushes"]) == (
            64, 20 * 4 + 26 + 60 * 2, 19 + 24, 1)
        recs = wait_until(lambda: (r := _records(base)) and len(r) == 7 and r)
        assert [r["cached_tokens"] for r in recs] == [0, 19, 24, 0, 0, 0, 0]
    finally:
        fe.stop()
        sim.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("details", [True, False])
def test_vllm_sim_reports_cached_tokens_only_with_prompt_tokens_details(details):
    sim = start_sim("vllm", extra=["--cache-tokens", "1000", *(["--enable-prompt-tokens-details"] * details)])
    try:
        body = {"token_ids": list(range(100, 140)), "sampling_params": {"max_tokens": 2}}
        first = post(sim.url, body, path="/inference/v1/generate").json()["usage"]
        second = post(sim.url, body, path="/inference/v1/generate").json()["usage"]
        nulls = {"created_cache_tokens": None, "multimodal_tokens": None}
        assert first["prompt_tokens_details"] == ({"cached_tokens": 0, **nulls} if details else None)
        # 39 of 40 tokens are held, counted in whole 16-token blocks.
        assert second["prompt_tokens_details"] == ({"cached_tokens": 32, **nulls} if details else None)
        status, events = sse(sim.url, {**body, "stream": True, "stream_options": {"include_usage": True}},
                             path="/inference/v1/generate")
        usage = orjson.loads(events[-2])["usage"]
        assert usage.get("prompt_tokens_details") == ({"cached_tokens": 32} if details else None)
        assert ("prompt_tokens_details" in usage) is details  # exclude_none on the closing chunk
    finally:
        sim.stop()


@pytest.mark.e2e
def test_prefill_time_grows_with_uncached_tokens():
    sim = start_sim(extra=["--cache-tokens", "4096", "--prefill-us-per-token", "4000"])
    try:
        body = {"input_ids": list(range(100, 600)), "sampling_params": {"max_new_tokens": 1}}
        t0 = time.monotonic()
        assert post(sim.url, body).json()["meta_info"]["cached_tokens"] == 0
        cold = time.monotonic() - t0
        t0 = time.monotonic()
        assert post(sim.url, body).json()["meta_info"]["cached_tokens"] == 499
        warm = time.monotonic() - t0
        assert cold >= 2.0  # 500 uncached tokens x 4 ms
        assert warm < 1.5  # 1 uncached token: 4 ms (the margin is for a busy machine)
    finally:
        sim.stop()


def test_a_prompt_queued_behind_its_twin_hits_the_cache():
    """The match is taken when a prefill starts: of two identical prompts
    sent at once, the second waits for the first's prefill and hits."""
    import anyio

    from asgi_generate.sim.engine import Job, SimEngine
    from asgi_generate.sim.model import Model

    engine = SimEngine(Model(4096, 2, 3), cache_tokens=100, prefill_us_per_token=1000)
    jobs = [Job(f"r{i}", list(range(100, 120)), 2, ignore_eos=True) for i in range(2)]

    async def run(job: Job) -> None:
        engine.submit(job)
        async for _ in engine.tokens(job):
            pass
        engine.finish(job)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(run, job)

    t0 = time.monotonic()
    anyio.run(main)
    assert [j.cached_tokens for j in jobs] == [0, 19]
    assert time.monotonic() - t0 >= 0.021  # 20 tokens, then 1 token, at 1 ms each
    assert engine.stats()["cache"] == {"capacity_tokens": 100, "tokens": 22, "prompt_tokens": 40,
                                       "cached_tokens": 19, "evicted_tokens": 0, "flushes": 0}
