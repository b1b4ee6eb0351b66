"""``--policy kv-aware`` end to end: real simulators publishing KV events
over ZMQ on loopback, real frontends subscribing. Routing follows what the
engines cache (an eviction stops attracting requests), siblings land
together before any event arrives, a worker without events is routed by
its tree (and /stats says so), two frontend processes (and ``--workers 2``)
fed the same events and reading the same engines' loads pick the same
worker for the same request, and both steer new prompts off workers the
engines say are busy with requests neither replica sent."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq", reason="pyzmq (a dependency since KV events: pip install -e .)")
pytestmark = pytest.mark.e2e

import concurrent.futures
import threading

import httpx

from support import post, start_frontend, start_sim, stats, wait_until

EVENTS = '{"publisher": "zmq", "bind": true, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}'


def _sims(n: int, cache_tokens: int = 2000, events: bool = True):
    extra = ["--cache-tokens", str(cache_tokens), *(["--kv-events-config", EVENTS] if events else [])]
    return [start_sim(extra=extra) for _ in range(n)]


def _body(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}


def _routing(fe) -> dict:
    return httpx.get(fe.url + "/stats", timeout=5).json()["routing"]


def _synced(fe, sims, processes: int = 1) -> None:
    """Wait until each of ``fe``'s ``processes`` applied every batch each
    simulator published (a request to ``/stats`` reaches one process)."""
    seen: set[int] = set()

    def done() -> bool:
        body = httpx.get(fe.url + "/stats", timeout=5).json()
        workers = body["routing"]["workers"]
        for i, sim in enumerate(sims):
            sub = workers.get(f"w{i}", {}).get("subscriber")
            if sub is None or sub["last_seq"] != stats(sim)["kv_events"]["next_seq"] - 1:
                return False
        seen.add(body["pid"])
        return len(seen) == processes
    wait_until(done, timeout=20)


def _loads_read(fe, want: list[int], processes: int = 1) -> None:
    """Wait until each of ``fe``'s ``processes`` read the engines' loads as
    ``want`` (requests per worker, in worker order) in readings begun
    after this call (none in flight from before)."""
    first: dict[int, list[int]] = {}
    seen: set[int] = set()

    def done() -> bool:
        body = httpx.get(fe.url + "/stats", timeout=5).json()
        workers = [body["routing"]["workers"].get(f"w{i}", {}).get("load", {}) for i in range(len(want))]
        readings = [w.get("readings", 0) for w in workers]
        before = first.setdefault(body["pid"], readings)
        if [w.get("engine_requests") for w in workers] == want and all(
                r > b + 1 for r, b in zip(readings, before)):
            seen.add(body["pid"])
        return len(seen) == processes
    wait_until(done, timeout=20)


def _received(sims) -> list[int]:
    return [stats(s)["received"] for s in sims]


def _landed(sims, fe, ids: list[int]) -> int:
    before = _received(sims)
    assert post(fe.url, _body(ids)).status_code == 200
    moved = [i for i, (a, b) in enumerate(zip(before, _received(sims))) if a != b]
    assert len(moved) == 1
    return moved[0]


def test_routing_follows_the_engines_caches_and_their_evictions():
    sims = _sims(2, cache_tokens=400)
    fe = start_frontend([f"sglang={s.url}" for s in sims],
                        extra=["--policy", "kv-aware", "--kv-predict-ttl", "0.001"])
    try:
        wait_until(lambda: all(w["source"] == "events" for w in _routing(fe)["workers"].values())
                   and len(_routing(fe)["workers"]) == 2)
        p = list(range(1000, 1300))
        post(sims[0].url, _body(p[:100])).raise_for_status()  # behind the frontend's back
        post(sims[1].url, _body(p)).raise_for_status()
        _synced(fe, sims)
        assert _landed(sims, fe, p + [1]) == 1  # 300 tokens held beat 100
        for other in (list(range(2000, 2300)), list(range(3000, 3300))):  # evict p on sim 1
            post(sims[1].url, _body(other)).raise_for_status()
        _synced(fe, sims)
        assert _landed(sims, fe, p + [2]) == 0  # now only sim 0 holds any of it
        routing = _routing(fe)
        assert routing["by_events"] == 2 and routing["workers"]["w1"]["blocks"] <= 400
        metrics = httpx.get(fe.url + "/metrics", timeout=5).text
        lines = [line for line in metrics.splitlines() if line.startswith("asgi_generate_kv_events{")
                 and 'quantity="index_blocks"' in line and 'worker="w1"' in line]
        assert len(lines) == 1 and float(lines[0].split()[-1]) == routing["workers"]["w1"]["blocks"]
    finally:
        fe.stop()
        for s in sims:
            s.stop()


def test_siblings_land_together_before_any_event_and_a_silent_worker_uses_its_tree():
    sims = _sims(2) + _sims(1, events=False)
    fe = start_frontend([f"sglang={s.url}" for s in sims], extra=["--policy", "kv-aware"])
    try:
        wait_until(lambda: len(_routing(fe)["workers"]) == 3
                   and _routing(fe)["workers"]["w2"].get("why_tree", "discovering") != "discovering")
        workers = _routing(fe)["workers"]
        assert [workers[w]["source"] for w in ("w0", "w1", "w2")] == ["events", "events", "tree"]
        assert "kv_events" in workers["w2"]["why_tree"]
        # A GRPO group: 6 samples of one prompt, sent at once. The prompt
        # outweighs what the group's own load costs (--kv-load-weight 128
        # tokens a request, counted twice at most: own and engine readings),
        # so the samples stay together however many are in flight.
        group = list(range(100, 1700))
        before = _received(sims)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: post(fe.url, _body(group)).status_code, range(6)))
        assert answers == [200] * 6
        moved = [b - a for a, b in zip(before, _received(sims))]
        assert sorted(moved) == [0, 0, 6]
    finally:
        fe.stop()
        for s in sims:
            s.stop()


def test_two_frontend_replicas_pick_the_same_worker():
    """One replica a single trio process, the other ``--workers 2`` asyncio
    processes: three processes, each with its own subscribers and index."""
    sims = _sims(3)
    urls = [f"sglang={s.url}" for s in sims]
    # An idle engine read every 0.1 s as a busy one is (not every 1 s): each
    # wait for two fresh readings of the loads takes 0.2 s, not 2.
    extra = ["--policy", "kv-aware", "--kv-predict-ttl", "0.001", "--kv-load-idle-interval", "0.1"]
    a = start_frontend(urls, extra=extra)
    b = start_frontend(urls, worker_class="asyncio", extra=[*extra, "--workers", "2"])
    try:
        prefixes = [list(range(200 + 400 * i, 400 + 400 * i)) for i in range(3)]
        for sim, p in zip(sims, prefixes):  # warm the engines directly: the replicas learn only from events
            post(sim.url, _body(p)).raise_for_status()
        _synced(a, sims)
        _synced(b, sims, processes=2)  # every process subscribed and caught up
        picks = []
        fresh = [list(range(2000 + 50 * i, 2050 + 50 * i)) for i in range(2)]  # cached nowhere: the tie-break
        for i, p in enumerate(prefixes + fresh):
            ids = p + [3000 + i]
            tie = i >= len(prefixes)  # a tie: at the same loads (a cached prefix outweighs one request)
            if tie:
                _loads_read(a, [0, 0, 0])
            via_a = _landed(sims, a, ids)
            if tie:  # read again: b may have read a's request in flight
                _loads_read(b, [0, 0, 0], processes=2)
            via_b = _landed(sims, b, ids)
            assert via_a == via_b
            picks.append(via_a)
        assert picks[:3] == [0, 1, 2]  # where each prefix was cached
        # Sims 0 and 2 busy (paused in place) with requests neither replica
        # sent: both replicas read it from the engines and place new prompts
        # on sim 1.
        for i in (0, 2):
            post(sims[i].url, {"mode": "in_place"}, path="/pause_generation").raise_for_status()
        busy = [threading.Thread(target=post, args=(sims[i].url, _body([5, 6, 7]))) for i in (0, 0, 2)]
        for t in busy:
            t.start()
        try:
            _loads_read(a, [2, 0, 1])
            _loads_read(b, [2, 0, 1], processes=2)
            new = [list(range(2400 + 50 * i, 2450 + 50 * i)) for i in range(3)]
            assert [(_landed(sims, a, p), _landed(sims, b, p + [1])) for p in new] == [(1, 1)] * 3
        finally:
            for i in (0, 2):
                post(sims[i].url, {}, path="/continue_generation").raise_for_status()
            for t in busy:
                t.join(10)
    finally:
        a.stop()
        b.stop()
        for s in sims:
            s.stop()


def test_the_tokens_a_running_request_holds_count_on_its_worker_until_it_ends():
    """``--kv-active-weight``: a streamed request of a 300-token prompt
    running on a worker holds its prompt plus the tokens generated so far
    there (``/stats`` ``load.active_tokens``, read from the leg's routing
    key), and nothing once it ended; the other worker holds none."""
    sims = [start_sim(extra=["--cache-tokens", "2000", "--kv-events-config", EVENTS], itl_ms=50) for _ in range(2)]
    fe = start_frontend([f"sglang={s.url}" for s in sims],
                        extra=["--policy", "kv-aware", "--kv-active-weight", "0.05", "--kv-load-interval", "0"])
    try:
        wait_until(lambda: len(_routing(fe)["workers"]) == 2
                   and all(w["source"] == "events" for w in _routing(fe)["workers"].values()))
        body = {"input_ids": list(range(1000, 1300)), "stream": True,
                "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
        seen: list[list[int]] = []
        with httpx.stream("POST", fe.url + "/generate", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            for n, _ in enumerate(resp.iter_lines()):
                if n == 10:  # mid-answer
                    workers = _routing(fe)["workers"]
                    seen.append(sorted(workers[w]["load"]["active_tokens"] for w in ("w0", "w1")))
        assert len(seen) == 1 and seen[0][0] == 0 and 300 < seen[0][1] < 340
        wait_until(lambda: [w["load"]["active_tokens"] for w in _routing(fe)["workers"].values()] == [0, 0])
        assert _routing(fe)["active_weight"] == 0.05
    finally:
        fe.stop()
        for s in sims:
            s.stop()
