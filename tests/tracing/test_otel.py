"""OpenTelemetry export (--otlp-endpoint, --trace-otlp) against an in-process
OTLP/HTTP collector: the request's server span, a child span per engine leg,
the traceparent each engine got, the records as log records, and losses."""

from __future__ import annotations

import pathlib

import httpx
import orjson
import pytest
from hypothesis import given, strategies as stb

from asgi_generate.tracing.tracecontext import format_traceparent, parse_traceparent
from otlp_receiver import Receiver, attributes
from support import (CONTINUATION, DECODE, PREFILL, PROMPT, post, prefill_spec, sse, start_frontend, start_sim, stats, wait_until,
                     trace_lines)


TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN = 0x00F067AA0BA902B7
SERVER, CLIENT = 2, 3  # OTLP Span.SpanKind
INFO = 9  # OTLP SeverityNumber.SEVERITY_NUMBER_INFO


def tp(trace_id: int, span_id: int, flags: str = "01") -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags}"


def span_id(span) -> int:
    return int.from_bytes(span.span_id, "big")


def parent_id(span) -> int:
    return int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else 0


def records(trace: pathlib.Path) -> dict[str, tuple[dict, bytes]]:
    """Trace-file records by request id, with their exact line."""
    out = {}
    for line in trace_lines(str(trace.parent / f"{trace.stem}.*.jsonl")):
        rec = orjson.loads(line)
        out[rec["request_id"]] = (rec, line)
    return out


@pytest.fixture(scope="module")
def collector():
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def fleet(collector, tmp_path_factory):
    sglang, vllm = start_sim("sglang"), start_sim("vllm")
    trace = tmp_path_factory.mktemp("otel") / "trace.jsonl"
    fe = start_frontend([f"sglang={sglang.url}", f"vllm={vllm.url}"],
                        extra=["--otlp-endpoint", collector.url, "--trace-otlp", "--trace-file", str(trace)])
    yield fe, sglang, vllm, trace
    for p in (fe, sglang, vllm):
        p.stop()


def server_span(collector: Receiver, trace_id: int):
    spans = wait_until(lambda: [s for s in collector.trace(trace_id) if s.kind == SERVER])
    assert len(spans) == 1
    return spans[0]


