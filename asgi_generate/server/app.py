"""The frontend's ASGI application.

Routes: every (method, path) a registered codec declares goes to the shared
handler; a registered path with another method gets 405 in that format's
shape. Control routes: ``GET /health`` (200 once a worker is up, else 503),
``GET /v1/models`` (models, formats and workers with their state) and
``GET /stats`` (counters) and ``GET /metrics`` (Prometheus,
:mod:`asgi_generate.ops.metrics`). Info and admin routes (``/get_model_info``,
``/flush_cache``, ...) go to :mod:`asgi_generate.ops.admin`. Anything else is 404.

The ASGI lifespan starts the embedded simulators (when no worker is
configured), probes the workers and runs the health watcher.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import AsyncExitStack
from functools import partial
from typing import Any, Awaitable, Callable, Iterable

import anyio
import orjson

from .. import hashes
from ..ops import admin, siblings
from ..tracing.state import RequestState
from ..request.context import Running
from ..sdk._codec import Codec
from ..config import Settings
from . import embedded
from .hypercorn import edge_counts, patches
from ..request.budget import BodyBudget
from ..request.migrations import MigrationSlots
from ..request.gate import Admission
from ..request.framing import Receive, Send, send_unary
from ..request.handler import handle_generate, reject_method
from ..ops.recorder import Recorder
from ..sdk._registry import LoadedCodec, load_codecs
from ..sdk._text import PromptTokenizer
from ..request.watchdog import Watchdog
from ..workers.aborts import UNACKNOWLEDGED, AbortQueue
from ..workers.policies import build_policy
from ..workers.discovery import Discovery, Resolver, resolve
from ..workers.http import tls_context
from ..workers.membership import Membership
from ..protocols import PROTOCOLS
from ..workers.router import Router, Worker

log = logging.getLogger("asgi_generate")
NOT_FOUND = orjson.dumps({"detail": "Not Found"})
#: Seconds of the server's graceful timeout kept, at a shutdown, to end the
#: requests still in flight (an engine abort and a last write each).
END_MARGIN = 1.0


class App:
    """The asgi-generate ASGI app.

    Args:
        settings: the configuration.
        codecs: the codecs to serve; by default every installed one
            (:func:`asgi_generate.sdk.load_codecs`).
        resolver: the DNS lookup of ``dns://`` workers (tests pass a fake).
        simulators: the embedded simulators serving ``settings``' workers
            when another process started them (``serve --workers N``); with
            no worker configured the app starts its own.

    Raises:
        CodecLoadError: installed codecs cannot be served together.
        TraceSetupError: the trace settings are unusable.
        MetricsSetupError: ``PROMETHEUS_MULTIPROC_DIR`` names no folder.
    """

    #: A ``send()`` that raises OSError (ASGI: the client is gone) is handled:
    #: what it carried is not counted as sent.
    handles_send_errors = True

    def __init__(
        self, settings: Settings, codecs: list[LoadedCodec] | None = None, resolver: Resolver = resolve,
        simulators: Iterable[embedded.Simulator] = (),
    ) -> None:
        self.settings = settings
        self.resolver = resolver
        self.codecs = load_codecs(settings.skip_broken_codecs, protocols=PROTOCOLS) if codecs is None else codecs
        self.routes: dict[tuple[str, str], Codec] = {}
        self.paths: dict[str, list[str]] = {}
        #: The embedded simulators by URL.
        self.simulators = {sim.url: sim for sim in simulators}
        tokenizer_path = embedded.tokenizer(settings)
        tokenizer = PromptTokenizer(tokenizer_path) if tokenizer_path else None
        for item in self.codecs:
            item.codec.max_body_bytes = settings.max_body_bytes
            item.codec.max_items = settings.max_request_items
            item.codec.tokenizer = tokenizer
            for route in item.codec.routes:
                self.routes[(route.method, route.path)] = item.codec
                self.paths.setdefault(route.path, []).append(route.method)
        self.router = Router([])
        #: One abort queue per worker id, running while the lifespan does.
        self.aborts: dict[str, AbortQueue] = {}
        self.admin = admin.build(self)
        #: Requests being generated, by minted id.
        self.inflight: dict[str, Running] = {}
        #: Every request from its start to its record (its aborts
        #: included), by its minted id.
        self.open_requests: dict[str, RequestState] = {}
        #: Client timers of the requests served without a guard task.
        self.watchdog = Watchdog()
        self.body_budget = BodyBudget(settings.body_budget_bytes)
        self.migrations = MigrationSlots(
            lambda: settings.max_concurrent_migrations or max(1, 2 * len(self.router.workers)))
        #: Admission (``--admission``), ``None`` when off.
        self.admission = Admission(settings, lambda: self.router) if settings.admission else None
        self.shutting_down = False
        self._shutdown_requested: anyio.Event | None = None
        #: ``time.monotonic()`` at which a shutdown ends what is in flight.
        self._drain_until = 0.0
        self.started_unix_ms = int(time.time() * 1000)
        #: Request and abort counters, metrics and the trace writer.
        self.recorder = Recorder(settings)
        self.recorder.metrics.closed_source = edge_counts.closed
        if self.admission is not None:
            self.recorder.metrics.admission_source = self.admission.stats
        #: Called once the lifespan has started (workers probed, simulators up).
        self.on_started: Callable[[], None] | None = None

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        await self.dispatch(scope, receive, send)

    def dispatch(self, scope: dict, receive: Receive, send: Send) -> Awaitable[None]:
        """The coroutine that answers an ASGI call (``http`` or
        ``lifespan``): for a codec's route, :func:`handle_generate`'s own.
        A plain call, so a server that awaits what it returns
        (:mod:`asgi_generate.server.hypercorn.fixes`) keeps no frame of the app's
        for an open stream's whole life (288 bytes)."""
        if scope["type"] == "http":
            codec = self.routes.get((scope["method"], scope["path"]))
            if codec is not None:
                return handle_generate(self, codec, scope, receive, send)
        return self._other_call(scope, receive, send)

    async def _other_call(self, scope: dict, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            method, path = scope["method"], scope["path"]
            try:
                if path in admin.paths():
                    await self.admin(scope, receive, send)
                else:
                    await self._other_route(method, path, scope, send)
            except OSError:  # the client left before its answer (ASGI send exception)
                pass
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _other_route(self, method: str, path: str, scope: dict, send: Send) -> None:
        """Control routes, 405 on a codec's path, 404 for the rest."""
        if path in self.paths:
            codec = self.routes[(self.paths[path][0], path)]
            await reject_method(self, codec, scope, self.paths[path], send)
        elif method == "GET" and path == "/health":
            ok = self.router.healthy_count > 0
            body = {"status": "ok" if ok else "unavailable", "healthy_workers": self.router.healthy_count}
            await send_unary(send, 200 if ok else 503, orjson.dumps(body))
        elif method == "GET" and path == "/v1/models":
            await send_unary(send, 200, orjson.dumps(self.models()))
        elif method == "GET" and path == "/stats":
            await send_unary(send, 200, orjson.dumps(self.stats()))
        elif method == "GET" and path == "/metrics":
            await self.recorder.metrics.serve(self.router, send)
        else:
            await send_unary(send, 404, NOT_FOUND)

    # -- lifespan ----------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "lifespan.startup":
            return
        started = False
        try:
            async with AsyncExitStack() as stack:
                st = self.settings
                specs, prefill, decode = st.workers, st.prefill, st.decode
                if embedded.wanted(st):
                    # Simulators for each protocol a served codec rides on,
                    # so every route answers.
                    specs, prefill, decode, simulators = await stack.enter_async_context(
                        embedded.embedded_fleet(
                            {item.codec.worker_protocol for item in self.codecs},
                            st.embedded_workers,
                            st.embedded_ttft_ms,
                            st.embedded_itl_ms,
                            st.embedded_pd,
                        )
                    )
                    self.simulators = {sim.url: sim for sim in simulators}
                elif st.tokenizer is None and st.migration_limit > 0:
                    log.warning("no --tokenizer (ASGI_GENERATE_TOKENIZER): a streamed text prompt will not "
                                "migrate when its worker dies (token-id prompts do); give the model's "
                                "tokenizer.json to resume text prompts too")
                self.router = Router(
                    [],
                    disaggregation=st.disaggregation,
                    connect_timeout=st.connect_timeout,
                    health_timeout=st.health_timeout,
                    health_failures=st.health_failures,
                    policy=build_policy(st),
                    ssl_context=tls_context(st.worker_ca_file, st.worker_insecure),
                    fleet_interval=st.fleet_state_interval,
                    fleet_paused_interval=st.fleet_state_paused_interval,
                )
                stack.push_async_callback(self.router.aclose)
                if self.admission is not None:  # a granted request goes to a worker with room
                    self.admission.attach(self.router)
                listed = [*(("aggregated", s) for s in specs), *(("prefill", s) for s in prefill),
                          *(("decode", s) for s in decode)]
                membership = Membership(
                    self.router,
                    Discovery(listed, st.workers_file, self.resolver),
                    interval=st.discovery_interval,
                    health_interval=st.health_interval,
                    busy=self._worker_busy,
                    services=self._worker_services,
                    on_remove=lambda worker: self.aborts.pop(worker.id, None),
                )
                async with anyio.create_task_group() as tg:
                    await tg.start(membership.run)
                    await tg.start(self.router.fleet.run)
                    tg.start_soon(self.watchdog.run, time.monotonic)
                    if self.admission is not None:
                        tg.start_soon(self.admission.run)
                    recorder = self.recorder
                    if recorder.tracer is not None:
                        await tg.start(recorder.tracer.run)
                    if recorder.metrics.multiproc_dir is not None:
                        await tg.start(recorder.metrics.run, self.router, self._sibling_message)
                        self.router.fleet.share = partial(siblings.tell, recorder.metrics.multiproc_dir)
                    self._shutdown_requested = anyio.Event()
                    if self.shutting_down:  # stopped while starting up
                        self._shutdown_requested.set()
                    tg.start_soon(self._drain_on_shutdown)
                    await send({"type": "lifespan.startup.complete"})
                    started = True
                    if self.on_started is not None:
                        self.on_started()
                    while (await receive())["type"] != "lifespan.shutdown":
                        pass
                    if recorder.tracer is not None:
                        await recorder.tracer.close()  # flushes every queued record
                    tg.cancel_scope.cancel()
        except Exception as exc:
            if started:
                raise
            log.exception("startup failed")
            await send({"type": "lifespan.startup.failed", "message": repr(exc)})
            return
        await send({"type": "lifespan.shutdown.complete"})

    # -- graceful shutdown ---------------------------------------------------------

    def begin_shutdown(self, server_grace: float | None = None) -> None:
        """Stop taking requests (new ones get 503); in-flight ones get
        ``shutdown_grace`` seconds, then are aborted and ended cleanly (the
        format's error, in-band after the 200, and its terminal marker; a
        record each). ``server_grace``: the seconds the server gives them
        before it cuts them (hypercorn's ``graceful_timeout``), of which
        :data:`END_MARGIN` is kept for that ending. Called once the server
        stops (SIGTERM/SIGINT: :func:`asgi_generate.server.serving.run`,
        :mod:`asgi_generate.server.hypercorn.graceful`); later calls do
        nothing."""
        if self.shutting_down:
            return
        self.shutting_down = True
        if self.admission is not None:  # queued requests are answered 503 now
            self.admission.shut()
        grace = self.settings.shutdown_grace
        if server_grace is not None:
            grace = max(0.0, min(grace, server_grace - END_MARGIN))
        self._drain_until = time.monotonic() + grace
        if self.inflight:
            log.info("shutdown: %d request(s) in flight get up to %g s to finish", len(self.inflight), grace)
        if self._shutdown_requested is not None:
            self._shutdown_requested.set()

    def end_in_flight(self) -> None:
        """End every in-flight request now, as :meth:`begin_shutdown` does
        once its grace is over (a forced shutdown)."""
        self.begin_shutdown()
        self._drain_until = 0.0

    async def _drain_on_shutdown(self) -> None:
        await self._shutdown_requested.wait()
        while self.inflight and time.monotonic() < self._drain_until:
            await anyio.sleep(0.05)
        if self.inflight:
            log.warning("shutdown: aborting %d requests still in flight", len(self.inflight))
        for gen in list(self.inflight.values()):
            gen.cancel_for_shutdown()

    # -- used by the handler -------------------------------------------------

    async def _sibling_message(self, message: dict[str, Any]) -> None:
        """A sibling process's message (:func:`asgi_generate.ops.siblings.tell`):
        a fence decision no engine holds
        (:meth:`~asgi_generate.workers.fleet_state.FleetState.apply_fence_message`),
        an aborting call it began or ended
        (:meth:`~asgi_generate.workers.fleet_state.FleetState.apply_call_message`),
        or an abort by id it took (:func:`~asgi_generate.ops.admin.abort_named`:
        this process's requests of those ids aborted too)."""
        kind = message.get("kind")
        if kind == "fence":
            self.router.fleet.apply_fence_message(message)
        elif kind == "call":
            self.router.fleet.apply_call_message(message)
        elif kind == "abort":
            await admin.abort_named(self, message["protocol"], message["named"], message["all"])

    def _worker_services(self, worker: Worker) -> Callable[[], Awaitable[None]]:
        """A joining worker's tasks, to run: its abort queue and the routing
        policy's own (a KV event subscriber) and admission's load reader, if any."""
        aborts = self._start_aborts(worker)
        services = [s for s in (self.router.policy.service(worker),
                                self.admission.service(worker) if self.admission is not None else None)
                    if s is not None]
        if not services:
            return aborts

        async def all_of() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(aborts)
                for service in services:
                    tg.start_soon(service)

        return all_of

    def _start_aborts(self, worker: Worker) -> Callable[[], Awaitable[None]]:
        """A joining worker's abort queue (kept in :attr:`aborts`), to run."""
        st = self.settings
        queue = self.aborts[worker.id] = AbortQueue(
            worker,
            concurrency=st.abort_concurrency,
            queue_size=st.abort_queue_size,
            batch=st.abort_batch,
            timeout=st.abort_timeout,
            deadline=st.abort_deadline,
            remember=st.abort_memory,
            on_lost=self.router.worker_lost,
        )
        return queue.run

    def _worker_busy(self, worker: Worker) -> bool:
        """Whether a draining ``worker`` is still used: requests ride it,
        an engine leg on it may still need its abort, or aborts for it are
        queued or being sent."""
        queue = self.aborts.get(worker.id)
        if worker.inflight or (queue is not None and (queue.queued or queue.in_flight)):
            return True
        return any(a.live and a.worker is worker for st in self.open_requests.values() for a in st.attempts)

    async def abort_engine_request(self, worker: Worker, engine_id: str) -> str:
        """Ask ``worker``'s engine to abort ``engine_id`` through the worker's
        :class:`~asgi_generate.workers.aborts.AbortQueue` and wait for the
        outcome: ``"acked"``, ``"unacknowledged"`` or ``"lost"`` (the worker
        is down or went away), each counted; the queue logs failures."""
        self.recorder.abort_sent()
        queue = self.aborts.get(worker.id)
        result = await queue.abort(engine_id) if queue is not None else UNACKNOWLEDGED
        self.recorder.abort_answered(result)
        return result

    # -- control routes ----------------------------------------------------------

    def models(self) -> dict[str, Any]:
        """The ``/v1/models`` body: the models live workers serve (``data``:
        a worker that is up and not draining, whose engine named its model
        at registration), the formats, and every worker with its state
        (``workers``: down, draining and never-up ones included)."""
        by_name: dict[str, list[Worker]] = {}
        for w in self.router.workers:
            name = w.info.get("served_model_name") or w.info.get("model_path")
            if name and w.state == "up":
                by_name.setdefault(name, []).append(w)
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": self.started_unix_ms // 1000, "owned_by": "asgi-generate",
                 **_model_limits(name, by_name[name])}
                for name in sorted(by_name)
            ],
            "formats": [
                {
                    "name": item.codec.name,
                    "routes": [f"{r.method} {r.path}" for r in item.codec.routes],
                    "worker_protocol": item.codec.worker_protocol,
                    "distribution": item.distribution,
                    "version": item.version,
                }
                for item in self.codecs
            ],
            "workers": [w.describe() for w in self.router.workers],
        }

    def stats(self) -> dict[str, Any]:
        """The ``/stats`` body: request and abort counters, bodies being read
        (``reading_body``) and the body budget (bytes reserved, requests
        waiting for room), migrated streams running and waiting
        (``migration_slots``), the routing policy's decisions (``routing``),
        pool figures, of this process (``pid``; ``serve
        --workers N`` runs N of them, each with its own budget); whether
        hypercorn serves patched (``hypercorn_patches``,
        :func:`asgi_generate.server.hypercorn.patches.status`); whether the
        hash chains run in C (``hash_accelerator``,
        :data:`asgi_generate.hashes.ACCELERATED`); client
        connections closed before a request reached the app, by reason
        (``connections_closed``,
        :data:`asgi_generate.server.hypercorn.edge_counts.closed`); an embedded
        simulator's process id as its worker's ``pid``."""
        recorder = self.recorder
        return {
            "pid": os.getpid(),
            "hypercorn_patches": patches.status(),
            "hash_accelerator": hashes.ACCELERATED,
            "connections_closed": dict(edge_counts.closed),
            **recorder.counters,
            "by_status": dict(recorder.by_status),
            "reading_body": self.body_budget.reading,
            "body_budget": {
                "capacity_bytes": self.body_budget.capacity,
                "in_use_bytes": self.body_budget.in_use,
                "waiting": self.body_budget.waiting,
            },
            "migration_slots": self.migrations.stats(),
            "admission": self.admission.stats() if self.admission is not None else {"enabled": False},
            "trace": recorder.tracer.stats() if recorder.tracer is not None else {"enabled": False},
            "routing": self.router.policy.stats(),
            "fleet_weight_versions": dict(self.router.fleet_versions),
            "pauses": self.router.pauses.stats(),
            "fleet_state": self.router.fleet.stats(),
            "workers": {
                w.id: {
                    "url": w.url,
                    "role": w.role,
                    "state": w.describe()["state"],
                    "weight_version": w.weight_version,
                    "fence": w.fence,
                    "failed_weight_updates": w.failed_updates,
                    "in_rotation": self.router.routable(w) and not w.draining,
                    "times_down": w.times_down,
                    "admin_calls_in_flight": w.calls,
                    "paused_until": sorted(w.paused),
                    "outstanding": w.outstanding,
                    "idle_connections": w.pool.idle,
                    "connections_opened": w.pool.opened,
                    "connections_retired": w.pool.retired,
                    **({"aborts": self.aborts[w.id].stats()} if w.id in self.aborts else {}),
                    **({"pid": self.simulators[w.url].pid} if w.url in self.simulators else {}),
                }
                for w in self.router.workers
            },
        }


def _model_limits(name: str, workers: list[Worker]) -> dict[str, Any]:
    """``max_model_len`` (the smallest the workers serving ``name`` report,
    read at registration: :meth:`WorkerProtocol.read_info`) and ``root``
    (vLLM's ``root``; SGLang's own ``/v1/models`` gives the served name),
    each ``None`` while unknown."""
    lens = [n for w in workers if isinstance(n := w.info.get("max_model_len"), int)]
    root = next((w.info["root"] for w in workers if isinstance(w.info.get("root"), str)), None)
    known = any(w.info for w in workers)
    return {"max_model_len": min(lens) if lens else None, "root": root or (name if known else None)}
