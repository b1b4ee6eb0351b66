"""What the process records of its requests: the ``/stats`` counters, the
Prometheus metrics (:mod:`.metrics`) and the hand-off to the trace writer.

Requests see it as their :class:`~asgi_generate.request.context.Recorder`;
the app shows its counters in ``/stats`` and runs its trace writer and
metrics refresh in the lifespan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from ..workers.aborts import ACKED, LOST
from .metrics import Metrics

if TYPE_CHECKING:
    from ..config import Settings
    from ..tracing.state import RequestState


class Recorder:
    """Counts requests and aborts, and hands each record to the tracer.

    Args:
        settings: the configuration; tracing is on with ``trace_file``,
            ``trace_stderr`` or ``otlp_endpoint``.

    Raises:
        TraceSetupError: the trace settings are unusable.
        MetricsSetupError: ``PROMETHEUS_MULTIPROC_DIR`` names no folder.

    Attributes:
        counters: ``/stats`` counts: ``http_requests`` (requests on a
            codec's route that ended, a batch or ``n`` > 1 once),
            ``request_items`` (their items, one per record: a batch's
            prompts and each parallel sample count one each),
            ``aborts_sent`` and their results (``aborts_acknowledged``,
            ``aborts_unacknowledged``, ``aborts_worker_lost``),
            ``migrations``, ``replays`` and ``not_migrated``, and the
            streams that waited for a migration slot and got one
            (``migration_waits_taken``) or ended at ``--migration-wait``
            (``migration_waits_timed_out``).
        by_status: request items by their record's ``status``.
        metrics: the Prometheus metrics.
        tracer: the trace writer (:class:`asgi_generate.tracing.Tracer`);
            ``None`` with tracing off, so finishing a request only counts.
        otel: OpenTelemetry export (``--otlp-endpoint``): stamps each engine
            leg with a ``traceparent``; ``None`` (no work at all) when off.
        trace_output_ids: requests keep their delivered output ids, only
            for a trace parser.
    """

    def __init__(self, settings: Settings) -> None:
        self.counters: dict[str, int] = {
            "http_requests": 0,
            "request_items": 0,
            "aborts_sent": 0,
            "aborts_acknowledged": 0,
            "aborts_unacknowledged": 0,
            "aborts_worker_lost": 0,
            "migrations": 0,
            "replays": 0,
            "not_migrated": 0,
            "migration_waits_taken": 0,
            "migration_waits_timed_out": 0,
        }
        self.by_status: dict[str, int] = {}
        self.metrics = Metrics()
        self.tracer = None
        if settings.trace_file or settings.trace_stderr or settings.otlp_endpoint:
            from ..tracing import Tracer

            self.tracer = Tracer(settings)
            self.tracer.metrics = self.metrics
        self.otel = self.tracer.otlp if self.tracer is not None else None
        self.trace_output_ids = self.tracer is not None and self.tracer.wants_output_ids

    def request_started(self) -> None:
        """Called once per request the handler accepts, before anything else."""
        self.metrics.request_started()

    def request_ended(self, st: RequestState) -> None:
        """Called once per request :meth:`request_started` counted, with its
        state (a request with items: the request's, not an item's), when
        its records are handed over (before :meth:`request_finished` or
        :meth:`items_finished`)."""
        self.counters["http_requests"] += 1
        self.metrics.request_ended(st)

    async def items_finished(self, states: Sequence[RequestState]) -> None:
        """Called once for a request with several items, with their states:
        each counted as :meth:`request_finished` counts it, their records
        handed to the trace writer together, back-pressured
        (:meth:`~asgi_generate.tracing.Tracer.submit_items`)."""
        for st in states:
            self._count(st)
        if self.tracer is not None:
            await self.tracer.submit_items(states)

    def request_finished(self, st: RequestState) -> None:
        """Called once per request of one item on the handler's way out:
        counts it and hands its record to the trace writer."""
        self._count(st)
        if self.tracer is not None:
            self.tracer.submit(st)

    def inter_token_latency(self, fmt: str) -> Callable[[float], None]:
        """The observer of format ``fmt``'s gaps between a stream's token
        events, in seconds (:meth:`Metrics.gaps`)."""
        return self.metrics.gaps(fmt).observe

    def _count(self, st: RequestState) -> None:
        counters = self.counters
        counters["request_items"] += 1
        if st.migrations or st.replays or st.not_migrated is not None:
            counters["migrations"] += st.migrations
            counters["replays"] += st.replays
            counters["not_migrated"] += st.not_migrated is not None
        if st.migration_wait is not None:
            counters["migration_waits_" + st.migration_wait] += 1
        self.metrics.request_finished(st)
        self.by_status[st.status or "unknown"] = self.by_status.get(st.status or "unknown", 0) + 1

    def abort_sent(self) -> None:
        """Count an abort request handed to a worker's abort queue."""
        self.counters["aborts_sent"] += 1

    def abort_answered(self, result: str) -> None:
        """Count an abort's result: ``acked``, ``unacknowledged`` or ``lost``
        (:mod:`asgi_generate.workers.aborts`)."""
        self.metrics.abort(result)
        if result == ACKED:
            self.counters["aborts_acknowledged"] += 1
        elif result == LOST:
            self.counters["aborts_worker_lost"] += 1
        else:
            self.counters["aborts_unacknowledged"] += 1