@pytest.mark.e2e
def test_server_span_leg_span_engine_traceparent_and_log_record(collector, fleet):
    fe, sglang, _, trace = fleet
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "stream": True}
    status, events = sse(fe.url, body, headers={"traceparent": tp(TRACE, CLIENT_SPAN), "tracestate": "vendor=a1",
                                               "x-request-id": "client-1"})
    assert status == 200 and events[-1] == b"[DONE]"
    span = server_span(collector, TRACE)
    rec, line = wait_until(lambda: next((r for r in records(trace).values() if r[0].get("x_request_id") == "client-1"),
                                        None))
    # The server span: the client's span is its parent; the record's fields.
    assert (span.name, parent_id(span), span.trace_state) == ("POST /generate", CLIENT_SPAN, "vendor=a1")
    assert span.start_time_unix_nano == rec["received_unix_ms"] * 1_000_000
    assert abs((span.end_time_unix_nano - span.start_time_unix_nano) / 1e6 - rec["total_ms"]) < 0.002
    assert [(e.name, e.time_unix_nano - span.start_time_unix_nano) for e in span.events] == [
        ("first_token", pytest.approx(rec["ttft_ms"] * 1e6, abs=2000))]
    assert span.status.code == 0  # unset: the request succeeded
    assert attributes(span.attributes) == {
        "http.request.method": "POST", "url.path": "/generate", "gen_ai.request.id": rec["request_id"],
        "http.response.status_code": 200, "gen_ai.usage.prompt_tokens": 4, "gen_ai.usage.completion_tokens": 3,
        "gen_ai.latency.time_to_first_token": rec["ttft_ms"] / 1000, "gen_ai.latency.e2e": rec["total_ms"] / 1000,
        "gen_ai.response.finish_reasons": ["length"],
        "asgi_generate.event_time_unix_ms": rec["event_time_unix_ms"],
        "asgi_generate.request_id": rec["request_id"], "asgi_generate.x_request_id": "client-1",
        "asgi_generate.format": "sglang", "asgi_generate.route": "/generate", "asgi_generate.method": "POST",
        "asgi_generate.stream": True, "asgi_generate.status": "ok", "asgi_generate.http_status": 200,
        "asgi_generate.input_tokens": 4, "asgi_generate.output_tokens": 3, "asgi_generate.cached_tokens": 0,
        "asgi_generate.received_unix_ms": rec["received_unix_ms"],
        "asgi_generate.dispatch_wait_ms": rec["dispatch_wait_ms"], "asgi_generate.ttft_ms": rec["ttft_ms"],
        "asgi_generate.total_ms": rec["total_ms"], "asgi_generate.mean_itl_ms": rec["mean_itl_ms"],
        "asgi_generate.finish.finish_reason": "length", "asgi_generate.finish.backend_finish_reason": "length",
        "asgi_generate.replay.block_size": 64, "asgi_generate.replay.input_length": 4,
    }
    # One leg, a child of the server span, and the engine got its traceparent.
    legs = [s for s in collector.trace(TRACE) if s.kind == CLIENT]
    assert len(legs) == 1
    leg, attempt = legs[0], rec["attempts"][0]
    assert (leg.name, parent_id(leg)) == ("engine aggregated", span_id(span))
    assert span.start_time_unix_nano <= leg.start_time_unix_nano <= leg.end_time_unix_nano <= span.end_time_unix_nano
    assert attributes(leg.attributes) == {
        "asgi_generate.engine_id": attempt["engine_id"], "asgi_generate.worker_id": "w0",
        "asgi_generate.role": "aggregated", "asgi_generate.tokens": 3, "asgi_generate.outcome": "finished",
        "server.address": "127.0.0.1", "server.port": sglang.port,
    }
    assert stats(sglang)["traceparents"][attempt["engine_id"]] == tp(TRACE, span_id(leg))
    # The record as a log record, in the request's span.
    logs = wait_until(lambda: [r for _, _, r in collector.logs if r.trace_id == TRACE.to_bytes(16, "big")])
    assert len(logs) == 1
    log = logs[0]
    assert (log.body.string_value.encode(), log.span_id, log.severity_number, log.severity_text, log.event_name) == (
        line, span.span_id, INFO, "INFO", "asgi_generate.request_end")
    assert log.time_unix_nano == rec["event_time_unix_ms"] * 1_000_000
    assert attributes(log.attributes) == {"asgi_generate.request_id": rec["request_id"],
                                          "asgi_generate.format": "sglang", "asgi_generate.status": "ok"}
    resource = next(r for r, _, s in collector.spans if s.span_id == span.span_id)
    assert resource["service.name"] == "asgi-generate"


@pytest.mark.e2e
def test_a_request_without_traceparent_is_a_root_and_vllm_gets_one(collector, fleet):
    fe, _, vllm, trace = fleet
    resp = post(fe.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}, path="/inference/v1/generate",
                headers={"x-request-id": "client-2"})
    assert resp.status_code == 200 and resp.json()["choices"][0]["token_ids"] == CONTINUATION[:2]
    rec, _ = wait_until(lambda: next((r for r in records(trace).values() if r[0].get("x_request_id") == "client-2"),
                                     None))
    engine_id = rec["attempts"][0]["engine_id"]
    sent = parse_traceparent(stats(vllm)["traceparents"][engine_id].encode())
    assert sent is not None and sent[2] == 1
    spans = wait_until(lambda: len(collector.trace(sent[0])) == 2 and collector.trace(sent[0]))
    top = next(s for s in spans if s.kind == SERVER)
    leg = next(s for s in spans if s.kind == CLIENT)
    assert (top.name, parent_id(top), parent_id(leg), span_id(leg)) == (
        "POST /inference/v1/generate", 0, span_id(top), sent[1])
    assert attributes(leg.attributes)["asgi_generate.tokens"] == 2


