"""A request as tracing reads it: exactly the fields the record builder
(:mod:`.record`) and the OpenTelemetry export (:mod:`.otlp`) use.

The handler's :class:`~asgi_generate.request.accounting.RequestState` is
one; tracing sits below the request package and never imports it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..sdk.codec import Attempt
from .tracecontext import TraceContext


class TracedRequest(Protocol):
    """One request's accounting, read when its record is built (finished:
    ``t_done`` and ``status`` set) and, for its trace context, when an
    engine leg is stamped.

    Times are ``time.monotonic()`` seconds except ``received_unix_ms``;
    ``headers`` has lower-case names, as ASGI gives them. The statuses,
    roles and outcomes are the record schema's
    (:data:`asgi_generate.tracing.schema.SCHEMA`).
    """

    request_id: str
    public_id: str | None
    batch_id: str | None
    batch_index: int | None
    batch_size: int | None
    format: str
    route: str
    method: str
    model: str | None
    stream: bool | None
    headers: dict[bytes, bytes]
    status: str | None
    http_status: int | None
    error_type: str | None
    error_message: str | None
    input_ids: Sequence[int] | None
    input_length: int | None
    replay_excluded: str | None
    prompt_tokens: int | None
    output_tokens: int
    engine_completion_tokens: int | None
    cached_tokens: int | None
    output_ids: list[int] | None
    finish_reason: str | None
    finish_matched: int | str | None
    received_unix_ms: int
    t_received: float
    t_dispatched: float | None
    t_first_token: float | None
    t_last_token: float | None
    t_done: float | None
    migrations: int
    replays: int
    not_migrated: str | None
    attempts: list[Attempt]
    #: Set by the OpenTelemetry export on first use.
    trace: TraceContext | None
