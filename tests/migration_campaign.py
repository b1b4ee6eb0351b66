"""The migration SIGKILL campaign, shared by the scaled-down test
(``tests/campaigns/test_migration_campaign.py``) and the full run
(``bench/bench_migration_campaign.py``).

Per protocol, three simulators with timing on (TTFT, ITL) serve one traced
frontend; ``streams`` requests (SGLang and vLLM, unary and SSE, some with
logprobs, budgets 12 to 40 tokens) run at ``concurrency`` while ``kills``
times a random live simulator is SIGKILLed at a random moment and restarted
on its port a little later. The frontend has ``--tokenizer``, so SGLang's
``text`` is exact across a seam that splits a character. Every answer must be exactly the uninterrupted
answer (a timing-free simulator, asked directly, is the oracle), every
request must leave exactly one record (status ok, its output tokens, its
attempts adding up), and at the end no simulator may be running anything.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import httpx
import orjson

from support import Proc, start_frontend, start_sim, stats, without_timing, trace_records

from asgi_generate.assets import TOKENIZER_PATH

PATH = {"sglang": "/generate", "vllm": "/inference/v1/generate"}


@dataclass
class Outcome:
    """What a campaign saw."""

    requests: int = 0
    migrations: int = 0
    replays: int = 0
    kills: list[tuple[float, int]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _request(protocol: str, i: int, rng: random.Random) -> tuple[dict, dict]:
    stream = rng.random() < 0.6
    budget = rng.randint(12, 40)
    prompt = [50 + i % 1000, 7 + i % 13, 300 + i % 17]
    rid = f"k{protocol[0]}{i}"
    logprobs = rng.random() < 0.4
    if protocol == "sglang":
        body = {"input_ids": prompt, "stream": stream, "rid": rid,
                "sampling_params": {"max_new_tokens": budget, "ignore_eos": True}}
        if logprobs:
            body.update(return_logprob=True, top_logprobs_num=2)
        return body, {}
    sp = {"max_tokens": budget, "ignore_eos": True}
    if logprobs:
        sp["logprobs"] = 2
    body = {"token_ids": prompt, "stream": stream, "sampling_params": sp}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body, {"x-request-id": rid, "content-type": "application/json"}


def _normal(protocol: str, status: int, payloads: list[bytes]) -> list:
    """An answer's values, ids and timing left out."""
    out: list = [status]
    for p in payloads:
        if p == b"[DONE]":
            out.append(p)
            continue
        v = without_timing(orjson.loads(p))
        if protocol == "sglang" and isinstance(v.get("meta_info"), dict):
            v["meta_info"].pop("id", None)
        else:
            v.pop("request_id", None)
            v.pop("created", None)
        out.append(v)
    return out


async def _ask(client: httpx.AsyncClient, url: str, protocol: str, body: dict, headers: dict) -> list:
    if not body["stream"]:
        resp = await client.post(url + PATH[protocol], content=orjson.dumps(body), headers=headers)
        return _normal(protocol, resp.status_code, [resp.content])
    payloads = []
    async with client.stream("POST", url + PATH[protocol], content=orjson.dumps(body), headers=headers) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                payloads.append(line[6:].encode())
        return _normal(protocol, resp.status_code, payloads)


def _records(base: str) -> dict[str, dict]:
    return {rec.get("public_id"): rec for rec in trace_records(base + ".*.jsonl")}


def _tokens(protocol: str, answer: list) -> int:
    """Output tokens of an answer (SGLang cumulative: the last chunk's)."""
    last = [v for v in answer[1:] if isinstance(v, dict)][-1]
    if protocol == "sglang":
        return len(last["output_ids"])
    chunks = [v for v in answer[1:] if isinstance(v, dict) and v.get("choices")]
    return sum(len(c["choices"][0]["token_ids"]) for c in chunks)


