"""Prometheus metrics of the frontend, served as ``GET /metrics``.

Everything a request contributes is counted once, when it ends, from its
finished :class:`~asgi_generate.tracing.state.RequestState` (O(1) per request,
O(legs) for the per-leg counters), except the gaps between a stream's token
events, observed as the client is sent each event (:class:`Gaps`: O(1), into
counts kept per format, no object kept per event); aborts and trace records
are counted where they happen. A request's counts are plain
additions (a few dict updates, no lock, no prometheus-client call), moved
into the prometheus-client metrics when ``/metrics`` is scraped, and, with
several processes, every :data:`REFRESH_S` seconds and whenever a sibling's
scrape asks (:mod:`asgi_generate.ops.siblings`). Worker gauges are read from
the router at the same moments.

Names and histogram buckets follow the engines' own metrics where ours
measure the same thing (vLLM ``vllm/v1/metrics/loggers.py``
``PrometheusStatLogger``: ``time_to_first_token_seconds``,
``request_time_per_output_token_seconds``, ``e2e_request_latency_seconds``,
``inter_token_latency_seconds``, ``prompt_tokens_total``,
``generation_tokens_total``; SGLang
``srt/metrics/collector.py`` uses the same names), with the
``asgi_generate_`` prefix. docs/fleet/metrics.md lists every one.

Several processes (``serve --workers N``, ``hypercorn -w N``) are merged with
prometheus-client's multiprocess mode: each process writes its values to
files under ``PROMETHEUS_MULTIPROC_DIR`` and a scrape of any of them reads
all of them, once it had every other process move its counts into its files
(:mod:`asgi_generate.ops.siblings`). The variable must name an empty folder
before the processes start (``serve`` makes and removes one itself). A
process killed outright (SIGKILL) loses what it counted since its last
move, at most :data:`REFRESH_S` seconds' worth.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from ..exceptions import MetricsSetupError
from ..tracing.state import RequestState
from ..request.framing import Send, send_unary
from . import siblings

if TYPE_CHECKING:
    from ..workers.router import Router

#: The folder prometheus-client's multiprocess mode keeps its files in.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Seconds between moves of each process's counts (and worker gauges) into
#: the shared files, when several processes serve.
REFRESH_S = 1.0
# vLLM's buckets (vllm/v1/metrics/buckets.py): TTFT from 1 ms to 2560 s
# (queueing included), inter-token latency (also per request, mean time per
# output token) from 10 ms to 80 s, end to end up to 7680 s (long rollouts).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
#: Leg outcomes counted as a failure of the leg's worker.
WORKER_FAILURES = frozenset({"connect_failed", "worker_lost", "error", "timeout"})
#: Abort results (:mod:`asgi_generate.workers.aborts`) as the label says them.
ABORT_RESULTS = {"acked": "acknowledged", "unacknowledged": "unacknowledged", "lost": "worker_lost"}
WORKER_LABELS = ("worker", "url", "protocol", "role")


def multiproc_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` when set (multiprocess mode), else ``None``.

    Raises:
        MetricsSetupError: it is set but names no folder, or one whose path
            is too long for the processes' sockets
            (:func:`asgi_generate.ops.siblings.folder_problem`).
    """
    folder = os.environ.get(MULTIPROC_ENV) or None
    if folder is not None and not os.path.isdir(folder):
        raise MetricsSetupError(f"{MULTIPROC_ENV}={folder!r} is not a folder")
    problem = None if folder is None else siblings.folder_problem(folder)
    if problem is not None:
        raise MetricsSetupError(f"{MULTIPROC_ENV}: {problem}")
    return folder


