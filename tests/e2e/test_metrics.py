"""GET /metrics: Prometheus text format, exact values after a known set of
requests, and one merged view under ``serve --workers 2``."""

from __future__ import annotations

import pathlib

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import (
    CONTINUATION, PROMPT, Proc, RawClient, free_port, listening_socket, post, sse, start_frontend, start_sim,
    trace_records,
    wait_until,
)

pytestmark = pytest.mark.e2e

CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics`` as ``{(name, sorted labels): value}``."""
    resp = httpx.get(url + "/metrics", timeout=10)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == CONTENT_TYPE
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def family(samples: dict, name: str) -> dict[tuple, float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    sglang = start_sim("sglang", itl_ms=20)
    vllm = start_sim("vllm")
    dead = free_port()
    trace = tmp_path_factory.mktemp("metrics-trace") / "trace.jsonl"
    fe = start_frontend(
        [f"sglang={sglang.url}", f"vllm={vllm.url}", f"sglang=http://127.0.0.1:{dead}"],
        extra=["--trace-file", str(trace), "--migration-limit", "0"],
    )
    yield fe, sglang, vllm, dead, trace
    for p in (fe, sglang, vllm):
        p.stop()


def records(trace: pathlib.Path) -> list[dict]:
    return trace_records(str(trace.parent / "trace.*.jsonl"))


def test_metrics_exact_after_known_requests(fleet):
    fe, sglang, vllm, dead, trace = fleet
    sent = {"sglang": 0, "vllm": 0}

    def body(obj: dict | bytes, fmt: str = "sglang") -> bytes:
        data = obj if isinstance(obj, bytes) else orjson.dumps(obj)
        sent[fmt] += len(data)
        return data

    unary = post(fe.url, body({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}}))
    assert unary.status_code == 200 and unary.json()["output_ids"] == CONTINUATION[:5]
    stream = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "stream": True}
    body(stream)
    status, events = sse(fe.url, stream)
    assert status == 200 and events[-1] == b"[DONE]"
    v = post(fe.url, body({"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}}, "vllm"),
             path="/inference/v1/generate")
    assert v.status_code == 200 and v.json()["choices"][0]["token_ids"] == CONTINUATION[:4]
    assert post(fe.url, body(b"{not json")).status_code == 400
    assert httpx.get(fe.url + "/generate", timeout=10).status_code == 405
    # A client that hangs up mid-stream: its leg is aborted and acknowledged.
    c = RawClient(fe.url)
    c.send(body({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1000}, "stream": True}))
    assert len(c.events(2)) == 2
    c.close()
    wait_until(lambda: len(records(trace)) == 6)

    m = scrape(fe.url)
    recs = records(trace)
    assert family(m, "asgi_generate_requests_total") == {
        (("code", "200"), ("format", "sglang"), ("route", "/generate"), ("status", "ok")): 2.0,
        (("code", "200"), ("format", "sglang"), ("route", "/generate"), ("status", "client_disconnect")): 1.0,
        (("code", "400"), ("format", "sglang"), ("route", "/generate"), ("status", "rejected")): 1.0,
        (("code", "405"), ("format", "sglang"), ("route", "/generate"), ("status", "rejected")): 1.0,
        (("code", "200"), ("format", "vllm"), ("route", "/inference/v1/generate"), ("status", "ok")): 1.0,
    }
    assert value(m, "asgi_generate_requests_in_flight") == 0.0
    # Token counts: exactly what the records say was sent, per format.
    hung = next(r for r in recs if r["status"] == "client_disconnect")
    assert hung["output_tokens"] >= 2
    assert value(m, "asgi_generate_generation_tokens_total", format="sglang") == 5 + 3 + hung["output_tokens"]
    assert value(m, "asgi_generate_generation_tokens_total", format="vllm") == 4.0
    assert value(m, "asgi_generate_prompt_tokens_total", format="sglang") == 3 * len(PROMPT)
    assert value(m, "asgi_generate_prompt_tokens_total", format="vllm") == len(PROMPT)
    assert value(m, "asgi_generate_request_body_bytes_total", format="sglang") == sent["sglang"]
    assert value(m, "asgi_generate_request_body_bytes_total", format="vllm") == sent["vllm"]
    # Latency histograms: TTFT and per-request TPOT only for the two streams
    # (the unary legs carry no token timing), end to end for every request.
    assert value(m, "asgi_generate_time_to_first_token_seconds_count", format="sglang") == 2.0
    assert value(m, "asgi_generate_time_to_first_token_seconds_count", format="vllm") is None
    assert value(m, "asgi_generate_request_time_per_output_token_seconds_count", format="sglang") == 2.0
    assert value(m, "asgi_generate_e2e_request_latency_seconds_count", format="sglang") == 5.0
    assert value(m, "asgi_generate_e2e_request_latency_seconds_count", format="vllm") == 1.0
    e2e_sum = sum(r["total_ms"] for r in recs if r["format"] == "sglang") / 1000
    assert value(m, "asgi_generate_e2e_request_latency_seconds_sum", format="sglang") == pytest.approx(e2e_sum, abs=0.01)
    # The histograms hold what the records say, request for request.
    streams = [r for r in recs if r["format"] == "sglang" and "ttft_ms" in r]
    assert value(m, "asgi_generate_time_to_first_token_seconds_sum", format="sglang") == pytest.approx(
        sum(r["ttft_ms"] for r in streams) / 1000, abs=1e-5)
    assert value(m, "asgi_generate_request_time_per_output_token_seconds_sum", format="sglang") == pytest.approx(
        sum(r["mean_itl_ms"] for r in streams) / 1000, abs=1e-5)
    assert value(m, "asgi_generate_time_to_first_token_seconds_bucket", format="sglang", le="+Inf") == 2.0
    # Inter-token latency, per event after a stream's first: the gaps add up
    # to each stream's first-to-last span (mean_itl_ms * (tokens - 1)); the
    # hung stream's last event may have been taken but not delivered.
    itl = value(m, "asgi_generate_inter_token_latency_seconds_count", format="sglang")
    assert 2 + hung["output_tokens"] - 1 <= itl <= 2 + hung["output_tokens"]
    assert value(m, "asgi_generate_inter_token_latency_seconds_sum", format="sglang") == pytest.approx(
        sum(r["mean_itl_ms"] * (r["output_tokens"] - 1) for r in streams) / 1000, abs=1e-5)
    assert value(m, "asgi_generate_inter_token_latency_seconds_bucket", format="sglang", le="+Inf") == itl
    assert value(m, "asgi_generate_inter_token_latency_seconds_count", format="vllm") is None
    assert family(m, "asgi_generate_engine_legs_total") == {
        (("outcome", "finished"), ("role", "aggregated")): 3.0,
        (("outcome", "aborted"), ("role", "aggregated")): 1.0,
    }
    assert family(m, "asgi_generate_aborts_total") == {(("result", "acknowledged"),): 1.0}
    assert family(m, "asgi_generate_migrations_total") == {}
    assert family(m, "asgi_generate_worker_failures_total") == {}
    workers = {"w0": (sglang.url, "sglang"), "w1": (vllm.url, "vllm"), "w2": (f"http://127.0.0.1:{dead}", "sglang")}
    assert family(m, "asgi_generate_worker_up") == {
        (("protocol", p), ("role", "aggregated"), ("url", u), ("worker", w)): (0.0 if w == "w2" else 1.0)
        for w, (u, p) in workers.items()
    }
    assert set(family(m, "asgi_generate_worker_outstanding_requests").values()) == {0.0}
    assert family(m, "asgi_generate_trace_records_written_total") == {(("sink", "file"),): 6.0}
    assert family(m, "asgi_generate_trace_records_dropped_total") == {}


def test_worker_failures_and_failover_counted(fleet):
    """A worker that refuses the connection while the router still thinks it
    up: the leg fails over and its worker's failure is counted."""
    sim = start_sim("sglang")
    fe = start_frontend([f"sglang={sim.url}"], extra=["--health-interval", "60"])
    try:
        url = sim.url
        sim.stop()
        resp = post(fe.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert resp.status_code == 503
        m = scrape(fe.url)
        assert family(m, "asgi_generate_worker_failures_total") == {
            (("reason", "connect_failed"), ("url", url), ("worker", "w0")): 1.0
        }
        assert family(m, "asgi_generate_engine_legs_total") == {
            (("outcome", "connect_failed"), ("role", "aggregated")): 1.0
        }
        assert value(m, "asgi_generate_worker_up", worker="w0", url=url, protocol="sglang", role="aggregated") == 0.0
    finally:
        fe.stop()


def test_metrics_merged_across_worker_processes(tmp_path):
    """``serve --workers 2``: every process counts its own requests (/stats),
    /metrics from any of them shows the sum, and the folder the processes
    shared is gone once serve stopped. (The frontend's TMPDIR is its own:
    suites running side by side make folders of the same name.)"""
    sim = start_sim("sglang")
    fe = Proc("frontend-workers", ["serve", "--workers", "2", "--worker", f"sglang={sim.url}",
                                   "--health-interval", "0.2", "--log-level", "warning"], listening_socket(), "/health")
    try:
        per_pid: dict[int, int] = {}
        sent = 0
        for _ in range(80):  # bounded: stop once both processes served requests
            with httpx.Client(timeout=10) as client:  # a fresh connection: either process may take it
                r = client.post(fe.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
                assert r.status_code == 200
                sent += 1
            with httpx.Client(timeout=10) as client:
                stats = client.get(fe.url + "/stats").json()
                per_pid[stats["pid"]] = stats["request_items"]
            if len(per_pid) == 2 and all(per_pid.values()):
                break
        assert len(per_pid) == 2 and all(per_pid.values()), per_pid
        for _ in range(4):  # whichever process answers, the same totals
            with httpx.Client(timeout=10) as client:
                resp = client.get(fe.url + "/metrics")
            samples = {}
            for fam in text_string_to_metric_families(resp.text):
                for s in fam.samples:
                    samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
            assert value(samples, "asgi_generate_requests_total", format="sglang", route="/generate",
                         status="ok", code="200") == sent
            assert value(samples, "asgi_generate_generation_tokens_total", format="sglang") == 2 * sent
            assert value(samples, "asgi_generate_requests_in_flight") == 0.0
            assert value(samples, "asgi_generate_worker_up", worker="w0", url=sim.url, protocol="sglang",
                         role="aggregated") == 1.0
        # One folder, written by both processes (prometheus-client names its files KIND_PID.db).
        (folder,) = fe.tmp.iterdir()
        assert folder.name.startswith("asgi-generate-metrics-")
        assert {f.stem.rsplit("_", 1)[1] for f in folder.iterdir()} == {str(pid) for pid in per_pid}
    finally:
        fe.stop()
        sim.stop()
    assert list(fe.tmp.iterdir()) == []


#: Histograms of times: their counts compare across runs, their sums and buckets not.
TIMED = ("asgi_generate_time_to_first_token_seconds", "asgi_generate_request_time_per_output_token_seconds",
         "asgi_generate_inter_token_latency_seconds", "asgi_generate_e2e_request_latency_seconds")


def comparable(samples: dict) -> dict:
    """A scrape less what depends on timing (time histograms' sums and finite buckets)."""
    return {(name, labels): v for (name, labels), v in samples.items()
            if not (name.startswith(TIMED) and (name.endswith("_sum") or
                                                (name.endswith("_bucket") and ("le", "+Inf") not in labels)))}


def test_one_process_and_two_scrape_the_same_values_for_the_same_traffic():
    """The same requests (unary, streamed, rejected), each on a fresh
    connection, to ``serve`` and to ``serve --workers 2`` (until both of its
    processes served some): the two scrapes hold the same series with the
    same values, timing aside, whichever process answers the scrape."""
    started = [start_sim("sglang")]
    url = started[0].url
    try:
        one = start_frontend([f"sglang={url}"], worker_class="asyncio")
        started.append(one)
        two = Proc("frontend-workers", ["serve", "--workers", "2", "--worker", f"sglang={url}", "--health-interval",
                                        "0.2", "--log-level", "warning"], listening_socket(), "/health")
        started.append(two)

        def traffic(fe: Proc) -> set[int]:
            """One round of requests; the process ids that served them."""
            pids = set()
            for body in ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}},
                         {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "stream": True}, b"{bad"):
                with httpx.Client(timeout=10) as client:  # a fresh connection: either process may take it
                    data = body if isinstance(body, bytes) else orjson.dumps(body)
                    r = client.post(fe.url + "/generate", content=data, headers={"content-type": "application/json"})
                    assert r.status_code == (400 if body == b"{bad" else 200)
                    pids.add(client.get(fe.url + "/stats").json()["pid"])
            return pids

        served: set[int] = set()
        rounds = 0
        while len(served) < 2 and rounds < 40:  # bounded: until both processes served
            served |= traffic(two)
            rounds += 1
        assert len(served) == 2
        for _ in range(rounds):
            traffic(one)
        single = comparable(scrape(one.url))
        assert value(single, "asgi_generate_requests_total", format="sglang", route="/generate", status="ok",
                     code="200") == 2 * rounds
        for _ in range(3):
            assert comparable(scrape(two.url)) == single
    finally:
        for p in reversed(started):
            p.stop()


