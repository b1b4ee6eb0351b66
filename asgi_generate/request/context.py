"""What one request needs from the process that serves it.

The request package never imports the server: the app hands every request
a :class:`RequestContext` (in the spirit of hypercorn's ``WorkerContext``,
``hypercorn/typing.py``), and tests hand it a small fake.
:class:`asgi_generate.server.app.App` is the one in production, with an
:class:`asgi_generate.ops.recorder.Recorder` as its :class:`Recorder`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

if TYPE_CHECKING:
    from ..config import Settings
    from ..sdk._codec import Codec
    from ..tracing.otlp import Otlp
    from ..workers.router import Router, Worker
    from ..tracing.state import RequestState
    from .budget import BodyBudget
    from .gate import Admission
    from .migrations import MigrationSlots
    from .watchdog import Watchdog


class Recorder(Protocol):
    """Where a request's life is counted and its records go.

    Attributes:
        otel: OpenTelemetry export (``--otlp-endpoint``), which stamps each
            engine leg with a ``traceparent``; ``None`` (no work at all) when off.
        trace_output_ids: whether requests keep the output ids they
            delivered (only a trace parser reads them).
    """

    otel: Otlp | None
    trace_output_ids: bool

    def request_started(self) -> None:
        """Called once per request the handler accepts, before anything else."""

    def request_ended(self, st: RequestState) -> None:
        """Called once per request :meth:`request_started` counted, with its
        state, when its records are handed over (before
        :meth:`request_finished` or :meth:`items_finished`)."""

    def request_finished(self, st: RequestState) -> None:
        """Called once for a request of one item on the handler's way out;
        takes ``st`` for the counters, metrics and trace writer."""

    def inter_token_latency(self, fmt: str) -> Callable[[float], None]:
        """Where the streams of format ``fmt`` count the seconds between
        two of their token events, per event as the client is sent it (the
        callable is O(1) and keeps nothing per call)."""

    async def items_finished(self, states: Sequence[RequestState]) -> None:
        """Called once for a request with several items, with each item's
        state; may wait (after the answer was sent) while the trace writer
        catches up, so that one request's items do not crowd out other
        requests' records."""


class Running(Protocol):
    """A request being generated, as the process sees it: what a shutdown
    stops and an admin abort looks up by public id
    (:class:`~asgi_generate.request.generation.Generation`)."""

    codec: Codec
    st: RequestState

    def cancel_for_shutdown(self) -> None:
        """Stop the request because the server is shutting down; its
        handler then ends the answer cleanly and aborts the engine."""


class RequestContext(Protocol):
    """The process as a request sees it.

    Attributes:
        settings: the configuration.
        router: picks workers and tracks their health.
        recorder: counts requests and takes their records.
        watchdog: the client timers of requests served without a guard task.
        body_budget: request body bytes being read and decoded at once.
        migrations: the slots of migrated streams running at once.
        admission: the admission queues (``--admission``), ``None`` when off.
        inflight: requests being generated, by minted id (the handler adds
            and removes them).
        open_requests: every request from its start to its record (its
            aborts included), by minted id.
        shutting_down: new requests get 503 (set on SIGTERM/SIGINT).
    """

    settings: Settings
    router: Router
    recorder: Recorder
    watchdog: Watchdog
    body_budget: BodyBudget
    migrations: MigrationSlots
    admission: Admission | None
    inflight: dict[str, Running]
    open_requests: dict[str, RequestState]
    shutting_down: bool

    async def abort_engine_request(self, worker: Worker, engine_id: str) -> str:
        """Ask ``worker``'s engine to abort ``engine_id`` and wait for the
        outcome: ``"acked"``, ``"unacknowledged"`` or ``"lost"`` (the worker
        is down or went away; :mod:`asgi_generate.workers.aborts`)."""
