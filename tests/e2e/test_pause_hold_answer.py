"""A stream held across a fleet pause is one uninterrupted answer
(codecs/vllm/asgi_generate_vllm/codec.py, codecs/sglang/asgi_generate_sglang/
codec.py, request/generation.py): the client never sees the engine's abort
of the held leg, whatever the vLLM build sends when it aborts (a
finish-only chunk from 0.32, the aborting chunk with the tokens not sent
yet, or no usage chunk at all) and whether or not the client asked for
usage, nor SGLang's aborting chunk that carries the tokens a stream
interval held back; a stream that is not held still ends with the engine's
abort (vLLM's then its usage chunk when asked)."""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest

from support import generating, post, sampled, sse, start_frontend, start_sim, trace_records, wait_until

pytestmark = pytest.mark.e2e

N = 60
PATH = "/inference/v1/generate"
#: (client's stream_options, resumes after the pause): every stream runs at once through one pause.
STREAMS = [
    (None, True),
    ({"include_usage": True}, True),
    ({"include_usage": True, "continuous_usage_stats": True}, True),
    (None, False),
    ({"include_usage": True}, False),
]
#: Simulated vLLM builds: (engine version, stream interval, sends a usage chunk).
#: 0.33 sends a finish-only chunk for an abort; a long stream interval makes the
#: aborting chunk carry the tokens not sent yet (before 0.32 that is the only
#: aborting chunk there is); the last build sends no usage chunk.
BUILDS = [("0.33.0", 1, True), ("0.33.0", 500, True), ("0.27.0", 500, True), ("0.33.0", 1, False)]


@pytest.fixture(scope="module", params=[(w, b) for w in ("trio", "asyncio") for b in BUILDS],
                ids=lambda p: f"{p[0]}-{p[1][0]}-{p[1][1]}{'' if p[1][2] else '-nousage'}")
def fleet(request, tmp_path_factory):
    worker_class, (version, interval, usage_chunk) = request.param
    extra = ["--engine-version", version, "--stream-interval", str(interval)]
    sim = start_sim("vllm", itl_ms=15, extra=extra + ([] if usage_chunk else ["--no-usage-chunk"]))
    base = str(tmp_path_factory.mktemp("hold") / "t")
    try:
        fe = start_frontend([f"vllm={sim.url}"], worker_class=worker_class,
                            extra=["--resume-after-pause", "--trace-file", base + ".jsonl",
                                   "--pause-hold-timeout", "10"])
    except BaseException:
        sim.stop()
        raise
    yield sim, fe, base, usage_chunk
    fe.stop()
    sim.stop()


def _objs(chunks: list[bytes]) -> list[dict]:
    assert chunks[-1] == b"[DONE]", chunks[-1:]
    return [orjson.loads(c) for c in chunks[:-1]]


def test_a_held_stream_shows_no_abort_and_an_unheld_one_ends_with_it(fleet):
    sim, fe, base, usage_chunk = fleet
    old = httpx.get(fe.url + "/v1/models").json()["workers"][0]["weight_version"]
    new = f"{old}-next"
    tag = f"hold-{old}"
    prompts = [[200 + i, 7, 8] for i in range(len(STREAMS))]
    out: list = [None] * len(STREAMS)

    def one(i: int) -> None:
        options, resumes = STREAMS[i]
        body = {"request_id": f"{tag}-{i}", "token_ids": prompts[i], "stream": True,
                "sampling_params": {"max_tokens": N, "ignore_eos": True}}
        if options is not None:
            body["stream_options"] = options
        out[i] = sse(fe.url, body, PATH, headers={} if resumes else {"asgi-generate-resume-after-pause": "0"})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(STREAMS))]
    for t in threads:
        t.start()
    generating(sim, running=len(STREAMS), tokens=2)
    assert post(fe.url, {}, "/pause?mode=abort").status_code == 200
    assert post(fe.url, {"weight_version": new}, "/finish_weight_update").status_code == 200
    assert post(fe.url, {}, "/resume").status_code == 200
    for t in threads:
        t.join(30)
    wait_until(lambda: len([r for r in trace_records(base + ".*.jsonl")
                            if r.get("public_id", "").startswith(tag)]) == len(STREAMS))
    records = {r["public_id"]: r for r in trace_records(base + ".*.jsonl")}
    for i, ((options, resumes), (status, chunks)) in enumerate(zip(STREAMS, out)):
        assert status == 200
        objs = _objs(chunks)
        with_choices = [o for o in objs if o["choices"]]
        ids = [t for o in with_choices for t in o["choices"][0]["token_ids"]]
        finishes = [o["choices"][0]["finish_reason"] for o in with_choices]
        rec = records[f"{tag}-{i}"]
        wants_usage = options is not None and usage_chunk
        if resumes:
            # One answer: its only finish reason is the last chunk's, after every token.
            assert [f for f in finishes if f is not None] == ["length"] and finishes[-1] == "length"
            assert rec["pause_resumes"] == 1
            (first, k), (second, rest) = [(s["weight_version"], s["tokens"]) for s in rec["segments"]]
            assert (first, second) == (old, new) and k + rest == N and 0 < k < N
            assert ids[:k] == sampled(prompts[i], 0, k, True, version=old)
            assert ids[k:] == sampled(prompts[i] + ids[:k], 0, N - k, True, version=new)
            total = N
        else:
            assert [f for f in finishes if f is not None] == ["abort"] and finishes[-1] == "abort"
            assert "pause_resumes" not in rec and rec["finish"]["finish_reason"] == "abort"
            assert 0 < len(ids) < N and ids == sampled(prompts[i], 0, len(ids), True, version=old)
            total = len(ids)
        usage = [o for o in objs if not o["choices"]]
        if wants_usage:  # the closing usage chunk, last, counting the whole answer
            assert usage == [objs[-1]]
            assert (usage[0]["usage"]["prompt_tokens"], usage[0]["usage"]["completion_tokens"]) == (3, total)
        else:
            assert usage == []
        if options is not None and options.get("continuous_usage_stats"):
            # Continuous usage counts the whole answer so far, across the pause.
            assert with_choices[-1]["usage"]["completion_tokens"] == N


