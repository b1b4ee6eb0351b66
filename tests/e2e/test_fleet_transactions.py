"""Fleet transactions that abort running requests, and the weight versions
the engines report (asgi_generate/workers/pauses.py, ops/weights.py,
request/generation.py, tracing/record.py).

A weight call that aborts without pausing (SGLang ``/update_weight_version``,
whose ``abort_all_requests`` is true by default, or an ``update_weights_from_*``
with it set) holds the streams it aborted until it was answered, then resumes
them exactly on the new weights. Segments and attempts carry the versions
the engine reported for the tokens (SGLang ``meta_info.weight_version`` per
chunk, vLLM ``weight_versions`` on the finished choice), also when the
version changed behind the frontend's back. A vLLM unary request held across
a pause is replayed from scratch and counted once. An engine abort not held
is recorded ``engine_abort``.
"""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest

from support import generating, held_fleet, post, sampled, start_streams, stream_answer, trace_records, wait_until

pytestmark = pytest.mark.e2e

N = 100
PROMPTS = [[200 + i, 7, 9] for i in range(3)]


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fleet(request, tmp_path_factory):
    with held_fleet(request.param, tmp_path_factory.mktemp("transactions")) as got:
        yield got


def _engine_version(sim, protocol: str) -> str:
    """The weight version the engine serves now, read from it."""
    path = "/get_model_info" if protocol == "sglang" else "/weight_info"
    return httpx.get(sim.url + path, timeout=5).json()["weight_version"]


def _body(protocol: str, prompt: list[int], rid: str, stream: bool = True) -> tuple[str, dict]:
    if protocol == "sglang":
        return "/generate", {"rid": rid, "input_ids": prompt, "stream": stream,
                             "sampling_params": {"max_new_tokens": N, "ignore_eos": True}}
    return "/inference/v1/generate", {"request_id": rid, "token_ids": prompt, "stream": stream,
                                      "sampling_params": {"max_tokens": N, "ignore_eos": True}}


def _streams(fe, protocol: str, tag: str, headers: dict | None = None) -> tuple[list[threading.Thread], list]:
    return start_streams(fe.url, [_body(protocol, p, f"{tag}-{i}") for i, p in enumerate(PROMPTS)], headers)


def _sglang_runs(chunks: list[bytes]) -> tuple[list[int], object, list[tuple[str, int]]]:
    """A cumulative SGLang stream's output ids, finish reason, and the
    ``(meta_info.weight_version, new tokens)`` runs its chunks showed."""
    runs: list[tuple[str, int]] = []
    seen, meta, ids = 0, {}, []
    for c in chunks:
        if c == b"[DONE]":
            continue
        obj = orjson.loads(c)
        ids, meta = obj["output_ids"], obj["meta_info"]
        new = len(ids) - seen
        seen = len(ids)
        if new:
            if runs and runs[-1][0] == meta["weight_version"]:
                runs[-1] = (runs[-1][0], runs[-1][1] + new)
            else:
                runs.append((meta["weight_version"], new))
    return ids, meta.get("finish_reason"), runs


def _records(base: str, tag: str, count: int) -> dict[str, dict]:
    def ready():
        got = {r["public_id"]: r for r in trace_records(base + ".*.jsonl") if r.get("public_id", "").startswith(tag)}
        return got if len(got) == count else None

    return wait_until(ready)


def _ended(threads: list[threading.Thread], base: str, tag: str) -> dict[str, dict]:
    """Wait for the streams' threads (bounded), then their records by public id."""
    for t in threads:
        t.join(30)
    return _records(base, tag, len(PROMPTS))


def _segments(rec: dict) -> list[tuple[str, int]]:
    return [(s["weight_version"], s["tokens"]) for s in rec["segments"]]


