"""OpenTelemetry export of requests: spans, and request-end records as
log records, over OTLP/HTTP (``--otlp-endpoint``, ``--trace-otlp``).

Imported only when ``--otlp-endpoint`` is set; otherwise no request does any
of this work. On the response path there is only :meth:`Otlp.stamp`, once
per engine leg: it mints the leg's span id and sends the engine a
``traceparent`` naming it (the engines export their own spans under it when
started with their tracing flags). Everything else runs in the trace
writer's thread (:mod:`asgi_generate.tracing.writer`), from the finished
request and its record, as two sinks whose losses are counted like the
file's:

- :class:`SpanSink`: per request one ``SERVER`` span named ``METHOD route``
  (the client's ``traceparent`` is its parent), with the record's fields as
  attributes, and per engine leg one ``CLIENT`` child span (role, worker,
  engine id, outcome, tokens). Spans are made at request end with the
  recorded times, through the SDK's tracer, whose id generator hands out the
  ids minted while the request ran.
- :class:`LogSink`: per request one log record whose body is the record's
  JSON line, in the request's trace.

The SDK reads the standard variables: ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` (default: parent based,
always on), ``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``,
``..._COMPRESSION``, ``..._CERTIFICATE`` and the per-signal forms;
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``..._LOGS_ENDPOINT`` (full URLs)
win over ``--otlp-endpoint`` plus ``/v1/traces`` / ``/v1/logs``.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry._logs import SeverityNumber
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider, LogRecordProcessor, ReadableLogRecord, ReadWriteLogRecord
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from .. import __version__
from .sinks import Sink
from .tracecontext import TraceContext, format_traceparent, from_headers, mint_span_id
from .state import RequestState

if TYPE_CHECKING:
    from ..sdk._codec import Attempt, WorkerRequest
    from ..config import Settings

SCOPE = "asgi_generate"
#: Outcomes (the record's ``status``) that make the request's span an error.
ERROR_STATUSES = frozenset({"engine_error", "unavailable", "timeout", "shutdown"})
ERROR_OUTCOMES = frozenset({"error", "connect_failed", "worker_lost", "timeout"})
#: Record fields not copied into span attributes: legs are child spans, the
#: other two are the same in every record. (Replay block hashes are left out
#: too: thousands of numbers, 64-bit unsigned, which OTLP ints are not.)
_SKIP = frozenset({"attempts", "schema", "event_type"})


class _PresetIds(IdGenerator):
    """Hands the SDK the ids the request minted while it ran; set
    :attr:`trace_id` and :attr:`span_id` before each ``start_span`` (spans
    are only made in the trace writer's one thread)."""

    def __init__(self) -> None:
        self.trace_id = 0
        self.span_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id


class _Spans(SpanProcessor):
    """Keeps ended spans for the sink to export as one batch."""

    def __init__(self) -> None:
        self.kept: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.kept.append(span)


class _Logs(LogRecordProcessor):
    """Keeps emitted log records for the sink to export as one batch."""

    def __init__(self) -> None:
        self.kept: list[ReadableLogRecord] = []

    def on_emit(self, log_record: ReadWriteLogRecord) -> None:
        self.kept.append(ReadableLogRecord(log_record.log_record, log_record.resource,
                                              log_record.instrumentation_scope, log_record.limits))

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def signal_endpoint(base: str, signal: str) -> str:
    """The OTLP/HTTP URL of ``signal`` (``traces``, ``logs``): its
    ``OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT`` when set, else ``base`` plus
    ``/v1/<signal>`` (the OTLP spec's paths)."""
    return os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT") or f"{base.rstrip('/')}/v1/{signal}"


def _resource() -> Resource:
    attrs = {"service.version": __version__}
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if not named:
        attrs["service.name"] = "asgi-generate"
    return Resource.create(attrs)


class Otlp:
    """The OpenTelemetry side of one server process.

    Args:
        settings: uses ``otlp_endpoint`` and ``trace_otlp``.
    """

    def __init__(self, settings: "Settings") -> None:
        resource = _resource()
        self.ids = _PresetIds()
        self.spans = _Spans()
        self.provider = TracerProvider(resource=resource, id_generator=self.ids)
        self.provider.add_span_processor(self.spans)
        self.tracer = self.provider.get_tracer(SCOPE, __version__)
        self.span_exporter = OTLPSpanExporter(endpoint=signal_endpoint(settings.otlp_endpoint, "traces"))
        self.logs: _Logs | None = None
        if settings.trace_otlp:
            self.logs = _Logs()
            self.log_provider = LoggerProvider(resource=resource)
            self.log_provider.add_log_record_processor(self.logs)
            self.logger = self.log_provider.get_logger(SCOPE, __version__)
            self.log_exporter = OTLPLogExporter(endpoint=signal_endpoint(settings.otlp_endpoint, "logs"))

    # -- on the response path: once per engine leg ---------------------------

    def context(self, st: RequestState) -> TraceContext:
        """``st``'s trace context, made on first use from the client's headers."""
        ctx = st.trace
        if ctx is None:
            trace_id, parent, flags, state = from_headers(st.headers)
            if flags is not None:
                sampled = bool(flags & 1)
            else:  # a root: what the configured sampler decides for this trace id
                decision = self.provider.sampler.should_sample(None, trace_id, f"{st.method} {st.route}")
                sampled = decision.decision.is_sampled()
            ctx = st.trace = TraceContext(trace_id, mint_span_id(), parent, sampled, state)
        return ctx

    def stamp(self, st: RequestState, attempt: "Attempt", wreq: "WorkerRequest") -> None:
        """Give ``attempt`` a span id and its send time, and ``wreq`` the
        ``traceparent`` (and the client's ``tracestate``) naming that span."""
        ctx = self.context(st)
        attempt.span_id = mint_span_id()
        attempt.t_sent = time.monotonic()
        wreq.headers.append((b"traceparent", format_traceparent(ctx.trace_id, attempt.span_id, ctx.sampled)))
        if ctx.tracestate is not None:
            wreq.headers.append((b"tracestate", ctx.tracestate))

    # -- in the trace writer's thread ----------------------------------------------

    def make_spans(self, st: RequestState, rec: dict) -> None:
        """Start and end the request's span and its legs' (kept by the
        span processor until :meth:`SpanSink.write_records` exports them)."""
        ctx = self.context(st)
        base = st.received_unix_ms * 1_000_000 - round(st.t_received * 1e9)  # monotonic -> Unix ns

        def ns(t: float) -> int:
            return base + round(t * 1e9)

        if ctx.parent_span_id is not None:
            flags = TraceFlags(TraceFlags.SAMPLED if ctx.sampled else 0)
            state = TraceState.from_header([ctx.tracestate.decode("latin-1")]) if ctx.tracestate else None
            remote = SpanContext(ctx.trace_id, ctx.parent_span_id, True, flags, state)
            parent = trace.set_span_in_context(NonRecordingSpan(remote), Context())
        else:
            parent = Context()
        self.ids.trace_id, self.ids.span_id = ctx.trace_id, ctx.span_id
        span = self.tracer.start_span(f"{st.method} {st.route}", parent, SpanKind.SERVER,
                                      record_attributes(rec), start_time=ns(st.t_received))
        if st.t_first_token is not None:
            span.add_event("first_token", timestamp=ns(st.t_first_token))
        http_status = rec.get("http_status") or 0
        if rec["status"] in ERROR_STATUSES or http_status >= 500:
            span.set_status(Status(StatusCode.ERROR, rec.get("error", {}).get("message")))
        inside = trace.set_span_in_context(span, Context())
        for a in st.attempts:
            if not a.span_id:
                continue
            self.ids.span_id = a.span_id
            leg = self.tracer.start_span(f"engine {a.role}", inside, SpanKind.CLIENT, leg_attributes(a),
                                         start_time=ns(a.t_sent))
            if a.outcome in ERROR_OUTCOMES:
                leg.set_status(Status(StatusCode.ERROR, a.outcome))
            leg.end(ns(a.t_ended if a.t_ended is not None else st.t_done))
        span.end(ns(st.t_done))

    def emit_log(self, st: RequestState, rec: dict, line: bytes) -> None:
        """Emit the request's record as a log record in its trace."""
        ctx = self.context(st)
        span = SpanContext(ctx.trace_id, ctx.span_id, False, TraceFlags(TraceFlags.SAMPLED if ctx.sampled else 0))
        self.logger.emit(
            timestamp=rec["event_time_unix_ms"] * 1_000_000,
            observed_timestamp=time.time_ns(),
            context=trace.set_span_in_context(NonRecordingSpan(span), Context()),
            severity_number=SeverityNumber.INFO,
            severity_text="INFO",
            body=line.decode(),
            attributes={"asgi_generate.request_id": rec["request_id"], "asgi_generate.format": rec["format"],
                        "asgi_generate.status": rec["status"]},
            event_name="asgi_generate.request_end",
        )



def record_attributes(rec: dict) -> dict:
    """Span attributes of a request-end record: HTTP and GenAI semantic
    convention names where they exist (vLLM's ``vllm/tracing.py``
    ``SpanAttributes``), then every record field as
    ``asgi_generate.<field>[.<sub-field>]`` (legs become child spans; replay
    block hashes are left out, tool calls give their names)."""
    attrs: dict = {"http.request.method": rec["method"], "url.path": rec["route"], "gen_ai.request.id": rec["request_id"]}
    if "http_status" in rec:
        attrs["http.response.status_code"] = rec["http_status"]
    if "input_tokens" in rec:
        attrs["gen_ai.usage.prompt_tokens"] = rec["input_tokens"]
    attrs["gen_ai.usage.completion_tokens"] = rec["output_tokens"]
    if "ttft_ms" in rec:
        attrs["gen_ai.latency.time_to_first_token"] = rec["ttft_ms"] / 1000
    attrs["gen_ai.latency.e2e"] = rec["total_ms"] / 1000
    if "finish" in rec:
        attrs["gen_ai.response.finish_reasons"] = [rec["finish"]["finish_reason"]]
    for key, value in rec.items():
        if key not in _SKIP:
            _flatten(f"asgi_generate.{key}", value, attrs)
    return attrs


def _flatten(name: str, value, attrs: dict) -> None:
    if isinstance(value, dict):
        for key, sub in value.items():
            if key != "block_hashes":
                _flatten(f"{name}.{key}", sub, attrs)
    elif isinstance(value, list):
        if name == "asgi_generate.finish.tool_calls":
            attrs[name] = [call["name"] for call in value]
    else:
        attrs[name] = value


def leg_attributes(a: "Attempt") -> dict:
    """A leg's span attributes: the record's attempt fields, and the worker's address."""
    attrs = {"asgi_generate.engine_id": a.engine_id, "asgi_generate.worker_id": a.worker_id,
             "asgi_generate.role": a.role, "asgi_generate.tokens": a.tokens}
    if a.outcome is not None:
        attrs["asgi_generate.outcome"] = a.outcome
    if a.abort_acked is not None:
        attrs["asgi_generate.abort_acked"] = a.abort_acked
    url = getattr(a.worker, "url", None)
    if url:
        host, _, port = url.partition("://")[2].rpartition(":")
        attrs["server.address"] = host.strip("[]")
        attrs["server.port"] = int(port)
    return attrs


class _Export(Sink):
    """Exports each batch in one OTLP/HTTP request: what :meth:`make` turns
    the batch's records into, kept by the signal's processor until then.

    Args:
        processor: the SDK processor that keeps what was made (its ``kept`` list).
        exporter: the signal's OTLP exporter.
    """

    takes_records = True
    #: What is exported, for the error message.
    items = ""
    #: The exporter's answer when the collector took the batch.
    success: object = None

    def __init__(self, otlp: Otlp, processor: "_Spans | _Logs", exporter) -> None:
        super().__init__()
        self.otlp, self.processor, self.exporter = otlp, processor, exporter

    def make(self, st: RequestState, rec: dict, line: bytes) -> None:
        """Make one record's items (the processor keeps them)."""
        raise NotImplementedError

    def write_records(self, batch: list[tuple[RequestState, dict, bytes]]) -> None:
        """Make and export the items of ``batch``.

        Raises:
            OSError: the collector did not take them.
        """
        processor = self.processor
        processor.kept = []  # nothing left over from a batch that failed half-way
        for st, rec, line in batch:
            self.make(st, rec, line)
        made, processor.kept = processor.kept, []
        if made and self.exporter.export(made) is not self.success:
            raise OSError(f"the OTLP collector did not take {len(made)} {self.items}")

    def close(self) -> None:
        self.exporter.shutdown()


class SpanSink(_Export):
    """Exports each batch's spans in one OTLP/HTTP request."""

    name = "otlp_spans"
    items = "spans"
    success = SpanExportResult.SUCCESS

    def __init__(self, otlp: Otlp) -> None:
        super().__init__(otlp, otlp.spans, otlp.span_exporter)

    def make(self, st: RequestState, rec: dict, line: bytes) -> None:
        self.otlp.make_spans(st, rec)


class LogSink(_Export):
    """Exports each batch's records as OTLP log records in one request."""

    name = "otlp_logs"
    items = "log records"
    success = LogRecordExportResult.SUCCESS

    def __init__(self, otlp: Otlp) -> None:
        super().__init__(otlp, otlp.logs, otlp.log_exporter)

    def make(self, st: RequestState, rec: dict, line: bytes) -> None:
        self.otlp.emit_log(st, rec, line)
