"""The mixed campaign: N requests through a real hypercorn frontend and two
simulator processes (unary and SSE, logprobs and sessions on and off, client
disconnects at every stage, bad inputs, several tokens per event, one worker
killed mid-run). The trace must then validate, hold exactly one record per
request, and each record's output_tokens must equal what that client
received. The simulators start every answer with a thought and a tool call
(``sim --emit-markers``), so each completed record's reasoning length and
tool calls are real, known values."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import httpx
import orjson
import pytest

from asgi_generate.assets import TOKENIZER_PATH
from support import campaign_size, raw_request, sse_then_hang_up, start_frontend, start_sim, tokens_in

pytestmark = pytest.mark.e2e

#: What it catches, a request of some kind and outcome without exactly one
#: record or with a record whose output_tokens is not what its client got:
#: 100 is the smallest plan of this seed with every kind, every bad input
#: (both reported in-band) and a worker killed mid-run; 500 under bench/.
N = campaign_size(100, 500)
SYSTEM_PROMPTS = [list(range(100 + 200 * i, 228 + 200 * i)) for i in range(3)]
BAD_STATUS = {"json": 400, "empty": 400, "method": 405, "too_large": 413, "n": 400}
#: Bad values SGLang reports inside a stream, after its 200.
IN_BAND = ("empty", "n")
#: ``sim --emit-markers``: ``</think>`` is output token 6, ``</tool_call>`` token 24.
THINK_END, TOOL_CALL_END = 6, 24


def expected_analysis(tokens: int) -> tuple[int, list[dict]]:
    """Reasoning tokens and tool calls of an answer of ``tokens`` tokens:
    the script's first ``tokens`` (qwen3: all reasoning until ``</think>``)."""
    calls = [{"index": 0, "name": "get_weather"}] if tokens >= TOOL_CALL_END else []
    return min(tokens, THINK_END), calls


def unary_then_hang_up(url: str, payload: bytes, headers: dict, delay: float) -> int:
    """Hang up ``delay`` seconds into a unary request (before its answer):
    the client received no tokens."""
    sock = raw_request(url, payload, headers)
    time.sleep(delay)
    sock.close()
    return 0


def plan(i: int, rng: random.Random) -> dict:
    """Request ``i`` of the campaign: what to send and how to behave."""
    key = f"c{i:04d}"
    kind = rng.choices(["ok", "bad", "sse_cut", "unary_cut"], [80, 10, 7, 3])[0]
    ids = rng.choice(SYSTEM_PROMPTS) + [rng.randrange(300, 4000) for _ in range(rng.randrange(0, 200))]
    max_new = 30 if rng.random() < 0.3 else rng.randrange(1, 9)
    body = {"rid": key, "input_ids": ids, "stream": rng.random() < 0.5,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": rng.random() < 0.7,
                                "stream_interval": rng.choice([1, 1, 2, 3])}}
    if rng.random() < 0.5:
        body["return_logprob"] = True
        body["top_logprobs_num"] = rng.randrange(0, 3)
    headers = {"x-request-id": key}
    if rng.random() < 0.5:
        headers["x-session-id"] = f"sess-{i % 37}"
        if rng.random() < 0.5:
            headers["x-session-final"] = "1"
    p = {"key": key, "kind": kind, "headers": headers, "body": body}
    if kind == "bad":
        p["bad"] = rng.choice(["json", "empty", "method", "too_large", "n"])
    elif kind == "sse_cut":
        p["k"] = rng.randrange(0, 4)
        body["stream"] = True
        body["sampling_params"] = {"max_new_tokens": 40, "ignore_eos": True, "stream_interval": rng.choice([1, 3])}
    elif kind == "unary_cut":
        body["stream"] = False
        body["sampling_params"] = {"max_new_tokens": 60, "ignore_eos": True}
    return p


def run(url: str, p: dict) -> dict:
    """Send request ``p``; return what the client saw."""
    body, headers, kind = p["body"], p["headers"], p["kind"]
    if kind == "sse_cut":
        return {"tokens": sse_then_hang_up(url, orjson.dumps(body), headers, p["k"])}
    if kind == "unary_cut":
        return {"tokens": unary_then_hang_up(url, orjson.dumps(body), headers, 0.2)}
    if kind == "bad":
        bad = p["bad"]
        if bad == "method":
            r = httpx.get(url + "/generate", headers=headers, timeout=30)
        else:
            content = {
                "json": b'{"input_ids": [1, 2',
                "empty": orjson.dumps({**body, "input_ids": []}),
                "too_large": orjson.dumps({**body, "input_ids": [7] * 40000}),
                "n": orjson.dumps({**body, "sampling_params": {"n": 0}}),
            }[bad]
            r = httpx.post(url + "/generate", content=content, headers=headers, timeout=30)
        return {"status": r.status_code, "tokens": 0}
    if body["stream"]:
        with httpx.stream("POST", url + "/generate", content=orjson.dumps(body), headers=headers,
                          timeout=30) as r:
            raw = b"".join(r.iter_bytes())
        return {"status": r.status_code, "tokens": tokens_in(raw) if r.status_code == 200 else 0}
    r = httpx.post(url + "/generate", content=orjson.dumps(body), headers=headers, timeout=30)
    return {"status": r.status_code, "tokens": len(r.json().get("output_ids", [])) if r.status_code == 200 else 0}