@pytest.mark.parametrize("route", ["/update_weight_version", "/update_weights_from_disk"])
def test_the_weight_routes_own_abort_is_held_and_resumed_exactly(fleet, route):
    sims, fe, base = fleet
    old = _engine_version(sims[0], "sglang")
    new = f"{old}-{route[1:]}"
    tag = f"route-{new}"
    threads, out = _streams(fe, "sglang", tag)
    generating(sims[0], running=len(PROMPTS), tokens=3)
    # /update_weight_version aborts every running request by default; a
    # weight load does when asked (SGLang io_struct.py abort_all_requests).
    body = {"new_version": new} if route == "/update_weight_version" else \
        {"model_path": "/ckpt", "weight_version": new, "abort_all_requests": True}
    r = post(fe.url, body, route)
    assert r.status_code == 200, r.text
    records = _ended(threads, base, tag)
    for i, (status, chunks) in enumerate(out):
        ids, finish, runs = _sglang_runs(chunks)
        assert status == 200 and finish == {"type": "length", "length": N}
        rec = records[f"{tag}-{i}"]
        assert (rec["status"], rec["output_tokens"], rec["pause_resumes"]) == ("ok", N, 1)
        (v0, k), (v1, rest) = _segments(rec)
        assert (v0, v1, k + rest) == (old, new, N) and 0 < k < N
        # The segments are what the client's chunks said, token for token.
        assert _segments(rec) == runs
        # Exact continuation: the first k tokens on the old weights, the rest
        # the new weights' continuation of prompt + those k.
        assert ids[:k] == sampled(PROMPTS[i], 0, k, True, version=old)
        assert ids[k:] == sampled(PROMPTS[i] + ids[:k], 0, N - k, True, version=new)
        # The engine's abort finish carries the token of the forward pass
        # the request was in (SGLang scheduler.py abort_request: to_finish),
        # stamped with the version in force when it is sent, the new one:
        # the first attempt made one token more than its segment shows.
        first, resumed = rec["attempts"]
        assert (first["role"], first["outcome"], first["tokens"], first["weight_version"]) == \
            ("aggregated", "aborted", k + 1, old)
        assert (resumed["role"], resumed["tokens"], resumed["weight_version"]) == ("resumed", N - k - 1, new)


def test_a_version_changed_behind_the_frontend_splits_the_segments_where_the_engine_said(fleet):
    sims, fe, base = fleet
    old = _engine_version(sims[0], "sglang")
    new = f"{old}-behind"
    tag = f"behind-{new}"
    threads, out = _streams(fe, "sglang", tag)
    generating(sims[0], running=len(PROMPTS), tokens=3)
    # Another replica's call: straight to the engine, no abort.
    r = post(sims[0].url, {"new_version": new, "abort_all_requests": False}, "/update_weight_version")
    assert r.status_code == 200, r.text
    records = _ended(threads, base, tag)
    for i, (status, chunks) in enumerate(out):
        ids, finish, runs = _sglang_runs(chunks)
        assert status == 200 and len(ids) == N and [v for v, _ in runs] == [old, new]
        rec = records[f"{tag}-{i}"]
        assert (rec["status"], rec["output_tokens"]) == ("ok", N) and "pause_resumes" not in rec
        assert _segments(rec) == runs
        (attempt,) = rec["attempts"]
        assert (attempt["tokens"], attempt["weight_version"]) == (N, old)


def test_a_pause_then_a_load_behind_the_frontend_records_the_versions_the_engine_sent(fleet):
    """The issue's second scenario: the client's chunks switch version at the
    resumed point, and so must the record, though this process never saw
    the load."""
    sims, fe, base = fleet
    old = _engine_version(sims[0], "sglang")
    new = f"{old}-paused"
    tag = f"paused-{new}"
    threads, out = _streams(fe, "sglang", tag)
    generating(sims[0], running=len(PROMPTS), tokens=3)
    assert post(fe.url, {"mode": "abort"}, "/pause_generation").status_code == 200
    r = post(sims[0].url, {"new_version": new, "abort_all_requests": False}, "/update_weight_version")
    assert r.status_code == 200, r.text
    assert post(fe.url, {}, "/continue_generation").status_code == 200
    records = _ended(threads, base, tag)
    for i, (status, chunks) in enumerate(out):
        ids, finish, runs = _sglang_runs(chunks)
        assert status == 200 and finish == {"type": "length", "length": N}
        rec = records[f"{tag}-{i}"]
        (v0, k), (v1, rest) = _segments(rec)
        assert (v0, v1, k + rest, rec["pause_resumes"]) == (old, new, N, 1)
        assert _segments(rec) == runs
        assert ids[k:] == sampled(PROMPTS[i] + ids[:k], 0, N - k, True, version=new)
        assert [a["weight_version"] for a in rec["attempts"]] == [old, new]


