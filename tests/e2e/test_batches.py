"""Batches and n > 1 through the frontend (asgi_generate/request/batches.py, the
SGLang batch codec, vLLM n choices): the answer equals the simulator's asked
directly, value for value (ids excepted where the engine mints them), on
both worker classes, unary and SSE, in one engine request or split over
workers; SGLang's own refusals; disconnects abort every item; one exact
trace record per item; /abort_request by rid prefix ends a batch's items."""

from __future__ import annotations

import re
import threading

import httpx
import orjson
import pytest

from asgi_generate.tracing.offline.validate import check_records
from support import (
    PROMPT,
    post,
    RawClient,
    sampled,
    sse,
    start_frontend,
    start_sim,
    stats,
    trace_records,
    wait_until,
    without_timing,
)

pytestmark = pytest.mark.e2e

HEX32 = re.compile(r"^[0-9a-f]{32}$")
VLLM = "/inference/v1/generate"
SG_BODIES = {
    "ids-rid-str": {"input_ids": [PROMPT, [5, 6, 7]], "rid": "r", "sampling_params": {"max_new_tokens": 4}},
    "text-rid-list-sp-list": {"text": ["hi", "ho", "hu"], "rid": ["a", "b", "c"],
                              "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 5}, {"max_new_tokens": 3}]},
    "n3-logprobs": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "n": 3},
                    "return_logprob": True, "top_logprobs_num": 2},
    "batch-n2": {"input_ids": [PROMPT, [9, 8, 7, 6]], "rid": ["x", "y"],
                 "sampling_params": {"max_new_tokens": 3, "n": 2}, "return_logprob": [True, False]},
}


@pytest.fixture(scope="module")
def sims():
    procs = [start_sim(), start_sim(), start_sim("vllm"), start_sim("vllm")]
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio", "split"])
def front(request, sims):
    split = request.param == "split"
    fe = start_frontend([f"sglang={s.url}" for s in sims[:2]] + [f"vllm={s.url}" for s in sims[2:]],
                        worker_class="asyncio" if split else request.param,
                        extra=["--split-batches"] if split else [])
    fe.split = split
    yield fe
    fe.stop()


def _ids_minted(body: dict) -> bool:
    sp = body["sampling_params"]
    return (sp if isinstance(sp, dict) else sp[0]).get("n", 1) > 1


def _strip_ids(answer: list) -> list:
    """``answer`` without SGLang's minted sample ids (checked to be 32-hex, unique)."""
    got = [a["meta_info"].pop("id") for a in answer]
    assert all(HEX32.match(i) for i in got) and len(set(got)) == len(got)
    return answer


def _by_index(events: list[bytes], minted: bool) -> dict[int, list]:
    assert events[-1] == b"[DONE]"
    out: dict[int, list] = {}
    ids: dict[int, str] = {}
    for e in events[:-1]:
        chunk = without_timing(orjson.loads(e))
        if minted:
            i = chunk["meta_info"].pop("id")
            assert HEX32.match(i) and ids.setdefault(chunk["index"], i) == i
        out.setdefault(chunk["index"], []).append(chunk)
    return out


@pytest.mark.parametrize("name", list(SG_BODIES))
def test_sglang_batch_unary_equals_the_engines(sims, front, name):
    body = SG_BODIES[name]
    got, direct = post(front.url, body), post(sims[0].url, body)
    assert (got.status_code, direct.status_code) == (200, 200)
    a, b = without_timing(got.json()), without_timing(direct.json())
    if _ids_minted(body):
        a, b = _strip_ids(a), _strip_ids(b)
    assert a == b
    assert len(a) == {"ids-rid-str": 2, "text-rid-list-sp-list": 3, "n3-logprobs": 3, "batch-n2": 4}[name]


@pytest.mark.parametrize("name", list(SG_BODIES))
def test_sglang_batch_sse_equals_the_engines(sims, front, name):
    body = {**SG_BODIES[name], "stream": True}
    (s1, got), (s2, direct) = sse(front.url, body), sse(sims[0].url, body)
    assert (s1, s2) == (200, 200)
    minted = _ids_minted(body)
    assert _by_index(got, minted) == _by_index(direct, minted)


