"""Build one request-end record (a JSON-ready dict) from a finished
request (:class:`~.state.RequestState`).

The layout is :data:`asgi_generate.tracing.schema.SCHEMA`. Optional fields
are left out, never written empty or null. Runs in the trace writer, after
the response is over.
"""

from __future__ import annotations

import orjson

from .analysis import OutputAnalyzer, final_finish_reason
from ..exceptions import TokenIdOutOfRange
from .hashing import block_hashes_json
from .schema import EVENT_TYPE, SCHEMA_ID
from .state import RequestState

#: Client-chosen ids (body or header) are cut to this many characters, so a
#: client cannot bloat every record it causes.
MAX_ID_CHARS = 256
MAX_ERROR_CHARS = 1024
#: An attempt's ``usage`` fields, in the record's order.
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens")
_TRUE = ("1", "true", "yes")


def _segments(st: RequestState) -> list[dict]:
    """The output tokens sent per run of one weight version, in order: the
    versions the engines reported for them (:meth:`LegRecord.version_runs`)."""
    segments: list[dict] = []
    for a in st.attempts:
        if a.role == "prefill" or not a.tokens:
            continue
        for version, tokens in a.version_runs():
            if segments and segments[-1]["weight_version"] == version:
                segments[-1]["tokens"] += tokens
            else:
                segments.append({"weight_version": version, "tokens": tokens})
    return segments


#: Adding then subtracting 1.5 * 2**52 rounds a float below 2**51 to a
#: whole number (ties to even) in two float operations.
_WHOLE = 6755399441055744.0
#: Microsecond counts below this (11.6 days) are exact to 2**-13.
_MAX_EXACT_US = 1e12


def _ms(seconds: float) -> float:
    """``round(seconds * 1000.0, 3)``, the same float in a tenth of the
    instructions (``round`` with digits formats and parses decimal text).
    Away from a tie (0.001 µs of margin, far above the product's rounding
    error) the nearest whole microsecond is the correctly rounded one, and
    dividing it by 1000 gives the float nearest its decimal, as ``round``
    does; zero, negatives, ties and the rest go to ``round``."""
    ms = seconds * 1000.0
    us = ms * 1000.0
    if 0.0 < us < _MAX_EXACT_US:
        whole = (us + _WHOLE) - _WHOLE
        if -0.499 < us - whole < 0.499:
            return whole / 1000.0
    return round(ms, 3)


def _text(value: bytes) -> str:
    """A client-chosen header value as the record's text, cut."""
    return value.decode("utf-8", "replace")[:MAX_ID_CHARS]


def session_fields(headers: dict[bytes, bytes]) -> dict | None:
    """The ``session`` object from ``x-session-id``, ``x-parent-session-id``
    and ``x-session-final`` (lower-case names, as ASGI gives them); ``None``
    when none of them was sent."""
    sid = headers.get(b"x-session-id")
    parent = headers.get(b"x-parent-session-id")
    final = headers.get(b"x-session-final")
    if sid is None and parent is None and final is None:
        return None
    session: dict = {}
    if sid is not None:
        session["session_id"] = _text(sid)
    if parent is not None:
        session["parent_session_id"] = _text(parent)
    if final is not None:
        session["session_final"] = _text(final).strip().lower() in _TRUE
    return session


def replay_fields(st: RequestState, block_size: int) -> dict:
    """The ``replay`` object: block hashes of ``st.input_ids``, or why not.

    ``block_hashes`` is an ``orjson.Fragment``: the JSON array's text, made
    in C (:func:`~asgi_generate.tracing.hashing.block_hashes_json`), which
    ``orjson.dumps`` copies as it is.
    """
    if st.input_ids is None:
        return {"excluded": st.replay_excluded or "not_decoded"}
    try:
        hashes = orjson.Fragment(block_hashes_json(st.input_ids, block_size))
    except TokenIdOutOfRange:
        return {"excluded": "token_id_out_of_range"}
    return {"block_size": block_size, "input_length": len(st.input_ids), "block_hashes": hashes}