def run(protocol: str, streams: int, kills: int, tmp, *, concurrency: int = 32, seed: int = 1,
        ttft_ms: float = 5, itl_ms: float = 5, worker_class: str = "asyncio") -> Outcome:
    """Run the campaign for ``protocol``; see the module docstring."""
    rng = random.Random(seed)
    plan = [_request(protocol, i, rng) for i in range(streams)]
    out = Outcome(requests=streams)
    oracle = start_sim(protocol)
    try:
        with httpx.Client(timeout=30) as c:
            expected = {}
            for body, headers in plan:
                rid = body.get("rid") or headers["x-request-id"]
                if body["stream"]:
                    with c.stream("POST", oracle.url + PATH[protocol], content=orjson.dumps(body),
                                  headers=headers) as resp:
                        payloads = [ln[6:].encode() for ln in resp.iter_lines() if ln.startswith("data: ")]
                        expected[rid] = _normal(protocol, resp.status_code, payloads)
                else:
                    resp = c.post(oracle.url + PATH[protocol], content=orjson.dumps(body), headers=headers)
                    expected[rid] = _normal(protocol, resp.status_code, [resp.content])
    finally:
        oracle.stop()

    sims: list[Proc] = [start_sim(protocol, ttft_ms=ttft_ms, itl_ms=itl_ms) for _ in range(3)]
    base = str(tmp / f"campaign-{protocol}")
    fe = None
    got: dict[str, list] = {}
    try:
        fe = start_frontend([f"{protocol}={s.url}" for s in sims], worker_class=worker_class,
                            extra=["--trace-file", base + ".jsonl", "--sse-keepalive", "0",
                                   "--tokenizer", str(TOKENIZER_PATH)])
        t0 = time.monotonic()

        async def killer(duration: float) -> None:
            for _ in range(kills):
                await anyio.sleep(rng.uniform(0.1, duration / kills))
                victim = rng.randrange(3)
                sims[victim].proc.send_signal(signal.SIGKILL)
                out.kills.append((round(time.monotonic() - t0, 3), victim))
                await anyio.sleep(rng.uniform(0.2, 0.6))
                old = sims[victim]
                await anyio.to_thread.run_sync(old.stop)
                sims[victim] = await anyio.to_thread.run_sync(
                    lambda: start_sim(protocol, ttft_ms=ttft_ms, itl_ms=itl_ms, port=old.port))

        async def main() -> None:
            queue = list(plan)
            limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:

                async def worker() -> None:
                    while queue:
                        body, headers = queue.pop()
                        rid = body.get("rid") or headers["x-request-id"]
                        got[rid] = await _ask(client, fe.url, protocol, body, headers)

                # Expected run time: the requests' tokens at the ITL, spread over the connections.
                duration = max(1.0, streams * 26 * itl_ms / 1000 / concurrency)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(killer, duration)
                    for _ in range(concurrency):
                        tg.start_soon(worker)

        anyio.run(main)
        out.seconds = time.monotonic() - t0
        recs = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(recs) < streams:
            recs = _records(base)
            time.sleep(0.1)
        running = [stats(s)["running"] for s in sims]
    finally:
        if fe is not None:
            fe.stop()
        for s in sims:
            s.stop()

    for rid, want in expected.items():
        if want[0] != 200:
            out.mismatches.append(f"{rid}: the oracle answered {want}")
            continue
        have = got.get(rid)
        if have != want:
            at = next((k for k, (a, b) in enumerate(zip(have or [], want)) if a != b), None)
            out.mismatches.append(f"{rid}: answer differs ({len(have or [])} vs {len(want)} parts) at {at}: "
                                  f"{str(have[at] if at is not None else have)[:600]} != "
                                  f"{str(want[at] if at is not None else want)[:600]}; "
                                  f"record {recs.get(rid)}")
            continue
        rec = recs.get(rid)
        if rec is None:
            out.mismatches.append(f"{rid}: no record")
            continue
        roles = [a["role"] for a in rec["attempts"]]
        n = _tokens(protocol, want)
        checks = (rec["status"] == "ok", rec["output_tokens"] == n,
                  rec.get("migrations", 0) == roles.count("resumed"), rec.get("replays", 0) == roles.count("replayed"),
                  sum(a.get("tokens", 0) for a in rec["attempts"]) == n,
                  rec["attempts"][-1]["outcome"] == "finished")
        if not all(checks):
            out.mismatches.append(f"{rid}: record {checks}: {rec}")
        out.migrations += rec.get("migrations", 0)
        out.replays += rec.get("replays", 0)
    if len(recs) != streams:
        out.mismatches.append(f"{len(recs)} records for {streams} requests")
    if any(running):
        out.mismatches.append(f"simulators still running jobs: {running}")
    return out