def test_samples_differ_and_follow_the_model(sims, front):
    got = post(front.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "n": 3}}).json()
    assert [a["output_ids"] for a in got] == [sampled(PROMPT, s, 5) for s in range(3)]
    assert len({tuple(a["output_ids"]) for a in got}) == 3


def test_a_batch_is_one_engine_request_unless_split(sims, front):
    before = [stats(s)["batch_requests"] for s in sims[:2]]
    body = {"input_ids": [PROMPT, [5, 6, 7], [9, 9], [4, 4, 4]], "sampling_params": {"max_new_tokens": 3}}
    assert without_timing(post(front.url, body).json())[0]["output_ids"] == sampled(PROMPT, 0, 3)
    after = [stats(s)["batch_requests"] for s in sims[:2]]
    # Split: one engine request per worker; else the whole batch on one worker.
    assert sorted(y - x for x, y in zip(before, after)) == ([1, 1] if front.split else [0, 1])


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_n_choices_equal_the_engines(sims, front, stream):
    body = {"token_ids": PROMPT, "stream": stream, "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 4, "n": 3, "logprobs": 1, "output_kind": 2}}
    headers = {"x-request-id": "rl-7"}
    if not stream:
        got = post(front.url, body, VLLM, headers=headers).json()
        direct = post(sims[2].url, body, VLLM, headers=headers).json()
        got.pop("created"), direct.pop("created")
        assert got == direct
        assert [c["token_ids"] for c in got["choices"]] == [sampled(PROMPT, s, 4) for s in range(3)]
        assert got["usage"]["completion_tokens"] == 12
        return
    (s1, a), (s2, b) = sse(front.url, body, VLLM, headers=headers), sse(sims[2].url, body, VLLM, headers=headers)
    assert (s1, s2, a) == (200, 200, b)
    assert orjson.loads(a[-2])["usage"] == {"prompt_tokens": 4, "total_tokens": 16, "completion_tokens": 12}


REFUSED = [
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "The specified rids length mismatch with the batch_size for batch processing."),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "Duplicate request IDs detected within the request: ['a']"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 1}]},
     "The parallel_sample_num should be the same for all samples in sample params."),
    ({"input_ids": [[1], [7] * 32768]},
     "The input (32768 tokens) is longer than the model's context length (32768 tokens)."),
]


@pytest.mark.parametrize("body,message", REFUSED)
@pytest.mark.parametrize("stream", [False, True])
def test_batch_refusals_are_sglangs_own(sims, front, body, message, stream):
    before = [stats(s)["received"] for s in sims[:2]]
    body = {**body, "stream": stream}
    if stream:
        (s1, a), (s2, b) = sse(front.url, body), sse(sims[0].url, body)
        assert (s1, a) == (s2, b) == (200, [orjson.dumps({"error": {"message": message}}), b"[DONE]"])
    else:
        a, b = post(front.url, body), post(sims[0].url, body)
        assert (a.status_code, a.json()) == (b.status_code, b.json()) == (400, {"error": {"message": message}})
    assert [stats(s)["received"] for s in sims[:2]] == before


# -- disconnects, records, abort by prefix (own processes) ----------------------------


def _records(base: str) -> list[dict]:
    return trace_records(f"{base}.*.jsonl")


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def traced(request, tmp_path_factory):
    sims = [start_sim(itl_ms=50, extra=["--disconnect-abort-s", "60"]), start_sim("vllm", itl_ms=50)]
    base = str(tmp_path_factory.mktemp("batch") / "trace")
    split = ["--split-batches"] if request.param == "asyncio" else []
    fe = start_frontend([f"sglang={sims[0].url}", f"sglang={sims[0].url}", f"vllm={sims[1].url}"],
                        worker_class=request.param, extra=["--trace-file", base + ".jsonl", *split])
    fe.sims, fe.base, fe.seen = sims, base, 0
    yield fe
    fe.stop()
    count, problems = check_records(
        (f, rec) for f, rec in ((base, r) for r in _records(base)))
    assert problems == [] and count == fe.seen
    for s in sims:
        s.stop()


def _take(fe, n: int) -> list[dict]:
    recs = wait_until(lambda: len(r := _records(fe.base)) >= fe.seen + n and r)
    new = recs[fe.seen : fe.seen + n]
    fe.seen += n
    assert len(recs) == fe.seen
    return sorted(new, key=lambda r: r.get("batch_index", -1))


