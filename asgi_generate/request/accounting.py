"""Per-request accounting kept by the handler: the raw material of the
request-end trace record.

The handler fills one :class:`RequestState` per accepted request while it
serves it; counts are the handler's own (tokens actually sent to the client),
never inferred from the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..sdk.codec import Attempt
from ..tracing.tracecontext import TraceContext


@dataclass(slots=True)
class RequestState:
    """What happened to one request.

    Times are ``time.monotonic()`` seconds except ``received_unix_ms``.
    ``status`` is one of ``ok``, ``client_disconnect``, ``rejected``,
    ``engine_error``, ``unavailable``, ``timeout``, ``shutdown``,
    ``slow_client``; ``None`` until decided.
    """

    request_id: str
    format: str
    route: str
    method: str
    received_unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    t_received: float = field(default_factory=time.monotonic)
    public_id: str | None = None
    stream: bool | None = None
    input_length: int | None = None
    input_ids: Sequence[int] | None = None  # a list, or the codec's array('I')
    replay_excluded: str | None = None
    model: str | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body_bytes: int = 0
    status: str | None = None
    http_status: int | None = None
    error_type: str | None = None
    error_message: str | None = None
    finish_reason: str | None = None
    finish_matched: int | str | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    engine_completion_tokens: int | None = None
    cached_tokens: int | None = None
    output_ids: list[int] | None = None
    t_dispatched: float | None = None
    t_first_token: float | None = None
    t_last_token: float | None = None
    t_done: float | None = None
    attempts: list[Attempt] = field(default_factory=list)
    migrations: int = 0
    #: Its W3C trace context, made at its first engine leg (or at export)
    #: when OpenTelemetry export is on; ``None`` otherwise.
    trace: TraceContext | None = None
    replays: int = 0
    not_migrated: str | None = None
    response_started: bool = False
    response_complete: bool = False
    #: An item of a request that carried several: the request's id, the
    #: item's index in its answer, and how many items it carried.
    batch_id: str | None = None
    batch_index: int | None = None
    batch_size: int | None = None
    #: For a request with items: makes their states, each recorded in
    #: place of this one (see :mod:`asgi_generate.request.batches`).
    expand: Callable[[], list["RequestState"]] | None = None

    def fail(self, status: str, http_status: int | None, error_type: str, message: str) -> None:
        """Record a failed outcome (the first one recorded wins)."""
        if self.status is None:
            self.status = status
            self.http_status = http_status
            self.error_type = error_type
            self.error_message = message
