"""Request-end tracing: exactly one record per request that reached a
registered route, written off the response path.

Modules, one concept each: :mod:`.schema` (the v1 record contract),
:mod:`.state` (a request's state, the records' source), :mod:`.record` (state ->
record), :mod:`.hashing` (replay block hashes), :mod:`.parser_api` (the
output parsers' plugin API), :mod:`.parsers` (their registry),
:mod:`.reasoning` and :mod:`.tool_calls` (the built-in parsers),
:mod:`.analysis` (running them), :mod:`.sinks` (JSONL file, stderr),
:mod:`.writer` (bounded queue and writer task), :mod:`.tracecontext` (W3C
trace context) and :mod:`.otlp` (OpenTelemetry export); :mod:`.offline`
holds the ``asgi-generate-trace`` command and its tools.
"""

from .schema import SCHEMA, SCHEMA_ID
from ..exceptions import TraceSetupError
from .writer import Tracer

__all__ = ["SCHEMA", "SCHEMA_ID", "TraceSetupError", "Tracer"]
