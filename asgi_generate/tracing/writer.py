"""The trace writer: a bounded queue in front of one task that builds,
serializes and writes request-end records, off the response path.

The handler's only trace work is :meth:`Tracer.submit`, a non-blocking put of
the finished request (:class:`~.state.RequestState`). The writer task
(run in the app's lifespan task group) takes what gathered in the queue over
``GATHER_S`` seconds (at once when a batch's worth waits) and, in a worker
thread, builds the records (hashing, decoding, parsing), serializes them
with orjson and hands each sink the batch as one write, so a record reaches
the sinks about 0.1 s after its request ended.

A request with several items (a batch, ``n`` > 1) hands its records over
together (:meth:`Tracer.submit_items`) under back-pressure: they may fill
only half the queue, and wait there for the writer (at most
``ITEMS_WAIT_S``), after the request's answer was sent. The other half is
kept for the single records of every other request, which never wait, so
one request's items cannot push out the rest.

Losses are counted by cause, shown in ``/stats``, logged as a warning when
they start (then at most every ``DROP_LOG_S`` seconds) and at shutdown:

- ``queue_full``: the queue held ``--trace-queue-size`` records (for a
  request's items: half of it, for ``ITEMS_WAIT_S``);
- ``sink_error``: a sink failed to write (counted per sink and record);
- ``build_error``: building the record raised (a bug; logged);
- ``closed``: the request ended after the writer was closed or cancelled.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import anyio
import orjson

from ..config import Settings
from ..exceptions import ParserError, TraceSetupError
from .analysis import OutputAnalyzer
from .record import build_record
from .sinks import JsonlFileSink, Sink, StderrSink
from .state import RequestState

log = logging.getLogger("asgi_generate.tracing")
#: Records per writer-thread hop, at most.
BATCH = 1024
#: Seconds the writer lets records gather after the first of a batch: one
#: thread hop and one write per batch instead of per request.
GATHER_S = 0.1
#: Seconds a request's items may wait in all for room in their half of the
#: queue before the rest are dropped (the writer empties a full default
#: queue in well under a second).
ITEMS_WAIT_S = 10.0
#: Seconds between warnings while records are being dropped.
DROP_LOG_S = 60.0


class Tracer:
    """Request-end tracing for one server process.

    Args:
        settings: uses ``trace_file``, ``trace_stderr``, ``otlp_endpoint``,
            ``trace_otlp``, ``trace_queue_size``, ``trace_rotate_bytes``,
            ``trace_block_size``, ``tokenizer``, ``reasoning_parser`` and
            ``tool_call_parser``.

    Raises:
        TraceSetupError: no sink is configured; a size is below 1; a parser
            is named without ``tokenizer``; the tokenizer or a parser fails
            to load.

    Attributes:
        wants_output_ids: the handler must keep the delivered output ids
            (a parser will read them).
        otlp: with ``otlp_endpoint``, the OpenTelemetry exporter
            (:class:`~asgi_generate.tracing.otlp.Otlp`), whose span and log
            sinks are among :attr:`sinks`; else ``None``.
    """

    def __init__(self, settings: Settings) -> None:
        if not (settings.trace_file or settings.trace_stderr or settings.otlp_endpoint):
            raise TraceSetupError("tracing needs --trace-file, --trace-stderr or --otlp-endpoint")
        if settings.trace_queue_size < 1 or settings.trace_block_size < 1 or settings.trace_rotate_bytes < 0:
            raise TraceSetupError(
                "--trace-queue-size and --trace-block-size must be at least 1, --trace-rotate-bytes at least 0"
            )
        parsers = settings.reasoning_parser or settings.tool_call_parser
        if parsers and not settings.tokenizer:
            raise TraceSetupError("--reasoning-parser and --tool-call-parser need --tokenizer")
        self.analyzer: OutputAnalyzer | None = None
        if parsers:
            try:
                self.analyzer = OutputAnalyzer(
                    settings.tokenizer, settings.reasoning_parser, settings.tool_call_parser
                )
            except ParserError as exc:
                raise TraceSetupError(str(exc)) from None
        self.wants_output_ids = self.analyzer is not None
        self.block_size = settings.trace_block_size
        self.sinks: list[Sink] = []
        if settings.trace_file:
            self.sinks.append(JsonlFileSink(settings.trace_file, settings.trace_rotate_bytes))
        if settings.trace_stderr:
            self.sinks.append(StderrSink())
        self.otlp = None
        if settings.otlp_endpoint:
            try:
                from .otlp import LogSink, Otlp, SpanSink
            except ImportError as exc:
                raise TraceSetupError(f"--otlp-endpoint needs the OpenTelemetry SDK and its OTLP exporter "
                                      f"(pip install 'asgi-generate[otlp]'): {exc}") from None
            self.otlp = Otlp(settings)
            self.sinks.append(SpanSink(self.otlp))
            if settings.trace_otlp:
                self.sinks.append(LogSink(self.otlp))
        self._send, self._receive = anyio.create_memory_object_stream[RequestState](settings.trace_queue_size)
        #: Records a request's items may fill the queue up to (half of it).
        self.items_share = max(1, settings.trace_queue_size // 2)
        #: Set (then replaced) each time the writer takes records off the queue.
        self._taken: anyio.Event | None = None  # made in run(): events need a running loop
        self._next_drop_log = 0.0
        self.submitted = 0
        self.records = 0
        self.dropped = {"queue_full": 0, "sink_error": 0, "build_error": 0, "closed": 0}
        #: The app's :class:`~asgi_generate.ops.metrics.Metrics`, told of every
        #: record written and lost (set by :class:`~asgi_generate.ops.recorder.Recorder`).
        self.metrics = None
        self._running = False
        self._closing = False
        self._done: anyio.Event | None = None  # made in run(): events need a running loop

    def submit(self, st: RequestState) -> None:
        """Queue a finished request without waiting; count it if dropped."""
        self.submitted += 1
        try:
            self._send.send_nowait(st)
        except anyio.WouldBlock:
            self._drop("queue_full")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._drop("closed")

    async def submit_items(self, states: Sequence[RequestState]) -> None:
        """Queue one request's records (its items), back-pressured: each
        waits while the queue holds :attr:`items_share` records or more, for
        at most ``ITEMS_WAIT_S`` in all, shielded from cancellation (the
        answer is sent by now); the rest are then dropped as ``queue_full``
        (``closed`` once the writer is closed), and counted."""
        self.submitted += len(states)
        put = 0
        with anyio.CancelScope(shield=True), anyio.move_on_after(ITEMS_WAIT_S):
            for st in states:
                while (self._running and not self._closing
                       and self._send.statistics().current_buffer_used >= self.items_share):
                    await self._taken.wait()
                try:
                    self._send.send_nowait(st)
                except anyio.WouldBlock:  # no writer to wait for
                    break
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    self._drop("closed", len(states) - put)
                    return
                put += 1
        if put < len(states):
            self._drop("queue_full", len(states) - put)

    def _drop(self, cause: str, n: int = 1) -> None:
        self.dropped[cause] += n
        if self.metrics is not None:
            self.metrics.trace_dropped.labels(cause).inc(n)
        now = time.monotonic()
        if now >= self._next_drop_log:  # at the first loss, then at most every DROP_LOG_S
            self._next_drop_log = now + DROP_LOG_S
            log.warning("trace: dropping records (%d %s now); dropped so far %s; see /stats trace",
                        n, cause, dict(self.dropped))

    def _wake_submitters(self) -> None:
        if self._taken is not None:
            self._taken.set()
            self._taken = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Open the sinks, report started, then write until :meth:`close`.

        Raises:
            OSError: a sink cannot be opened (before ``started``).
        """
        self._running = True
        self._done = anyio.Event()
        self._taken = anyio.Event()
        try:
            for sink in self.sinks:
                await anyio.to_thread.run_sync(sink.open)
            task_status.started()
            async for first in self._receive:
                batch = [first]
                if not self._closing and self._receive.statistics().current_buffer_used < BATCH:
                    with anyio.CancelScope(shield=True):  # ``first`` is off the queue: keep it
                        await anyio.sleep(GATHER_S)
                while len(batch) < BATCH:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                self._wake_submitters()
                # Not cancellable: a batch taken off the queue gets written.
                await anyio.to_thread.run_sync(self._write_batch, batch)
        finally:
            self._running = False
            self._drop_queued()
            self._wake_submitters()
            self._done.set()

    async def close(self) -> None:
        """Stop taking records, let the writer flush every queued one, close
        the sinks and log the totals (a warning if any record was lost)."""
        self._closing = True
        self._send.close()
        self._wake_submitters()
        if self._running:
            await self._done.wait()
        else:
            self._drop_queued()
        for sink in self.sinks:
            sink.close()
        lost = sum(self.dropped.values())
        log.log(
            logging.WARNING if lost else logging.INFO,
            "trace: %d requests, %d records, dropped %s, sinks %s",
            self.submitted, self.records, self.dropped, {s.name: s.describe() for s in self.sinks},
        )

    def _drop_queued(self) -> None:
        # Still queued when the writer stops (cancelled, or never started):
        # lost, so counted; later submits fail and are counted the same way.
        while True:
            try:
                self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
            self._drop("closed")
        self._receive.close()

    def _write_batch(self, batch: list[RequestState]) -> None:
        built = []
        for st in batch:
            try:
                rec = build_record(st, self.block_size, self.analyzer)
                built.append((st, rec, orjson.dumps(rec)))
            except Exception:
                self._drop("build_error")
                log.exception("trace: cannot build the record of request %s", st.request_id)
        if not built:
            return
        n = len(built)
        self.records += n
        # Every line ends with a newline: the lines joined with an empty
        # last one, so the batch is copied once (``join(...) + b"\n"``
        # copies it twice: 16 records of a 16K-token prompt are 95 KB).
        data = b"\n".join([*(line for _, _, line in built), b""])
        for sink in self.sinks:
            try:
                if sink.takes_records:
                    sink.write_records(built)
                else:
                    sink.write(data)
                sink.written += n
                if self.metrics is not None:
                    self.metrics.trace_written.labels(sink.name).inc(n)
            except Exception as exc:  # OSError; anything else is a bug, still counted
                if not sink.failed:
                    log.error("trace: the %s sink failed: %r; its records are dropped and counted", sink.name, exc)
                sink.failed += n
                self._drop("sink_error", n)

    def stats(self) -> dict:
        """The ``trace`` block of ``/stats``."""
        return {
            "enabled": True,
            "submitted": self.submitted,
            "records": self.records,
            "queued": self._receive.statistics().current_buffer_used,
            "dropped": dict(self.dropped),
            "sinks": {s.name: s.describe() for s in self.sinks},
        }
