"""What the process records of its requests (asgi_generate/ops/recorder.py,
metrics.py) in process: the ``/stats`` counters and the Prometheus
samples one finished request, its legs and its aborts add, exactly."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from asgi_generate.config import Settings
from asgi_generate.ops.recorder import Recorder
from asgi_generate.tracing.state import LegRecord as Attempt
from asgi_generate.tracing.state import RequestState


def samples(recorder: Recorder) -> dict[tuple, float]:
    """Every non-zero sample of ``/metrics`` but the histograms' buckets,
    by (name, labels)."""
    recorder.metrics.flush()
    text = recorder.metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.value and not s.name.endswith("_bucket")}


def migrated() -> RequestState:
    """A stream of 5 tokens that migrated once, 2 s end to end."""
    st = RequestState("r" * 32, "sglang", "/generate", "POST")
    st.t_received, st.t_first_token, st.t_last_token, st.t_done = 100.0, 100.5, 101.5, 102.0
    st.status, st.http_status, st.output_tokens, st.input_length, st.body_bytes = "ok", 200, 5, 3, 64
    st.migrations = 1
    st.attempts = [Attempt("e0", "aggregated", "w0", outcome="worker_lost"),
                   Attempt("e1", "resumed", "w1", outcome="finished")]
    return st


def test_one_request_adds_its_counts_to_stats_and_metrics():
    recorder = Recorder(Settings())
    recorder.request_started()
    st = migrated()
    recorder.request_ended(st)
    recorder.request_finished(st)
    recorder.abort_sent()
    recorder.abort_answered("acked")
    recorder.abort_answered("lost")
    assert recorder.counters == {
        "http_requests": 1, "request_items": 1, "aborts_sent": 1, "aborts_acknowledged": 1,
        "aborts_unacknowledged": 0, "aborts_worker_lost": 1, "migrations": 1, "replays": 0, "not_migrated": 0,
        "migration_waits_taken": 0, "migration_waits_timed_out": 0}
    assert recorder.by_status == {"ok": 1}
    assert recorder.tracer is None and recorder.otel is None  # tracing off: finishing a request only counts
    fmt = (("format", "sglang"),)
    got = samples(recorder)
    assert {k: v for k, v in got.items() if not k[0].endswith(("_sum", "_count"))} == {
        ("asgi_generate_requests_total", (("code", "200"), ("format", "sglang"), ("route", "/generate"),
                                          ("status", "ok"))): 1.0,
        ("asgi_generate_http_requests_total", (("code", "200"), ("format", "sglang"), ("route", "/generate"))): 1.0,
        ("asgi_generate_prompt_tokens_total", fmt): 3.0,
        ("asgi_generate_generation_tokens_total", fmt): 5.0,
        ("asgi_generate_request_body_bytes_total", fmt): 64.0,
        ("asgi_generate_migrations_total", fmt): 1.0,
        ("asgi_generate_engine_legs_total", (("outcome", "worker_lost"), ("role", "aggregated"))): 1.0,
        ("asgi_generate_engine_legs_total", (("outcome", "finished"), ("role", "resumed"))): 1.0,
        ("asgi_generate_worker_failures_total", (("reason", "worker_lost"), ("url", ""), ("worker", "w0"))): 1.0,
        ("asgi_generate_aborts_total", (("result", "acknowledged"),)): 1.0,
        ("asgi_generate_aborts_total", (("result", "worker_lost"),)): 1.0,
    }
    assert (got[("asgi_generate_time_to_first_token_seconds_sum", fmt)],
            got[("asgi_generate_request_time_per_output_token_seconds_sum", fmt)],
            got[("asgi_generate_e2e_request_latency_seconds_sum", fmt)]) == (0.5, 0.25, 2.0)
    assert got[("asgi_generate_e2e_request_latency_seconds_count", fmt)] == 1.0


def test_the_gaps_between_a_streams_token_events_are_observed_per_format():
    recorder = Recorder(Settings())
    observe = recorder.inter_token_latency("vllm")
    for gap in (0.01, 0.02, 0.03):
        observe(gap)
    got = samples(recorder)
    fmt = (("format", "vllm"),)
    assert got[("asgi_generate_inter_token_latency_seconds_count", fmt)] == 3.0
    assert abs(got[("asgi_generate_inter_token_latency_seconds_sum", fmt)] - 0.06) < 1e-12
