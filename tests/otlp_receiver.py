"""An in-process OTLP/HTTP collector for tests: a small HTTP server on
127.0.0.1 that decodes ``POST /v1/traces`` and ``/v1/logs`` protobuf bodies
(opentelemetry-proto) and keeps what it got."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest, ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)


def any_value(v):
    """An OTLP ``AnyValue`` as a Python value."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return getattr(v, kind) if kind else None


def attributes(kvs) -> dict:
    """OTLP ``KeyValue`` list as a dict."""
    return {kv.key: any_value(kv.value) for kv in kvs}


class Receiver:
    """Collects spans and log records; ``status`` is what it answers
    (anything but 200 makes the exporter's batch fail)."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.spans: list = []  # (resource attributes, scope name, Span)
        self.logs: list = []  # (resource attributes, scope name, LogRecord)
        self.posts: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(self.path, body)
                reply = (ExportTraceServiceResponse() if self.path == "/v1/traces"
                         else ExportLogsServiceResponse()).SerializeToString()
                self.send_response(receiver.status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, path: str, body: bytes) -> None:
        with self.lock:
            self.posts.append(path)
            if self.status != 200:
                return
            if path == "/v1/traces":
                for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            self.spans.append((attributes(rs.resource.attributes), ss.scope.name, span))
            elif path == "/v1/logs":
                for rl in ExportLogsServiceRequest.FromString(body).resource_logs:
                    for sl in rl.scope_logs:
                        for record in sl.log_records:
                            self.logs.append((attributes(rl.resource.attributes), sl.scope.name, record))

    def trace(self, trace_id: int) -> list:
        """The spans received in trace ``trace_id``."""
        want = trace_id.to_bytes(16, "big")
        with self.lock:
            return [s for _, _, s in self.spans if s.trace_id == want]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
