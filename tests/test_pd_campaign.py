"""A campaign of 300 SGLang P/D requests: unary and SSE, a third of them
hung up at a random point, one prefill worker killed halfway. Every request
leaves exactly one record, every completed answer is the aggregated answer,
and no simulator is left running a request or holding a room."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson

from support import RawClient, start_sim, stats
from test_pd import DECODE, PREFILL, Fleet, _clean

N = 300


def test_campaign(tmp_path_factory):
    p1, p2 = start_sim(ttft_ms=5, extra=PREFILL), start_sim(ttft_ms=5, extra=PREFILL)
    d1, d2 = start_sim(itl_ms=1, extra=DECODE), start_sim(itl_ms=1, extra=DECODE)
    agg = start_sim()
    fe = Fleet(tmp_path_factory, [p1, p2], [d1, d2])
    rng = random.Random(20261130)
    plans = [(i, rng.random() < 0.5, rng.random() < 1 / 3, rng.randint(1, 12), rng.random()) for i in range(N)]
    client = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=12))
    want: dict[tuple[int, int], list[int]] = {}
    for i, _, _, n, _ in plans:
        key = (i % 7, n)
        if key not in want:
            want[key] = client.post(agg.url + "/generate", content=orjson.dumps(_body(i, n, False))).json()[
                "output_ids"]
    done = threading.Semaphore(0)
    results: dict[str, tuple[int, list[int] | None]] = {}

    def run(plan) -> None:
        i, stream, hang_up, n, at = plan
        try:
            if hang_up:
                c = RawClient(fe.url)
                c.send(orjson.dumps(_body(i, n, stream)))
                if stream and at < 0.5:
                    c.events(1 + int(at * 6))
                else:
                    time.sleep(at * 0.02)
                c.close()
            else:  # one keep-alive client for all, as a rollout driver has
                r = client.post(fe.url + "/generate", content=orjson.dumps(_body(i, n, stream)),
                                headers={"content-type": "application/json"})
                if stream:
                    events = [e[6:] for e in r.content.split(b"\n\n") if e.startswith(b"data: ")]
                    final = orjson.loads(events[-2]) if r.status_code == 200 and len(events) > 1 else {}
                    results[f"c{i}"] = (r.status_code, final.get("output_ids") if "meta_info" in final else None)
                else:
                    results[f"c{i}"] = (r.status_code, r.json().get("output_ids"))
        finally:
            done.release()

    try:
        with ThreadPoolExecutor(12) as pool:
            for plan in plans:
                pool.submit(run, plan)
            for _ in range(N // 2):
                done.acquire()
            p1.stop()  # a prefill worker dies mid-run
        records = fe.take(N)
        by_id = {r["public_id"]: r for r in records}
        assert sorted(by_id) == sorted(f"c{i}" for i in range(N))  # one record per request
        failed = 0
        for i, stream, hang_up, n, _ in plans:
            rec = by_id[f"c{i}"]
            if hang_up:
                assert rec["status"] in ("client_disconnect", "ok")
                continue
            status, ids = results[f"c{i}"]
            if rec["status"] != "ok":  # only around the kill: an in-band or unary engine error
                failed += 1
                assert rec["status"] == "engine_error", rec
                continue
            assert status == 200 and ids == want[(i % 7, n)], (i, status, ids)
            assert rec["output_tokens"] == len(ids)
            assert [a["role"] for a in rec["attempts"]][-2:] == ["prefill", "decode"]
        assert failed <= 12
        for rec in records:
            assert all(a.get("outcome") != "aborted" or a.get("abort_acked") is True for a in rec["attempts"]
                       if a["worker_id"] != "w0"), rec  # w0 is the killed prefill
        _clean(p2, d1, d2)
        assert stats(d1)["rooms_waiting"] == stats(d2)["rooms_waiting"] == 0
        assert httpx.get(fe.url + "/v1/models", timeout=5).json()["workers"][0]["state"] == "down"
    finally:
        client.close()
        fe.stop()
        for s in (p1, p2, d1, d2, agg):
            s.stop()


def _body(i: int, n: int, stream: bool) -> dict:
    return {"input_ids": [11 + i % 7, 20, 30, 400], "rid": f"c{i}", "stream": stream,
            "sampling_params": {"max_new_tokens": n}}