@pytest.fixture(scope="module", params=[(w, inc) for w in ("trio", "asyncio") for inc in (False, True)],
                ids=lambda p: f"{p[0]}-{'incremental' if p[1] else 'cumulative'}")
def sglang(request, tmp_path_factory):
    worker_class, incremental = request.param
    # A stream interval past the answer: SGLang's aborting chunk carries every token.
    sim = start_sim("sglang", itl_ms=15, incremental=incremental, extra=["--stream-interval", "500"])
    base = str(tmp_path_factory.mktemp("hold") / "t")
    try:
        fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class,
                            extra=["--resume-after-pause", "--trace-file", base + ".jsonl",
                                   "--pause-hold-timeout", "10"])
    except BaseException:
        sim.stop()
        raise
    yield sim, fe, base, incremental
    fe.stop()
    sim.stop()


def test_a_held_sglang_stream_shows_no_abort_and_an_unheld_one_ends_with_it(sglang):
    sim, fe, base, incremental = sglang
    old = httpx.get(fe.url + "/v1/models").json()["workers"][0]["weight_version"]
    new = f"{old}-next"
    tag = f"sg-{old}"
    resumes = [True, True, False]
    prompts = [[300 + i, 7, 8] for i in range(len(resumes))]
    out: list = [None] * len(resumes)

    def one(i: int) -> None:
        body = {"rid": f"{tag}-{i}", "input_ids": prompts[i], "stream": True,
                "sampling_params": {"max_new_tokens": N, "ignore_eos": True}}
        out[i] = sse(fe.url, body, headers={} if resumes[i] else {"asgi-generate-resume-after-pause": "0"})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(resumes))]
    for t in threads:
        t.start()
    generating(sim, running=len(resumes), tokens=2)
    assert post(fe.url, {"mode": "abort"}, "/pause_generation").status_code == 200
    r = post(fe.url, {"model_path": "/ckpt", "weight_version": new}, "/update_weights_from_disk")
    assert r.status_code == 200, r.text
    assert post(fe.url, {}, "/continue_generation").status_code == 200
    for t in threads:
        t.join(30)
    wait_until(lambda: len([r for r in trace_records(base + ".*.jsonl")
                            if r.get("public_id", "").startswith(tag)]) == len(resumes))
    records = {r["public_id"]: r for r in trace_records(base + ".*.jsonl")}
    for i, (status, chunks) in enumerate(out):
        assert status == 200
        objs = _objs(chunks)
        finishes = [o["meta_info"]["finish_reason"] for o in objs]
        ids = [t for o in objs for t in o["output_ids"]] if incremental else objs[-1]["output_ids"]
        rec = records[f"{tag}-{i}"]
        if resumes[i]:
            assert [f for f in finishes if f is not None] == [{"type": "length", "length": N}]
            assert finishes[-1] is not None and "e2e_latency" not in objs[-2]["meta_info"]
            (first, k), (second, rest) = [(s["weight_version"], s["tokens"]) for s in rec["segments"]]
            assert (first, second) == (old, new) and k + rest == N and 0 < k < N
            assert ids[:k] == sampled(prompts[i], 0, k, True, version=old)
            assert ids[k:] == sampled(prompts[i] + ids[:k], 0, N - k, True, version=new)
        else:
            assert [f["type"] for f in finishes if f is not None] == ["abort"] and finishes[-1] is not None
            assert 0 < len(ids) < N and ids == sampled(prompts[i], 0, len(ids), True, version=old)