@pytest.mark.e2e
def test_rejected_request_is_a_span_without_legs_and_reaches_no_engine(collector, fleet):
    fe, sglang, _, _ = fleet
    before = stats(sglang)["generate_requests"]
    resp = post(fe.url, b"{not json", headers={"traceparent": tp(TRACE + 1, CLIENT_SPAN)})
    assert resp.status_code == 400
    span = server_span(collector, TRACE + 1)
    attrs = attributes(span.attributes)
    assert (attrs["http.response.status_code"], attrs["asgi_generate.status"], attrs["asgi_generate.error.type"]) == (
        400, "rejected", "invalid_json")
    assert span.status.code == 0  # a client's error is not the server's
    assert collector.trace(TRACE + 1) == [span]
    assert stats(sglang)["generate_requests"] == before


@pytest.mark.e2e
def test_unsampled_client_trace_exports_no_span_but_still_propagates(collector, fleet):
    fe, sglang, _, trace = fleet
    resp = post(fe.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
                headers={"traceparent": tp(TRACE + 2, CLIENT_SPAN, "00"), "x-request-id": "client-3"})
    assert resp.status_code == 200
    rec, _ = wait_until(lambda: next((r for r in records(trace).values() if r[0].get("x_request_id") == "client-3"),
                                     None))
    sent = parse_traceparent(stats(sglang)["traceparents"][rec["attempts"][0]["engine_id"]].encode())
    assert (sent[0], sent[2]) == (TRACE + 2, 0)
    wait_until(lambda: any(r.trace_id == (TRACE + 2).to_bytes(16, "big") for _, _, r in collector.logs))
    assert collector.trace(TRACE + 2) == []


@pytest.mark.e2e
def test_pd_legs_are_two_children_each_engine_with_its_traceparent(collector, tmp_path):
    prefill, decode = start_sim(extra=PREFILL), start_sim(extra=DECODE)
    fe = start_frontend([], extra=["--prefill", prefill_spec(prefill), "--decode", f"sglang={decode.url}",
                                   "--otlp-endpoint", collector.url])
    try:
        resp = post(fe.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}},
                    headers={"traceparent": tp(TRACE + 3, CLIENT_SPAN)})
        assert resp.status_code == 200 and resp.json()["output_ids"] == CONTINUATION[:4]
        spans = wait_until(lambda: len(collector.trace(TRACE + 3)) == 3 and collector.trace(TRACE + 3))
        top = next(s for s in spans if s.kind == SERVER)
        legs = {attributes(s.attributes)["asgi_generate.role"]: s for s in spans if s.kind == CLIENT}
        assert sorted(legs) == ["decode", "prefill"]
        for role, sim in (("prefill", prefill), ("decode", decode)):
            leg = legs[role]
            assert (leg.name, parent_id(leg)) == (f"engine {role}", span_id(top))
            engine_id = attributes(leg.attributes)["asgi_generate.engine_id"]
            assert stats(sim)["traceparents"][engine_id] == tp(TRACE + 3, span_id(leg))
        assert attributes(legs["decode"].attributes)["asgi_generate.tokens"] == 4
    finally:
        for p in (fe, prefill, decode):
            p.stop()


