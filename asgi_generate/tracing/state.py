"""One request's state: what the request-end record (:mod:`.record`) and
the OpenTelemetry export (:mod:`.otlp`) are made from.

The data class lives here, below the request package, so that tracing
reads the request's own state rather than a copy of its fields; the request
package fills it while it serves the request and changes its ending
(``status`` and the error) and its attempts' outcomes only through its state
machine (:mod:`asgi_generate.request.state`). Counts are the handler's own
(tokens actually sent to the client), never inferred from the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..sdk._codec import Attempt, Event, Usage
from .tracecontext import TraceContext


@dataclass(slots=True)
class LegRecord(Attempt):
    """One engine leg of a request, as the handler keeps it: the SDK's
    :class:`~asgi_generate.sdk.Attempt` (what the leg's codec reads)
    and the handler's bookkeeping beside it. The request package's state
    machine (:mod:`asgi_generate.request.state`) changes its ``outcome``.

    Attributes:
        worker: the router's worker object the leg runs on.
        live: the engine may be running this leg.
        outcome: how the leg ended: ``finished``, ``aborted``, ``error``,
            ``connect_failed``, ``worker_lost``, ``timeout``; ``None`` while
            it runs.
        abort_acked: the engine acknowledged an abort of this leg.
        tokens: output tokens this leg contributed to the client's answer.
        span_id: with OpenTelemetry export on, the leg's span id (sent to
            the engine in its ``traceparent``), else 0; ``t_sent``/``t_ended``
            the leg's start and end (``time.monotonic()``), then only.
        unfinished: batch legs: the carried items not finished yet.
        entry_acked: batch legs: item index -> whether the engine
            acknowledged its abort.
        usage: the counts the leg's engine reported with the end of its
            answer (:meth:`Event.reported`), for the record; ``None`` when
            none came.
        versions: the weight versions the engine reported for the leg's
            output, in order: ``[version, tokens]`` runs over the leg's own
            output (:meth:`count`); see :meth:`version_runs`.
    """

    worker: Any = None
    live: bool = False
    outcome: str | None = None
    abort_acked: bool | None = None
    tokens: int = 0
    span_id: int = 0
    t_sent: float | None = None
    t_ended: float | None = None
    unfinished: set[int] | None = None
    entry_acked: dict[int, bool] | None = None
    usage: Usage | None = None
    versions: list[list[Any]] = field(default_factory=list)

    def count(self, event: Event) -> bool:
        """Count ``event``'s tokens as sent to the client by this leg, and
        the weight versions its engine reported for them (a codec gives one
        or the other): ``weight_version`` extends the runs, ``weight_spans``
        (the whole leg's) replace them. Returns whether the engine reported
        a version its worker was not known to serve (the fleet's state may
        have changed behind this process). (Once per streamed event:
        written for the CPU.)"""
        ids = event.token_ids
        self.tokens += len(ids)
        version = event.weight_version
        if version is not None and ids:
            runs = self.versions
            if runs:
                last = runs[-1]
                if last[0] == version:
                    last[1] += len(ids)
                    return False
            runs.append([version, len(ids)])
            return version != self.worker_info.get("weight_version")
        if event.weight_spans is not None:
            self.versions = [[v, end - start] for v, start, end in event.weight_spans if end > start]
            return any(v != self.worker_info.get("weight_version") for v, _ in self.versions)
        return False

    def version_runs(self) -> list[tuple[str | None, int]]:
        """``(weight version, tokens)`` runs of the :attr:`tokens` this leg
        sent, in order: as its engine reported them, the rest (tokens it
        reported no version for) at its worker's version when the leg was
        sent (``worker_info``; ``None`` when unknown)."""
        out: list[tuple[str | None, int]] = []
        left = self.tokens
        for version, n in self.versions:
            if left <= 0:
                break
            out.append((version, min(n, left)))
            left -= n
        if left > 0:
            reading = self.worker_info.get("weight_version")
            if out and out[-1][0] == reading:
                out[-1] = (reading, out[-1][1] + left)
            else:
                out.append((reading, left))
        return out


@dataclass(slots=True)
class RequestState:
    """What happened to one request.

    Times are ``time.monotonic()`` seconds except ``received_unix_ms``;
    ``headers`` has lower-case names, as ASGI gives them. ``status`` is one
    of the record schema's statuses (:data:`.schema.STATUSES`), ``None``
    while the request runs; each attempt's ``outcome`` one of
    :data:`.schema.ATTEMPT_OUTCOMES`. A request with items records one
    state per item, each derived from this one
    (:func:`asgi_generate.request.state.item_state`).
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
    attempts: "list[LegRecord]" = field(default_factory=list)
    migrations: int = 0
    #: Times the stream was held across a fleet pause and resumed.
    pause_resumes: int = 0
    #: Times admission preempted the stream (aborted on its engine, parked)
    #: and resumed it.
    preemptions: int = 0
    #: Its W3C trace context, made at its first engine leg (or at export)
    #: when OpenTelemetry export is on (set by that export); ``None`` otherwise.
    trace: TraceContext | None = None
    replays: int = 0
    not_migrated: str | None = None
    #: The request waited for a migration slot: ``taken`` once it got one,
    #: ``timed_out`` when it ended at ``--migration-wait``; ``None``: no wait.
    migration_wait: str | None = None
    response_started: bool = False
    response_complete: bool = False
    #: Admission (``--admission``): seconds the request waited in its queue
    #: (``None``: it never queued), its priority class, tenant and group id,
    #: and why it was shed or cut (``queue_depth``, ``wait``, ``deadline``, ...).
    queue_s: float | None = None
    priority_class: str | None = None
    tenant: str | None = None
    group_id: str | None = None
    shed_reason: str | None = None
    #: An item of a request that carried several: the request's id, the
    #: item's index in its answer, and how many items it carried.
    batch_id: str | None = None
    batch_index: int | None = None
    batch_size: int | None = None
    #: A request with several items refused as a whole before any of them
    #: ran, recorded once: how many items it carried.
    item_count: int | None = None
    #: For a request with items: makes their states, each recorded in
    #: place of this one (see :mod:`asgi_generate.request.batches`).
    expand: Callable[[], list["RequestState"]] | None = None