def build_record(st: RequestState, block_size: int, analyzer: OutputAnalyzer | None = None) -> dict:
    """The request-end record of ``st``.

    Args:
        st: a finished request (``t_done`` and ``status`` set by the handler).
        block_size: tokens per replay block, at least 1.
        analyzer: tokenizer and parsers; without one, no output analysis.

    Returns:
        A dict for ``orjson.dumps``, whose JSON text is a v1 record; its
        ``replay.block_hashes`` is that array's text (an ``orjson.Fragment``),
        so ``orjson.loads(orjson.dumps(record))`` is the record as the sinks
        and the schema see it.
    """
    # Written for the writer's CPU (a record is built per request): each
    # field read once into a local, helpers inlined on the common path.
    t_received = st.t_received
    total_s = st.t_done - t_received
    received_unix_ms = st.received_unix_ms
    headers = st.headers
    rec: dict = {
        "schema": SCHEMA_ID,
        "event_type": EVENT_TYPE,
        "event_time_unix_ms": received_unix_ms + round(total_s * 1000.0),
        "request_id": st.request_id,
    }
    if st.public_id is not None:
        rec["public_id"] = st.public_id[:MAX_ID_CHARS]
    if st.batch_id is not None:
        rec["batch_id"] = st.batch_id
        rec["batch_index"] = st.batch_index
        rec["batch_size"] = st.batch_size
    if st.item_count is not None:
        rec["item_count"] = st.item_count
    x_request_id = headers.get(b"x-request-id")
    if x_request_id is not None:
        rec["x_request_id"] = _text(x_request_id)
    rec["format"] = st.format
    rec["route"] = st.route
    rec["method"] = st.method
    if st.model is not None:
        rec["model"] = st.model
    if st.stream is not None:
        rec["stream"] = st.stream
    rec["status"] = st.status
    if st.http_status is not None:
        rec["http_status"] = st.http_status
    if st.error_type is not None:
        rec["error"] = {"type": st.error_type, "message": (st.error_message or "")[:MAX_ERROR_CHARS]}

    input_tokens = st.input_length if st.input_length is not None else st.prompt_tokens
    if input_tokens is not None:
        rec["input_tokens"] = input_tokens
    output_tokens = rec["output_tokens"] = st.output_tokens
    engine_completion_tokens = st.engine_completion_tokens
    if engine_completion_tokens is not None and engine_completion_tokens != output_tokens:
        rec["engine_completion_tokens"] = engine_completion_tokens
    if st.cached_tokens is not None:
        rec["cached_tokens"] = st.cached_tokens
    finish_reason = st.finish_reason
    analysis = None
    if analyzer is not None:
        # Only what the client was sent: a unary answer cut short sent nothing.
        delivered = (st.output_ids or [])[:output_tokens]
        analysis = analyzer.analyze(delivered, finish_reason is not None)
        if analysis.reasoning_tokens is not None:
            rec["reasoning_tokens"] = analysis.reasoning_tokens

    rec["received_unix_ms"] = received_unix_ms
    if st.t_dispatched is not None:
        rec["dispatch_wait_ms"] = _ms(st.t_dispatched - t_received)
    t_first_token = st.t_first_token
    if t_first_token is not None:
        rec["ttft_ms"] = _ms(t_first_token - t_received)
    rec["total_ms"] = _ms(total_s)
    if output_tokens > 1 and t_first_token is not None and st.t_last_token is not None:
        rec["mean_itl_ms"] = _ms((st.t_last_token - t_first_token) / (output_tokens - 1))

    if st.queue_s is not None:
        rec["queue_ms"] = _ms(st.queue_s)
    if st.priority_class is not None:
        rec["priority_class"] = st.priority_class
        rec["tenant"] = st.tenant
        if st.group_id is not None:
            rec["group_id"] = st.group_id
    if st.shed_reason is not None:
        rec["shed_reason"] = st.shed_reason
    if st.preemptions:
        rec["preemptions"] = st.preemptions
    if st.migrations:
        rec["migrations"] = st.migrations
    if st.replays:
        rec["replays"] = st.replays
    if st.pause_resumes:
        rec["pause_resumes"] = st.pause_resumes
    if st.pause_resumes or st.migrations or st.replays or any(len(a.versions) > 1 for a in st.attempts):
        segments = _segments(st)
        if st.pause_resumes or len(segments) > 1:
            rec["segments"] = segments
    if st.not_migrated is not None:
        rec["not_migrated"] = st.not_migrated
    attempts = []
    for a in st.attempts:
        row = {"engine_id": a.engine_id, "worker_id": a.worker_id, "role": a.role}
        if a.outcome is not None:
            row["outcome"] = a.outcome
        if a.tokens:
            row["tokens"] = a.tokens
        if a.abort_acked is not None:
            row["abort_acked"] = a.abort_acked
        if a.pair is not None and a.role == "decode" and a.pair.local_prefill:
            row["local_prefill"] = True
        if a.backoff_ms:
            row["backoff_ms"] = a.backoff_ms
        weight_version = a.versions[0][0] if a.versions else a.worker_info.get("weight_version")
        if weight_version is not None:
            row["weight_version"] = weight_version
        if a.usage is not None:
            usage = a.usage.prompt_tokens, a.usage.completion_tokens, a.usage.cached_tokens
            reported = {k: v for k, v in zip(USAGE_FIELDS, usage) if v is not None}
            if reported:
                row["usage"] = reported
        attempts.append(row)
    rec["attempts"] = attempts

    if finish_reason is not None:
        names = analysis.tool_calls if analysis is not None else None
        finish = {
            "finish_reason": final_finish_reason(finish_reason, names) if names else finish_reason,
            "backend_finish_reason": finish_reason,
        }
        matched = st.finish_matched
        if matched is not None:
            finish["matched"] = matched[:MAX_ID_CHARS] if isinstance(matched, str) else matched
        if names is not None:
            finish["tool_calls"] = [{"index": i, "name": n} for i, n in enumerate(names)]
        rec["finish"] = finish
    session = session_fields(headers)
    if session is not None:
        rec["session"] = session
    rec["replay"] = replay_fields(st, block_size)
    return rec
