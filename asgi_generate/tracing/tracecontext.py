"""W3C Trace Context (``traceparent``, ``tracestate``) for one request and
its engine legs, with no OpenTelemetry import: what the handler touches
when ``--otlp-endpoint`` is on.

Wire format: W3C Trace Context, level 1 (``version-traceid-parentid-flags``,
lower-case hex; version ``ff``, an all-zero trace or parent id, or extra
fields after a version ``00`` header make it invalid, and an invalid header is
ignored: the request starts a trace of its own). Both engines read these
headers from a generate request (SGLang ``srt/tracing/trace.py``
``TRACE_HEADERS``, vLLM ``vllm/tracing.py`` ``extract_trace_context``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
SAMPLED = 0x01
#: A longer ``tracestate`` is not forwarded (W3C: 512 characters is what a
#: vendor must propagate at least; it bounds what a client makes us send).
MAX_TRACESTATE = 512


@dataclass(slots=True)
class TraceContext:
    """A request's place in a distributed trace.

    Attributes:
        trace_id: 128-bit trace id (the client's, or minted).
        span_id: 64-bit id of the request's own (server) span, minted.
        parent_span_id: the client's span id from its ``traceparent``, else
            ``None`` (the request's span is a root).
        sampled: whether the request's spans are recorded (the client's flag,
            or the sampler's decision for a root).
        tracestate: the client's ``tracestate`` header, forwarded as sent.
    """

    trace_id: int
    span_id: int
    parent_span_id: int | None
    sampled: bool
    tracestate: bytes | None = None


def parse_traceparent(value: bytes) -> tuple[int, int, int] | None:
    """``(trace_id, parent_id, flags)`` of a ``traceparent`` header value,
    or ``None`` when it is invalid (surrounding blanks are allowed)."""
    m = _TRACEPARENT.fullmatch(value.strip(b" \t"))
    if m is None:
        return None
    version, trace, parent, flags, rest = m.groups()
    if version == b"ff" or (version == b"00" and rest):
        return None
    trace_id, parent_id = int(trace, 16), int(parent, 16)
    if not trace_id or not parent_id:
        return None
    return trace_id, parent_id, int(flags, 16)


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> bytes:
    """The version ``00`` ``traceparent`` value naming ``span_id`` as the parent."""
    return b"00-%032x-%016x-%02x" % (trace_id, span_id, SAMPLED if sampled else 0)


def mint_span_id() -> int:
    """A random non-zero 64-bit span id."""
    return random.getrandbits(64) or 1


def mint_trace_id() -> int:
    """A random non-zero 128-bit trace id."""
    return random.getrandbits(128) or 1


def from_headers(headers: dict[bytes, bytes]) -> tuple[int, int | None, int | None, bytes | None]:
    """What the client's headers (lower-case names) say: ``(trace_id,
    parent_span_id, flags, tracestate)``; a minted trace id and ``None``s
    when it sent no valid ``traceparent``."""
    raw = headers.get(b"traceparent")
    parsed = parse_traceparent(raw) if raw is not None else None
    if parsed is None:
        return mint_trace_id(), None, None, None
    state = headers.get(b"tracestate")
    if state is not None and len(state) > MAX_TRACESTATE:
        state = None
    return parsed[0], parsed[1], parsed[2], state
