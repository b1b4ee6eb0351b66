"""Request-end tracing: exactly one record per request that reached a
registered route, written off the response path.

Modules, one concept each: :mod:`.schema` (the v1 record contract),
:mod:`.record` (RequestState -> record), :mod:`.hashing` (replay block
hashes), :mod:`.parsers`, :mod:`.reasoning` and :mod:`.tool_calls` (output
parsers), :mod:`.analysis` (running them), :mod:`.sinks` (JSONL file, stderr),
:mod:`.writer` (bounded queue and writer task), :mod:`.validate` (record
checks) and :mod:`.tools` (the ``asgi-generate-trace`` command).
"""

from .schema import SCHEMA, SCHEMA_ID
from .writer import Tracer, TraceSetupError

__all__ = ["SCHEMA", "SCHEMA_ID", "TraceSetupError", "Tracer"]