@pytest.mark.e2e
def test_collector_refusing_counts_drops_and_answers_stay_whole(tmp_path):
    refusing = Receiver(status=400)
    sim = start_sim("sglang")
    fe = start_frontend([f"sglang={sim.url}"], extra=["--otlp-endpoint", refusing.url, "--trace-otlp"])
    try:
        for _ in range(3):
            resp = post(fe.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            assert resp.status_code == 200 and resp.json()["output_ids"] == CONTINUATION[:2]
        # The exporter's failures are counted after the records are built:
        # wait for both, not for the records alone.
        trace = wait_until(lambda: (t := httpx.get(fe.url + "/stats").json()["trace"])["records"] == 3
                           and t["dropped"]["sink_error"] == 6 and t)
        assert trace["dropped"] == {"queue_full": 0, "sink_error": 6, "build_error": 0, "closed": 0}
        assert trace["sinks"] == {"otlp_spans": {"written": 0, "failed": 3}, "otlp_logs": {"written": 0, "failed": 3}}
        assert {"/v1/traces", "/v1/logs"} <= set(refusing.posts)
        metrics = httpx.get(fe.url + "/metrics").text
        assert 'asgi_generate_trace_records_dropped_total{cause="sink_error"} 6.0' in metrics
    finally:
        fe.stop()
        sim.stop()
        refusing.close()


@pytest.mark.e2e
def test_off_by_default_no_traceparent_reaches_the_engine():
    sim = start_sim("sglang")
    fe = start_frontend([f"sglang={sim.url}"])
    try:
        resp = post(fe.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "rid": "r-off"},
                    headers={"traceparent": tp(TRACE + 4, CLIENT_SPAN)})
        assert resp.status_code == 200
        assert stats(sim)["traceparents"] == {}
        assert httpx.get(fe.url + "/stats").json()["trace"] == {"enabled": False}
    finally:
        fe.stop()
        sim.stop()


@given(stb.integers(1, 2**128 - 1), stb.integers(1, 2**64 - 1), stb.booleans())
def test_traceparent_round_trips(trace_id, span, sampled):
    assert parse_traceparent(format_traceparent(trace_id, span, sampled)) == (trace_id, span, int(sampled))


@pytest.mark.parametrize("value,parsed", [
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", (TRACE, CLIENT_SPAN, 1)),
    (b" 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00\t", (TRACE, CLIENT_SPAN, 0)),
    (b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-future", (TRACE, CLIENT_SPAN, 9)),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", None),
    (b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
    (b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", None),
    (b"00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),
    (b"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),
    (b"", None),
])
def test_traceparent_parsing_follows_w3c(value, parsed):
    assert parse_traceparent(value) == parsed


@pytest.mark.e2e
def test_a_migrated_stream_has_its_resumed_leg_as_a_second_child(collector):
    """A worker drops the stream after two tokens: the failed leg and the
    resumed one are both children of the request's span, each engine got
    the traceparent of its own leg, and the client got the whole answer."""
    sims = [start_sim("sglang"), start_sim("sglang")]
    fe = start_frontend([f"sglang={s.url}" for s in sims], extra=["--otlp-endpoint", collector.url])
    try:
        for s in sims:  # fires on the first leg only: a resumed prompt is longer
            httpx.post(s.url + "/sim/faults", json={"count": 1, "after_tokens": 2, "input_len": len(PROMPT)},
                       timeout=5).raise_for_status()
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}, "stream": True}
        status, events = sse(fe.url, body, headers={"traceparent": tp(TRACE + 5, CLIENT_SPAN)})
        assert status == 200 and events[-1] == b"[DONE]"
        assert orjson.loads(events[-2])["output_ids"] == CONTINUATION[:6]
        spans = wait_until(lambda: len(collector.trace(TRACE + 5)) == 3 and collector.trace(TRACE + 5))
        top = next(s for s in spans if s.kind == SERVER)
        legs = sorted((s for s in spans if s.kind == CLIENT), key=lambda s: s.start_time_unix_nano)
        assert attributes(top.attributes)["asgi_generate.migrations"] == 1
        assert [(s.name, parent_id(s), attributes(s.attributes)["asgi_generate.outcome"],
                 attributes(s.attributes)["asgi_generate.tokens"], s.status.code) for s in legs] == [
            ("engine aggregated", span_id(top), "worker_lost", 2, 2),
            ("engine resumed", span_id(top), "finished", 4, 0),
        ]
        sent = {}
        for s in sims:
            sent.update(stats(s)["traceparents"])
        for leg in legs:
            assert sent[attributes(leg.attributes)["asgi_generate.engine_id"]] == tp(TRACE + 5, span_id(leg))
    finally:
        fe.stop()
        for s in sims:
            s.stop()