def test_batch_items_leave_nothing_in_flight():
    """A request with two items is one request in flight and two counted
    ends (one per item record); once answered, nothing is in flight (each
    item's end used to subtract one: -1 after a batch of two)."""
    sim = start_sim("sglang")
    fe = start_frontend([f"sglang={sim.url}"])
    try:
        resp = post(fe.url, {"input_ids": [PROMPT, [5, 6, 7]], "sampling_params": {"max_new_tokens": 2}})
        assert resp.status_code == 200 and len(resp.json()) == 2
        m = scrape(fe.url)
        assert value(m, "asgi_generate_requests_in_flight") == 0.0
        assert value(m, "asgi_generate_requests_total", format="sglang", route="/generate", status="ok",
                     code="200") == 2.0
        assert value(m, "asgi_generate_e2e_request_latency_seconds_count", format="sglang") == 2.0
        assert value(m, "asgi_generate_generation_tokens_total", format="sglang") == 4.0
    finally:
        fe.stop()
        sim.stop()


def test_histograms_count_each_observation_once_across_scrapes(monkeypatch):
    """Per-event gaps and per-request latencies wait in bucket counts kept
    across scrapes, zeroed as each scrape moves them: nothing counted twice."""
    from asgi_generate.ops.metrics import Metrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = Metrics()
    gaps = metrics.gaps("sglang")
    assert metrics.gaps("sglang") is gaps
    for seconds in (0.02, 0.02, 3.0):
        gaps.observe(seconds)

    def scraped() -> dict:
        metrics.flush()
        out = {}
        for fam in text_string_to_metric_families(metrics.render().decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    m = scraped()
    name = "asgi_generate_inter_token_latency_seconds"
    assert (value(m, name + "_count", format="sglang"), value(m, name + "_sum", format="sglang")) == (3.0, 3.04)
    assert value(m, name + "_bucket", format="sglang", le="0.025") == 2.0
    gaps.observe(0.5)
    m = scraped()
    assert (value(m, name + "_count", format="sglang"), value(m, name + "_sum", format="sglang")) == (4.0, 3.54)
    assert value(m, name + "_bucket", format="sglang", le="0.5") == 3.0
    assert scraped() == m