@pytest.mark.timeout(240)
def test_mixed_campaign(tmp_path):
    rng = random.Random(20240603)
    plans = [plan(i, rng) for i in range(N)]
    assert {p["kind"] for p in plans} == {"ok", "bad", "sse_cut", "unary_cut"}
    assert {p["bad"] for p in plans if p["kind"] == "bad"} == {*BAD_STATUS}
    assert {p["bad"] for p in plans if p["kind"] == "bad" and p["body"]["stream"]} >= {*IN_BAND}
    seen: dict[str, dict] = {}
    sims = [start_sim(ttft_ms=100, itl_ms=60, extra=["--emit-markers"])]
    fe = None
    try:
        sims.append(start_sim(ttft_ms=100, itl_ms=60, extra=["--emit-markers"]))
        fe = start_frontend(
            [f"sglang={s.url}" for s in sims],
            extra=["--trace-file", str(tmp_path / "campaign.jsonl"), "--max-body-bytes", "65536",
                   "--tokenizer", str(TOKENIZER_PATH), "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"],
        )
        with ThreadPoolExecutor(max_workers=24) as pool:
            futures = {pool.submit(run, fe.url, p): p["key"] for p in plans}
            for done, future in enumerate(as_completed(futures), 1):
                seen[futures[future]] = future.result()
                if done == N // 2:
                    sims[1].proc.kill()  # one worker dies mid-run
        trace_stats = httpx.get(fe.url + "/stats", timeout=10).json()["trace"]
    finally:
        if fe is not None:
            fe.stop()
        for s in sims:
            s.stop()

    files = sorted(tmp_path.glob("campaign.*.jsonl"))
    check = subprocess.run([sys.executable, "-m", "asgi_generate.tracing.offline.tools", "validate", *map(str, files)],
                           capture_output=True, text=True, timeout=60)
    assert (check.returncode, check.stdout) == (0, f"VALID: {N} records\n")
    assert trace_stats["dropped"] == {"queue_full": 0, "sink_error": 0, "build_error": 0, "closed": 0}

    records = [orjson.loads(line) for f in files for line in f.read_bytes().splitlines()]
    by_key: dict[str, list[dict]] = {}
    for rec in records:
        by_key.setdefault(rec.get("public_id") or rec["x_request_id"], []).append(rec)
    assert sorted(by_key) == sorted(p["key"] for p in plans)
    assert all(len(v) == 1 for v in by_key.values())
    wrong_method = [p for p in plans if p.get("bad") == "method"]
    assert [(r["method"], r["status"], r["http_status"]) for r in (by_key[p["key"]][0] for p in wrong_method)] == [
        ("GET", "rejected", 405)] * len(wrong_method)

    statuses: dict[str, int] = {}
    analysed = {False: 0, True: 0}  # completed records without / with a tool call
    for p in plans:
        if p in wrong_method:
            continue
        rec, got = by_key[p["key"]][0], seen[p["key"]]
        statuses[rec["status"]] = statuses.get(rec["status"], 0) + 1
        assert rec["output_tokens"] == got["tokens"], (p, rec, got)
        if p["kind"] == "bad":
            in_band = p["body"]["stream"] and p["bad"] in IN_BAND
            assert (rec["status"], rec["http_status"]) == ("rejected", 200 if in_band else BAD_STATUS[p["bad"]])
            assert got["status"] == rec["http_status"]
            continue
        assert rec.get("stream", p["body"]["stream"]) == p["body"]["stream"]  # absent if cut before the body
        assert ("session" in rec) == ("x-session-id" in p["headers"])
        if p["kind"] == "ok":
            assert rec["http_status"] == got["status"]
            if rec["status"] == "ok":
                reasoning, calls = expected_analysis(got["tokens"])
                assert (rec["reasoning_tokens"], rec["finish"]["tool_calls"]) == (reasoning, calls), (p, rec)
                analysed[bool(calls)] += 1
            else:  # on the worker that was killed
                assert rec["status"] in ("engine_error", "unavailable")
                assert {"worker_lost", "connect_failed"} & {a["outcome"] for a in rec["attempts"]}
        else:
            assert rec["status"] in ("client_disconnect", "engine_error")
    assert statuses["ok"] > N // 2
    # Shares of the plan (at 500: over 30 and 100 analysed, 20 disconnects).
    assert analysed[True] > N * 6 // 100 and analysed[False] > N // 5, analysed
    assert statuses["client_disconnect"] > N // 25
