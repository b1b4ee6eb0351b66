"""What one request may carry, end to end: items (SGLang batches and ``n``,
vLLM ``n``) past ``--max-request-items`` get the format's 400 before any
engine sees them, with one record; a request's many items never push other
requests' records out of the trace queue; ``/stats`` and ``/metrics`` count
HTTP requests and request items apart. Both worker classes."""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import Traced, post, sse, start_sim, stats, wait_until

pytestmark = pytest.mark.e2e

VLLM = "/inference/v1/generate"
#: The body a new user sent: 73 bytes asking for 100,000 samples.
N_100000 = b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "n": 100000}}'
TOO_MANY = ("The request carries 100000 items (1 prompts x n 100000), more than the 16384 this server allows "
            "per request (--max-request-items).")
#: The trace queue: a request's items may fill half of it (16 records).
QUEUE = 32


@pytest.fixture(scope="module")
def sims():
    procs = [start_sim(), start_sim("vllm")]
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fe(request, sims, tmp_path_factory):
    traced = Traced(tmp_path_factory, ["--worker", f"sglang={sims[0].url}", "--worker", f"vllm={sims[1].url}",
                                       "--trace-queue-size", str(QUEUE)], request.param)
    yield traced
    traced.stop()


def _stats(fe) -> dict:
    return httpx.get(fe.url + "/stats", timeout=5).json()


def _settled(fe) -> list[dict]:
    """Every record, once the writer wrote each one the frontend counted."""
    def written():
        s = _stats(fe)["trace"]
        return s["records"] == s["submitted"] and fe.records()
    return wait_until(written)


def _counts(fe) -> tuple[int, int, float, float]:
    """``/stats`` http_requests and request_items, and /metrics'
    asgi_generate_http_requests_total and asgi_generate_requests_total summed."""
    s = _stats(fe)
    text = httpx.get(fe.url + "/metrics", timeout=5).text
    sums = {"asgi_generate_http_requests_total": 0.0, "asgi_generate_requests_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return (s["http_requests"], s["request_items"], sums["asgi_generate_http_requests_total"],
            sums["asgi_generate_requests_total"])


def test_a_small_body_asking_n_100000_is_sglangs_400_and_one_record(sims, fe):
    received = stats(sims[0])["received"]
    before = _counts(fe)
    got = post(fe.url, N_100000)
    assert (got.status_code, got.json()) == (400, {"error": {"message": TOO_MANY}})
    assert len(got.content) == 154  # not 24 MB
    body = orjson.loads(N_100000)
    assert sse(fe.url, {**body, "stream": True}) == (200, [orjson.dumps({"error": {"message": TOO_MANY}}), b"[DONE]"])
    assert stats(sims[0])["received"] == received
    assert _counts(fe) == tuple(c + 2 for c in before)
    recs = [r for r in _settled(fe) if r.get("error", {}).get("message") == TOO_MANY]
    assert [(r["status"], r["http_status"], r.get("batch_size")) for r in recs] == [
        ("rejected", 400, None), ("rejected", 200, None)]


def test_vllm_n_past_the_bound_is_vllms_400(sims, fe):
    received = stats(sims[1])["received"]
    got = post(fe.url, {"token_ids": [1], "sampling_params": {"max_tokens": 1, "n": 100000}}, VLLM)
    message = "sampling_params.n must be at most 16384 on this server (--max-request-items), got 100000."
    assert (got.status_code, got.json()) == (
        400, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})
    assert stats(sims[1])["received"] == received


@pytest.mark.parametrize("stream", [False, True])
def test_n_16384_the_engine_refuses_as_a_whole_is_one_record_with_its_item_count(sims, fe, stream):
    """vLLM answers 400 to ``n`` above its ``max_num_seqs`` (256 on the
    simulator) before running anything: one record for the 90-byte request,
    not 16,384 (13 MB of records and seconds of the frontend's time)."""
    before = _counts(fe)
    body = {"token_ids": [1], "sampling_params": {"max_tokens": 1, "n": 16384}, "request_id": "wide",
            "stream": stream}
    got = post(fe.url, body, VLLM)
    message = "sampling_params.n must be at most the server's max_num_seqs (256), got 16384."
    answer = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    assert (got.status_code, got.json()) == (400, answer)
    assert _counts(fe) == (before[0] + 1, before[1] + 1, before[2] + 1, before[3] + 1)
    recs = [r for r in _settled(fe) if r.get("public_id") == "wide" and r["stream"] is stream]
    assert [(r["status"], r["http_status"], r["error"]["message"], r["item_count"], r.get("batch_id"),
             r["output_tokens"], [a["outcome"] for a in r["attempts"]]) for r in recs] == [
        ("rejected", 400, orjson.dumps(answer).decode(), 16384, None, 0, ["error"])]


def test_http_requests_and_request_items_are_counted_apart(fe):
    before = _counts(fe)
    batch = post(fe.url, {"input_ids": [[1, 2], [3, 4]], "sampling_params": {"max_new_tokens": 1, "n": 3}})
    single = post(fe.url, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
    assert (batch.status_code, len(batch.json()), single.status_code) == (200, 6, 200)
    assert _counts(fe) == (before[0] + 2, before[1] + 7, before[2] + 2, before[3] + 7)


def test_a_requests_items_never_push_other_requests_records_out(fe):
    """300 items and 8 single requests at once through a 32-record queue:
    the items wait for the writer in their half, the singles find room,
    nothing is dropped."""
    done: dict[str, int] = {}

    def run(key: str, body: dict) -> None:
        done[key] = post(fe.url, body).status_code

    threads = [threading.Thread(target=run, args=("items", {
        "input_ids": [7, 8], "rid": "many", "sampling_params": {"max_new_tokens": 1, "n": 300}}))]
    threads += [threading.Thread(target=run, args=(f"one-{i}", {
        "input_ids": [9, i], "rid": f"one-{i}", "sampling_params": {"max_new_tokens": 1}})) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(done.values()) == {200} and len(done) == 9
    recs = _settled(fe)
    assert _stats(fe)["trace"]["dropped"] == {"queue_full": 0, "sink_error": 0, "build_error": 0, "closed": 0}
    singles = sorted(r["public_id"] for r in recs if (r.get("public_id") or "").startswith("one-"))
    assert singles == [f"one-{i}" for i in range(8)]
    batch = {r["batch_id"] for r in recs if r.get("batch_size") == 300}
    assert len(batch) == 1
    assert sum(1 for r in recs if r.get("batch_id") in batch) == 300