def test_one_exact_record_per_item(traced):
    body = {"input_ids": [[11, 12], [13, 14, 15]], "rid": "t", "stream": True,
            "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True}, {"max_new_tokens": 4, "ignore_eos": True}]}
    status, events = sse(traced.url, body)
    assert status == 200
    recs = _take(traced, 2)
    assert len({r["batch_id"] for r in recs}) == 1 and recs[0]["batch_id"] != recs[0]["request_id"]
    assert [(r["public_id"], r["batch_index"], r["batch_size"], r["status"], r["output_tokens"], r["input_tokens"],
             r["finish"]["finish_reason"]) for r in recs] == [
        ("t_0", 0, 2, "ok", 2, 2, "length"), ("t_1", 1, 2, "ok", 4, 3, "length")]
    assert [[a["outcome"] for a in r["attempts"]] for r in recs] == [["finished"], ["finished"]]
    assert len({r["attempts"][0]["engine_id"] for r in recs}) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_mid_batch_aborts_every_item(traced, stream):
    sim = traced.sims[0]
    body = {"input_ids": [[21, 22], [23, 24], [25, 26]], "rid": "d", "stream": stream,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "n": 2}}
    c = RawClient(traced.url)
    c.send(orjson.dumps(body))
    # Every item past its first token: the disconnect comes mid-generation.
    wait_until(lambda: [n >= 1 for n in stats(sim)["running_output_tokens"].values()] == [True] * 6)
    c.close()
    wait_until(lambda: stats(sim)["running"] == 0)
    recs = _take(traced, 6)
    assert [(r["batch_index"], r["status"], r["attempts"][0]["outcome"], r["attempts"][0]["abort_acked"])
            for r in recs] == [(i, "client_disconnect", "aborted", True) for i in range(6)]
    aborted = set(stats(sim)["aborted_rids"])
    assert {r["attempts"][0]["engine_id"] for r in recs} <= aborted
    if not stream:
        assert all(r["output_tokens"] == 0 for r in recs)


def test_vllm_n_disconnect_aborts_the_request_and_records_each_choice(traced):
    sim = traced.sims[1]
    body = {"token_ids": [3, 4, 5], "stream": True, "sampling_params": {"max_tokens": 200, "n": 3, "ignore_eos": True}}
    c = RawClient(traced.url)
    c.send(orjson.dumps(body), path=VLLM)
    # Past its first token: the disconnect comes mid-generation.
    wait_until(lambda: [n >= 1 for n in stats(sim)["running_output_tokens"].values()] == [True])
    c.close()
    wait_until(lambda: stats(sim)["running"] == 0)
    recs = _take(traced, 3)
    assert [(r["batch_index"], r["batch_size"], r["status"], r["attempts"][0]["abort_acked"]) for r in recs] == [
        (i, 3, "client_disconnect", True) for i in range(3)]


def test_abort_request_by_prefix_ends_the_batch_items(traced):
    out: dict = {}

    def run(key: str, body: dict) -> None:
        out[key] = sse(traced.url, body)

    long = {"sampling_params": {"max_new_tokens": 100, "ignore_eos": True}, "stream": True}
    threads = [threading.Thread(target=run, args=("batch", {**long, "input_ids": [[31], [32], [33]], "rid": "job7"})),
               threading.Thread(target=run, args=("other", {**long, "input_ids": [34], "rid": "zz",
                                                           "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}))]
    for t in threads:
        t.start()
    wait_until(lambda: stats(traced.sims[0])["running"] == 4)
    r = httpx.post(traced.url + "/abort_request", json={"rid": "job7"}, timeout=10)
    assert (r.status_code, r.content) == (200, b"")
    for t in threads:
        t.join(30)
    status, events = out["batch"]
    finals = {orjson.loads(e)["index"]: orjson.loads(e)["meta_info"]["finish_reason"] for e in events[:-1]
              if orjson.loads(e)["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2] and {f["type"] for f in finals.values()} == {"abort"}
    other = orjson.loads(out["other"][1][-2])["meta_info"]["finish_reason"]
    assert other == {"type": "length", "length": 30}
    recs = _take(traced, 4)
    assert sorted(r["finish"]["backend_finish_reason"] for r in recs) == ["abort", "abort", "abort", "length"]