def test_vllm_segments_are_the_weight_versions_the_engine_reported(fleet):
    sims, fe, base = fleet
    old = _engine_version(sims[1], "vllm")
    new = f"{old}-v"
    tag = f"vspans-{new}"
    threads, out = _streams(fe, "vllm", tag)
    generating(sims[1], running=len(PROMPTS), tokens=3)
    assert post(fe.url, {}, "/pause?mode=abort").status_code == 200
    # The version set straight on the engine: the frontend's reading is stale.
    assert post(sims[1].url, {"new_version": new}, "/update_weight_version").status_code == 200
    assert post(fe.url, {}, "/resume").status_code == 200
    records = _ended(threads, base, tag)
    for i, (status, chunks) in enumerate(out):
        ids, finish = stream_answer("vllm", chunks)
        assert status == 200 and len(ids) == N and finish == "length"
        rec = records[f"{tag}-{i}"]
        (v0, k), (v1, rest) = _segments(rec)
        assert (v0, v1, k + rest, rec["pause_resumes"]) == (old, new, N, 1)
        assert ids[:k] == sampled(PROMPTS[i], 0, k, True, version=old)
        assert ids[k:] == sampled(PROMPTS[i] + ids[:k], 0, N - k, True, version=new)
        assert [(a["role"], a["weight_version"]) for a in rec["attempts"]] == [("aggregated", old), ("resumed", new)]
        # The client's finished choice says the same, over its whole answer.
        (last,) = [ch for c in chunks if c != b"[DONE]" for ch in orjson.loads(c).get("choices", [])
                   if ch.get("finish_reason") == "length"]
        assert last["weight_versions"] == [{"version": old, "start": 0, "end": k},
                                           {"version": new, "start": k, "end": N}]


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_unary_request_replayed_after_a_pause_counts_the_tokens_sent_exactly(fleet, protocol):
    sims, fe, base = fleet
    sim = sims[0] if protocol == "sglang" else sims[1]
    version = _engine_version(sim, protocol)
    tag = f"unary-{protocol}-{version}"
    out: list = [None] * len(PROMPTS)

    def one(i: int) -> None:
        path, body = _body(protocol, PROMPTS[i], f"{tag}-{i}", stream=False)
        out[i] = post(fe.url, body, path)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    generating(sim, running=len(PROMPTS), tokens=3)
    pause, resume = ("/pause_generation", "/continue_generation") if protocol == "sglang" else \
        ("/pause?mode=abort", "/resume")
    assert post(fe.url, {"mode": "abort"} if protocol == "sglang" else {}, pause).status_code == 200
    assert post(fe.url, {}, resume).status_code == 200
    records = _ended(threads, base, tag)
    for i, r in enumerate(out):
        assert r.status_code == 200, r.text
        got = r.json()["output_ids"] if protocol == "sglang" else r.json()["choices"][0]["token_ids"]
        # Replayed from scratch on the same weights: the uninterrupted answer.
        assert got == sampled(PROMPTS[i], 0, N, True, version=version)
        rec = records[f"{tag}-{i}"]
        assert (rec["status"], rec["output_tokens"], rec["replays"], rec["pause_resumes"]) == ("ok", N, 1, 1)
        first, replayed = rec["attempts"]
        assert (first["outcome"], "tokens" not in first) == ("aborted", True)
        assert (replayed["role"], replayed["tokens"]) == ("replayed", N)
        assert _segments(rec) == [(version, N)]


def test_a_weight_routes_abort_not_held_is_recorded_engine_abort(fleet):
    sims, fe, base = fleet
    old = _engine_version(sims[0], "sglang")
    new = f"{old}-unheld"
    tag = f"unheld-{new}"
    threads, out = _streams(fe, "sglang", tag, {"asgi-generate-resume-after-pause": "0"})
    generating(sims[0], running=len(PROMPTS), tokens=3)
    assert post(fe.url, {"new_version": new}, "/update_weight_version").status_code == 200
    records = _ended(threads, base, tag)
    for i, (status, chunks) in enumerate(out):
        ids, finish, runs = _sglang_runs(chunks)
        assert status == 200 and finish["type"] == "abort" and 0 < len(ids) < N
        rec = records[f"{tag}-{i}"]
        assert (rec["status"], rec["error"]["type"], rec["output_tokens"]) == ("engine_abort", "engine_abort", len(ids))
        assert rec["finish"]["backend_finish_reason"] == "abort" and "pause_resumes" not in rec