class _Children(dict):
    """Label values (a tuple, or one string) -> the metric's child, looked up
    once: ``labels()`` takes a lock and checks the values on every call.

    ``pending`` holds what ended requests added since the last
    :meth:`flush` (a plain addition per request: no lock, no
    prometheus-client call); for a histogram (``bounds`` given), per label
    values, the count per bucket, then the sum of the observations: a list
    kept across flushes (zeroed in place), so a :class:`Gaps` can hold it."""

    __slots__ = ("metric", "bounds", "pending")

    def __init__(self, metric, bounds: tuple[float, ...] | None = None) -> None:
        super().__init__()
        self.metric = metric
        self.bounds = bounds
        self.pending: dict = {}

    def __missing__(self, key):
        child = self[key] = self.metric.labels(*key) if isinstance(key, tuple) else self.metric.labels(key)
        return child

    def add(self, key, amount: float) -> None:
        """Count ``amount`` more for the label values ``key``."""
        pending = self.pending
        pending[key] = pending.get(key, 0) + amount

    def slot(self, key) -> list:
        """The pending counts per bucket, then sum, of the label values
        ``key`` (a histogram)."""
        slot = self.pending.get(key)
        if slot is None:
            slot = self.pending[key] = [0] * (len(self.bounds) + 1) + [0.0]
        return slot

    def observe(self, key, value: float) -> None:
        """Observe ``value`` for the label values ``key`` (a histogram)."""
        slot = self.slot(key)
        slot[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        slot[-1] += value

    def flush(self) -> None:
        """Move what is pending into the metric."""
        if self.bounds is None:
            pending, self.pending = self.pending, {}
            for key, amount in pending.items():
                self[key].inc(amount)
            return
        # prometheus-client's Histogram keeps one value per bucket (not
        # cumulative; its buckets end with +Inf) in ``_buckets`` and the sum
        # in ``_sum`` (see its ``observe``): a batch goes in the same way.
        for key, slot in self.pending.items():
            if not any(slot):
                continue
            child = self[key]
            for i, (bucket, count) in enumerate(zip(child._buckets, slot)):
                if count:
                    bucket.inc(count)
                    slot[i] = 0
            child._sum.inc(slot[-1])
            slot[-1] = 0.0


class Gaps:
    """One format's inter-token latency: ``observe(seconds)`` counts a gap
    between two token events of a stream into the bucket counts that
    ``/metrics`` moves into the histogram (O(log buckets), no object kept)."""

    __slots__ = ("slot", "bounds")

    def __init__(self, slot: list, bounds: tuple[float, ...]) -> None:
        self.slot = slot
        self.bounds = bounds

    def observe(self, seconds: float) -> None:
        """Count one gap of ``seconds``."""
        slot = self.slot
        slot[bisect_left(self.bounds, seconds)] += 1
        slot[-1] += seconds


class Metrics:
    """One process's metrics.

    Without ``PROMETHEUS_MULTIPROC_DIR`` the values live in this object's
    own registry (so several apps in one process never mix); with it they
    live in that folder's files and a scrape merges every process's.

    Raises:
        MetricsSetupError: ``PROMETHEUS_MULTIPROC_DIR`` is set but is not a folder.
    """

    def __init__(self) -> None:
        self.multiproc_dir = multiproc_dir()
        # A _created sample per series doubles the output for nothing a
        # dashboard reads (and multiprocess mode has none).
        prometheus_client.disable_created_metrics()
        reg = None if self.multiproc_dir else CollectorRegistry()
        self.registry = reg
        p = "asgi_generate_"
        self.requests = Counter(p + "requests_total", "Request items ended (one per trace record: a batch's "
                                "prompts and each of n samples count one each), by format, route, outcome "
                                "(status) and the HTTP status sent (code, empty when none was).",
                                ("format", "route", "status", "code"), registry=reg)
        self.http_requests = Counter(p + "http_requests_total", "HTTP requests on codec routes ended (a batch or "
                                     "n > 1 counts once), by format, route and the HTTP status sent (code, empty "
                                     "when none was).", ("format", "route", "code"), registry=reg)
        self.in_flight = Gauge(p + "requests_in_flight", "Requests accepted and not yet ended.",
                               registry=reg, multiprocess_mode="livesum")
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from a streamed request's arrival to "
                              "its first token sent.", ("format",), buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram(p + "request_time_per_output_token_seconds", "Mean inter-token latency of each "
                              "streamed request with at least two tokens: (last token - first token) / "
                              "(tokens - 1), observed once per request.", ("format",), buckets=ITL_BUCKETS,
                              registry=reg)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between two token-bearing events of a "
                             "stream as the frontend hands them to the client (one event may carry several "
                             "tokens), observed per event.", ("format",), buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Time from a request's arrival to its end, "
                             "every outcome.", ("format",), buckets=E2E_BUCKETS, registry=reg)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of ended requests (when known).",
                                     ("format",), registry=reg)
        self.generation_tokens = Counter(p + "generation_tokens_total", "Output tokens sent to clients.",
                                         ("format",), registry=reg)
        self.body_bytes = Counter(p + "request_body_bytes_total", "Request body bytes read.", ("format",),
                                  registry=reg)
        self.migrations = Counter(p + "migrations_total", "Streams resumed on another worker.", ("format",),
                                  registry=reg)
        self.migration_waits = Counter(p + "migration_waits_total", "Streams that waited for a "
                                       "--max-concurrent-migrations slot, by result (taken, timed_out: ended "
                                       "with the format's error).", ("format", "result"), registry=reg)
        self.legs = Counter(p + "engine_legs_total", "Engine legs by role (aggregated, prefill, decode, "
                            "resumed) and outcome.", ("role", "outcome"), registry=reg)
        self.aborts = Counter(p + "aborts_total", "Engine aborts sent, by result (acknowledged, "
                              "unacknowledged, worker_lost).", ("result",), registry=reg)
        self.worker_up = Gauge(p + "worker_up", "1 while the worker is in the rotation, else 0.",
                               WORKER_LABELS, registry=reg, multiprocess_mode="livemostrecent")
        self.worker_outstanding = Gauge(p + "worker_outstanding_requests", "Engine legs in flight on the worker.",
                                        WORKER_LABELS, registry=reg, multiprocess_mode="livesum")
        self.worker_weight_version = Gauge(p + "worker_weight_version_info", "1 for the weight version the "
                                           "worker serves (empty when unknown).", (*WORKER_LABELS, "weight_version"),
                                           registry=reg, multiprocess_mode="livemostrecent")
        self.worker_fenced = Gauge(p + "worker_fenced", "1 while the worker is fenced out of the rotation for a "
                                   "failed weight update.", WORKER_LABELS, registry=reg,
                                   multiprocess_mode="livemostrecent")
        self.worker_failed_updates = Gauge(p + "worker_weight_update_failures", "Weight updates the worker failed "
                                           "(since the process started).", WORKER_LABELS, registry=reg,
                                           multiprocess_mode="livemostrecent")
        self.worker_failures = Counter(p + "worker_failures_total", "Engine legs that failed on the worker, by "
                                       "reason (connect_failed, worker_lost, error, timeout).",
                                       ("worker", "url", "reason"), registry=reg)
        self.kv = Gauge(p + "kv_events", "kv-aware policy, per worker: KV event batches, events, gaps, replays, "
                        "rebuilds and restarts seen, blocks in its index (index_blocks), blocks predicted and "
                        "confirmed.", ("worker", "url", "quantity"), registry=reg,
                        multiprocess_mode="livemostrecent")
        self.admission_waiting = Gauge(p + "admission_waiting_requests", "Admission: requests waiting in the "
                                       "queue, by worker protocol, priority class and tenant.",
                                       ("protocol", "class", "tenant"), registry=reg, multiprocess_mode="livesum")
        self.admission_held = Gauge(p + "admission_slots_held", "Admission: engine sequences admitted and not "
                                    "yet ended (slots held), by worker protocol and priority class.",
                                    ("protocol", "class"), registry=reg, multiprocess_mode="livesum")
        self.admission_room = Gauge(p + "admission_room_sequences", "Admission: the fleet's room in engine "
                                    "sequences as this process judges it (free now, capacity of the up workers).",
                                    ("protocol", "quantity"), registry=reg, multiprocess_mode="livesum")
        self.admission_admitted = Counter(p + "admission_admitted_total", "Admission: requests admitted, by "
                                          "worker protocol, priority class and tenant.",
                                          ("protocol", "class", "tenant"), registry=reg)
        self.admission_wait = Counter(p + "admission_wait_seconds_total", "Admission: seconds admitted "
                                      "requests waited in the queue, by worker protocol, priority class and tenant "
                                      "(divide by admission_admitted_total for the mean).",
                                      ("protocol", "class", "tenant"), registry=reg)
        self.admission_shed = Counter(p + "admission_shed_total", "Admission: requests shed (429 or 503), by "
                                      "worker protocol, priority class and reason.",
                                      ("protocol", "class", "reason"), registry=reg)
        self.admission_tenant_shed = Counter(p + "admission_tenant_shed_total", "Admission: requests shed, by "
                                             "worker protocol, priority class and tenant.",
                                             ("protocol", "class", "tenant"), registry=reg)
        self.admission_deadline_cuts = Counter(p + "admission_deadline_cuts_total", "Admission: streams still "
                                               "running at their deadline, ended with the engine's abort finish.",
                                               registry=reg)
        self.admission_preemptions = Counter(p + "admission_preemptions_total", "Admission: streams preempted for a "
                                             "higher class (aborted on the engine, parked).", registry=reg)
        self.admission_resumed_parked = Counter(p + "admission_resumed_parked_total", "Admission: parked streams "
                                                "resumed exactly as migrated legs.", registry=reg)
        self.admission_parked = Gauge(p + "admission_parked_streams", "Admission: preempted streams parked now.",
                                      registry=reg, multiprocess_mode="livesum")
        self.engine_requests = Gauge(p + "engine_requests", "The engine's own count of requests running plus "
                                     "waiting at admission's last reading, per worker.", ("worker",),
                                     registry=reg, multiprocess_mode="max")
        self.engine_waiting_tokens = Gauge(p + "engine_waiting_tokens", "Uncached prompt tokens waiting for "
                                           "prefill at admission's last reading (SGLang; 0 where the engine "
                                           "reports none), per worker.", ("worker",), registry=reg,
                                           multiprocess_mode="max")
        self.engine_kv_usage = Gauge(p + "engine_kv_usage", "The engine's KV cache usage (a fraction) at "
                                     "admission's last reading, where it reports one, per worker.", ("worker",),
                                     registry=reg, multiprocess_mode="max")
        self.trace_written = Counter(p + "trace_records_written_total", "Request-end records written, by sink.",
                                     ("sink",), registry=reg)
        self.trace_dropped = Counter(p + "trace_records_dropped_total", "Request-end records lost, by cause "
                                     "(queue_full, sink_error, build_error, closed).", ("cause",), registry=reg)
        self.connections_closed = Counter(p + "connections_closed_total", "Client connections closed before a "
                                          "request reached the app, by reason (ambiguous_framing: a request "
                                          "head refused for its framing; header_timeout: a request head not "
                                          "complete at its deadline).", ("reason",), registry=reg)
        #: The process's running counts of :attr:`connections_closed` by
        #: reason, kept by the server (:attr:`closed_source`), and how much
        #: of each the counter holds already.
        self.closed_source: dict[str, int] = {}
        self._closed_moved: dict[str, int] = {}
        #: Admission's ``/stats`` block (:meth:`asgi_generate.request.gate.Admission.stats`)
        #: when ``--admission`` is on, read at each refresh; the totals it
        #: held when last moved into the counters.
        self.admission_source: Callable[[], dict] | None = None
        self._admission_moved: dict[tuple, float] = {}

        self._requests, self._http_requests, self._prompt, self._generation, self._body, self._migrations, \
            self._migration_waits, self._legs, self._failures, self._aborts = map(_Children, (
                self.requests, self.http_requests, self.prompt_tokens, self.generation_tokens, self.body_bytes,
                self.migrations, self.migration_waits, self.legs, self.worker_failures, self.aborts))
        self._ttft = _Children(self.ttft, TTFT_BUCKETS)
        self._tpot = _Children(self.tpot, ITL_BUCKETS)
        self._itl = _Children(self.itl, ITL_BUCKETS)
        #: Each format's :class:`Gaps`, made once.
        self._gaps: dict[str, Gaps] = {}
        self._e2e = _Children(self.e2e, E2E_BUCKETS)
        #: What request ends counted, moved into the metrics by :meth:`flush`.
        self._counted = (self._requests, self._http_requests, self._prompt, self._generation, self._body, self._migrations,
                         self._migration_waits, self._legs, self._failures, self._aborts, self._ttft, self._tpot, self._itl,
                         self._e2e)
        #: Requests started minus ended since the last :meth:`flush`.
        self._in_flight = 0

    # -- updates -------------------------------------------------------------

    def request_started(self) -> None:
        """A request was accepted (its end calls :meth:`request_ended`)."""
        self._in_flight += 1

    def request_ended(self, st: RequestState) -> None:
        """The request of ``st``, accepted by :meth:`request_started`, ended:
        counted once as an HTTP request, also when it carried several
        items (each counted by :meth:`request_finished`)."""
        self._http_requests.add((st.format, st.route, "" if st.http_status is None else str(st.http_status)), 1)
        self._in_flight -= 1

    def flush(self) -> None:
        """Move what requests counted into the metrics (a scrape calls it;
        with several processes :meth:`run` does too)."""
        for children in self._counted:
            if children.pending:
                children.flush()
        if self._in_flight:
            self.in_flight.inc(self._in_flight)
            self._in_flight = 0
        for reason, count in self.closed_source.items():
            moved = self._closed_moved.get(reason)
            if moved is None or count > moved:  # every reason shows, 0 included
                self.connections_closed.labels(reason).inc(count - (moved or 0))
                self._closed_moved[reason] = count

    def request_finished(self, st: RequestState) -> None:
        """Count a finished request, or an item of one (``t_done`` and
        ``status`` set)."""
        fmt = st.format
        self._requests.add((fmt, st.route, st.status or "unknown",
                            "" if st.http_status is None else str(st.http_status)), 1)
        self._e2e.observe(fmt, st.t_done - st.t_received)
        first, n = st.t_first_token, st.output_tokens
        if first is not None:
            self._ttft.observe(fmt, first - st.t_received)
            if n > 1 and st.t_last_token is not None:
                self._tpot.observe(fmt, (st.t_last_token - first) / (n - 1))
        prompt = st.input_length if st.input_length is not None else st.prompt_tokens
        if prompt:
            self._prompt.add(fmt, prompt)
        if n:
            self._generation.add(fmt, n)
        if st.body_bytes:
            self._body.add(fmt, st.body_bytes)
        if st.migrations:
            self._migrations.add(fmt, st.migrations)
        if st.migration_wait is not None:
            self._migration_waits.add((fmt, st.migration_wait), 1)
        for a in st.attempts:
            outcome = a.outcome or "none"
            self._legs.add((a.role, outcome), 1)
            if outcome in WORKER_FAILURES:
                self._failures.add((a.worker_id, getattr(a.worker, "url", ""), outcome), 1)

    def gaps(self, fmt: str) -> Gaps:
        """The inter-token latency of format ``fmt``, for its streams to
        observe per event (moved into the histogram with the rest)."""
        gaps = self._gaps.get(fmt)
        if gaps is None:
            gaps = self._gaps[fmt] = Gaps(self._itl.slot(fmt), ITL_BUCKETS)
        return gaps

    def abort(self, result: str) -> None:
        """Count one abort and its result (``acked``, ``unacknowledged``, ``lost``)."""
        self._aborts.add(ABORT_RESULTS[result], 1)

    def refresh(self, router: Router) -> None:
        """Set the worker gauges from ``router``'s workers; move the ended
        requests' counts into the metrics."""
        self.flush()
        if self.registry is not None:  # one process: exactly the workers there are now
            for gauge in (self.worker_up, self.worker_outstanding, self.worker_weight_version, self.worker_fenced,
                          self.worker_failed_updates, self.kv):
                gauge.clear()
        urls = {}
        for w in router.workers:
            labels = (w.id, w.url, w.protocol.name, w.role)
            urls[w.id] = w.url
            self.worker_up.labels(*labels).set(1 if router.routable(w) and not w.draining else 0)
            self.worker_outstanding.labels(*labels).set(w.outstanding)
            self.worker_weight_version.labels(*labels, w.weight_version or "").set(1)
            self.worker_fenced.labels(*labels).set(0 if w.fence is None else 1)
            self.worker_failed_updates.labels(*labels).set(w.failed_updates)
        for wid, quantity, value in router.policy.metrics():
            if wid in urls:
                self.kv.labels(wid, urls[wid], quantity).set(value)
        if self.admission_source is not None:
            self._admission(self.admission_source())

    def _admission(self, stats: dict) -> None:
        """Admission's gauges now, and its totals' growth into the counters."""
        if self.registry is not None:
            for gauge in (self.admission_waiting, self.admission_held, self.admission_room, self.engine_requests,
                          self.engine_waiting_tokens, self.engine_kv_usage):
                gauge.clear()
        for protocol, block in stats["protocols"].items():
            for quantity in ("free", "capacity"):
                self.admission_room.labels(protocol, quantity).set(block["room"][quantity])
            for cls, row in block["classes"].items():
                self.admission_held.labels(protocol, cls).set(row["held"])
                for reason, count in row["shed"].items():
                    self._move(self.admission_shed, (protocol, cls, reason), count)
                for tenant, t in row["tenants"].items():
                    labels = (protocol, cls, tenant)
                    self.admission_waiting.labels(*labels).set(t["waiting"])
                    self._move(self.admission_admitted, labels, t["admitted"])
                    self._move(self.admission_wait, labels, t["wait_seconds_total"])
                    self._move(self.admission_tenant_shed, labels, t["shed"])
        self._move(self.admission_deadline_cuts, (), stats["deadline_cuts"])
        self._move(self.admission_preemptions, (), stats["preemptions"])
        self._move(self.admission_resumed_parked, (), stats["resumed_parked"])
        self.admission_parked.set(stats["parked"])
        for wid, reading in stats["saturation"]["workers"].items():
            if "engine_requests" in reading:
                self.engine_requests.labels(wid).set(reading["engine_requests"])
                self.engine_waiting_tokens.labels(wid).set(reading["waiting_tokens"])
                if reading["kv_usage"] is not None:
                    self.engine_kv_usage.labels(wid).set(reading["kv_usage"])

    def _move(self, counter: Counter, labels: tuple, total: float) -> None:
        """Raise ``counter``'s child of ``labels`` to ``total`` (a running total kept elsewhere)."""
        key = (id(counter), *labels)
        moved = self._admission_moved.get(key, 0)
        if key not in self._admission_moved or total > moved:
            child = counter.labels(*labels) if labels else counter
            child.inc(max(0, total - moved))
            self._admission_moved[key] = max(total, moved)

    async def run(self, router: Router, on_message: Callable[[dict[str, Any]], Awaitable[None] | None] | None = None,
                  *,
                  task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Several processes, until cancelled: :meth:`refresh` every
        :data:`REFRESH_S` seconds and whenever a sibling's scrape asks
        (:func:`asgi_generate.ops.siblings.answer`, which hands siblings'
        other messages to ``on_message``); reports started once
        siblings can ask; a last :meth:`flush` when cancelled (the end of
        the lifespan), so a process that stops leaves all its counts.

        Raises:
            OSError: this process's socket cannot be made.
        """
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(siblings.answer, self.multiproc_dir, lambda: self.refresh(router), on_message)
                task_status.started()
                while True:
                    self.refresh(router)
                    await anyio.sleep(REFRESH_S)
        finally:
            self.flush()

    # -- the route -------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text format of every metric (all processes' in
        multiprocess mode)."""
        registry = self.registry
        if registry is None:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, self.multiproc_dir)
        return prometheus_client.generate_latest(registry)

    async def serve(self, router: Router, send: Send) -> None:
        """Answer ``GET /metrics``: refresh this process's values (and,
        with several processes, have the others refresh theirs:
        :func:`asgi_generate.ops.siblings.ask`), then render in a worker
        thread (multiprocess mode reads every process's files)."""
        self.refresh(router)
        if self.multiproc_dir is not None:
            await siblings.ask(self.multiproc_dir)
        body = await anyio.to_thread.run_sync(self.render)
        await send_unary(send, 200, body, prometheus_client.CONTENT_TYPE_LATEST.encode())
