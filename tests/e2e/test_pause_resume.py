"""Rollouts that survive a pause (asgi_generate/request/generation.py,
workers/pauses.py): a stream the engine aborted for a fleet pause is held and
resumed after the fleet's resume on the new weights, its segments in the
record; without the opt-in it ends with the engine's abort; held streams are
bounded; vLLM's wait mode waits."""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest

from support import (generating, held_fleet, post, sampled, start_frontend, start_streams, stream_answer, start_sim,
                     stats, trace_records, wait_until)

pytestmark = pytest.mark.e2e

N = 100
PROMPTS = [[100 + i, 7, 8] for i in range(3)]


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fleet(request, tmp_path_factory):
    with held_fleet(request.param, tmp_path_factory.mktemp("pause")) as got:
        yield got


def _body(protocol: str, prompt: list[int], rid: str) -> tuple[str, dict]:
    if protocol == "sglang":
        return "/generate", {"rid": rid, "input_ids": prompt, "stream": True,
                             "sampling_params": {"max_new_tokens": N, "ignore_eos": True}}
    return "/inference/v1/generate", {"request_id": rid, "token_ids": prompt, "stream": True,
                                      "sampling_params": {"max_tokens": N, "ignore_eos": True}}


def _ids(protocol: str, chunks: list[bytes]) -> tuple[list[int], object, object]:
    """Output ids, finish reason and (SGLang) the last chunk's weight version."""
    ids, finish = stream_answer(protocol, chunks)
    last = next(c for c in reversed(chunks) if c != b"[DONE]")
    version = orjson.loads(last)["meta_info"]["weight_version"] if protocol == "sglang" else None
    return ids, finish, version


def _run(fe, protocol: str, tag: str, headers: dict | None = None) -> tuple[list[threading.Thread], list]:
    return start_streams(fe.url, [_body(protocol, p, f"{tag}-{i}") for i, p in enumerate(PROMPTS)], headers)


def _cycle(sims, fe, protocol: str, version: str) -> None:
    """Pause with abort, load ``version``, resume: what a trainer does."""
    sim = sims[0] if protocol == "sglang" else sims[1]
    generating(sim, running=len(PROMPTS))  # some tokens out
    if protocol == "sglang":
        assert post(fe.url, {"mode": "abort"}, "/pause_generation").status_code == 200
        r = post(fe.url, {"model_path": "/ckpt", "weight_version": version}, "/update_weights_from_disk")
        assert r.status_code == 200, r.text
        assert post(fe.url, {}, "/continue_generation").status_code == 200
    else:
        assert post(fe.url, {}, "/pause?mode=abort").status_code == 200
        assert post(fe.url, {"weight_version": version}, "/finish_weight_update").status_code == 200
        assert post(fe.url, {}, "/resume").status_code == 200


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_streams_resume_after_a_pause_on_the_new_weights(fleet, protocol):
    sims, fe, base = fleet
    before = httpx.get(fe.url + "/v1/models").json()["workers"]
    old = next(w["weight_version"] for w in before if w["protocol"] == protocol)
    version = f"{protocol}-{old}-next"
    threads, out = _run(fe, protocol, f"held-{protocol}-{old}")
    _cycle(sims, fe, protocol, version)
    for t in threads:
        t.join(30)
    wait_until(lambda: len([r for r in trace_records(base + ".*.jsonl")
                            if r.get("public_id", "").startswith(f"held-{protocol}-{old}")]) == len(PROMPTS))
    records = {r["public_id"]: r for r in trace_records(base + ".*.jsonl")}
    for i, (status, chunks) in enumerate(out):
        assert status == 200
        ids, finish, meta_version = _ids(protocol, chunks)
        assert len(ids) == N and finish in ("length", {"type": "length", "length": N})
        rec = records[f"held-{protocol}-{old}-{i}"]
        assert rec["pause_resumes"] == 1
        (first, k), (second, rest) = [(s["weight_version"], s["tokens"]) for s in rec["segments"]]
        assert (first, second) == (old, version) and k + rest == N and 0 < k < N
        assert ids[:k] == sampled(PROMPTS[i], 0, k, True, version=old)
        assert ids[k:] == sampled(PROMPTS[i] + ids[:k], 0, N - k, True, version=version)
        if protocol == "sglang":
            assert meta_version == version
    assert httpx.get(fe.url + "/stats").json()["pauses"]["resumed"] >= len(PROMPTS)


def test_without_the_opt_in_a_pause_ends_the_stream_with_the_abort(fleet):
    sims, fe, _ = fleet
    threads, out = _run(fe, "sglang", "plain", {"asgi-generate-resume-after-pause": "0"})
    generating(sims[0], running=len(PROMPTS))
    assert post(fe.url, {"mode": "abort"}, "/pause_generation").status_code == 200
    for t in threads:
        t.join(30)
    assert post(fe.url, {}, "/continue_generation").status_code == 200
    for status, chunks in out:
        ids, finish, _ = _ids("sglang", chunks)
        assert status == 200 and finish["type"] == "abort" and len(ids) < N


def test_held_streams_past_their_time_end_with_503(tmp_path):
    sim = start_sim("vllm", itl_ms=15)
    fe = start_frontend([f"vllm={sim.url}"], extra=["--resume-after-pause", "--pause-hold-timeout", "0.3"])
    try:
        threads, out = _run(fe, "vllm", "late")
        wait_until(lambda: stats(sim)["running"] == len(PROMPTS))
        assert post(fe.url, {}, "/pause?mode=abort").status_code == 200
        for t in threads:
            t.join(30)
        for status, chunks in out:
            assert status == 200 and b"pause_hold_timeout" in chunks[-2 if chunks[-1] == b"[DONE]" else -1]
        assert httpx.get(fe.url + "/stats").json()["pauses"]["expired"] == len(PROMPTS)
        post(fe.url, {}, "/resume")
    finally:
        fe.stop()
        sim.stop()


def test_vllm_wait_mode_answers_once_streams_finished(fleet):
    sims, fe, _ = fleet
    threads, out = _run(fe, "vllm", "waited")
    wait_until(lambda: stats(sims[1])["running"] == len(PROMPTS))
    r = post(fe.url, {}, "/pause?mode=wait")
    assert r.status_code == 200
    assert stats(sims[1])["running"] == 0
    assert post(fe.url, {}, "/resume").status_code == 200
    for t in threads:
        t.join(30)
    for status, chunks in out:
        assert status == 200 and len(_ids("vllm", chunks)[0]) == N
