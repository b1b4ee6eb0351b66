"""Fakes of what a request talks to.

In process (no socket): a worker's connection pool, one request on it and
its response (the Protocols of :mod:`asgi_generate.workers.pool`, checked
by tests/workers/test_pool_protocols.py), the router, the request context
and the admin routes' context; the workers answer from a script. On a loopback socket:
:class:`FakeWorker`, an SGLang worker whose timing the test controls.
"""

from __future__ import annotations

import functools
import math

import anyio
import anyio.abc
import anyio.from_thread
import h11
import orjson

from asgi_generate.config import Settings
from asgi_generate.ops import admin
from asgi_generate.request.budget import BodyBudget
from asgi_generate.request.migrations import MigrationSlots
from asgi_generate.request.watchdog import Watchdog
from asgi_generate.tracing.state import RequestState
from asgi_generate.workers.router import Router
from support import asgi_request, read_h11_request, send_h11_answer

#: A script entry that waits until the leg is cancelled.
STALL = object()


class FakeResponse:
    """A worker's answer (a :class:`~asgi_generate.workers.pool.WorkerResponse`):
    ``status``, then ``reads`` in order (bytes, an exception to raise, or
    :data:`STALL`); the body ends after the last. ``content_type``: the
    header's value, ``None`` for none."""

    retry_after = None

    def __init__(self, status: int, reads: list, content_type: bytes | None = None) -> None:
        self.status = status
        self.reads = list(reads)
        self.content_type = content_type

    async def read_some(self, deadline: float = math.inf) -> bytes | None:
        if not self.reads:
            return None
        got = self.reads.pop(0)
        if got is STALL:
            await anyio.sleep_forever()
        if isinstance(got, BaseException):
            raise got
        return got

    async def read(self, deadline: float = math.inf) -> bytes:
        parts = []
        while (data := await self.read_some(deadline)) is not None:
            parts.append(data)
        return b"".join(parts)


class FakeExchange:
    """One request (a :class:`~asgi_generate.workers.pool.WorkerExchange`):
    its head gives ``answer`` (a :class:`FakeResponse`, an exception to
    raise, :data:`STALL`, or a callable making one of those)."""

    def __init__(self, answer) -> None:
        self.answer = answer

    async def __aenter__(self) -> FakeResponse:
        answer = self.answer() if callable(self.answer) else self.answer
        if isinstance(answer, BaseException):
            raise answer
        if answer is STALL:
            await anyio.sleep_forever()
        return answer

    async def __aexit__(self, exc_type, exc, tb) -> None:
        pass


class FakePool:
    """A worker's pool (a :class:`~asgi_generate.workers.pool.WorkerPool`)
    answering each request with the next of ``answers`` (as
    :class:`FakeExchange`'s); ``sent`` lists ``(path, body as JSON, headers)``."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[bytes, object, list]] = []

    def request(self, method, path, body=b"", headers=(), head_deadline=math.inf, idempotent=False):
        self.sent.append((path, orjson.loads(body), list(headers)))
        return FakeExchange(self.answers.pop(0))

    async def aclose(self) -> None:
        pass


class AnsweringPool:
    """A worker's pool (a :class:`~asgi_generate.workers.pool.WorkerPool`)
    whose ``answer(body as JSON)`` gives each response's ``(status, pieces)``;
    ``sent`` lists the bodies as JSON."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.sent: list[dict] = []

    def request(self, method, path, body=b"", headers=(), head_deadline=math.inf, idempotent=False):
        sent = orjson.loads(body)
        self.sent.append(sent)
        return FakeExchange(lambda: FakeResponse(*self.answer(sent)))

    async def aclose(self) -> None:
        pass


class CannedAnswer:
    """A worker's whole answer to a call, the same each time it is given:
    ``status``, ``body`` and its ``content_type``."""

    def __init__(self, status: int, body: bytes, content_type: bytes | None = b"application/json") -> None:
        self.status, self.body, self.content_type = status, body, content_type


class CallPool:
    """A worker's pool (a :class:`~asgi_generate.workers.pool.WorkerPool`)
    answering every call with ``answer``: a :class:`CannedAnswer`, an
    exception its head raises, :data:`STALL` (no answer ever), or a
    function of ``(method, target, body)`` returning one of those;
    ``calls`` lists ``(method, target, body)``."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.calls: list[tuple[bytes, bytes, bytes]] = []

    def request(self, method, path, body=b"", headers=(), head_deadline=math.inf, idempotent=False):
        self.calls.append((method, path, body))

        def head():
            answer = self.answer(method, path, body) if callable(self.answer) else self.answer
            if isinstance(answer, BaseException) or answer is STALL:
                return answer
            return FakeResponse(answer.status, [answer.body] if answer.body else [], answer.content_type)

        return FakeExchange(head)

    async def aclose(self) -> None:
        pass


class FakeRouter:
    """Plans from a list; records what the runner tells it."""

    def __init__(self, *plans, probe_up: bool = True) -> None:
        self.plans = list(plans)
        self.probe_up = probe_up
        self.marked: list[tuple[str, str]] = []
        self.probed: list[str] = []

    def routing_key(self, request, headers):
        return None

    def plan(self, protocol, exclude=(), key=None, need=1):
        while self.plans:
            plan = self.plans.pop(0)
            if not any(w in exclude for w in plan):
                return plan
        return None

    def pick(self, protocol, exclude=(), role="aggregated", key=None, need=1):
        plan = self.plan(protocol, exclude, key)
        return plan[0] if plan is not None and len(plan) == 1 else None

    def can_plan(self, protocol, exclude=()):
        return any(not any(w in exclude for w in plan) for plan in self.plans)

    def has_protocol(self, protocol):
        return True

    def mark_down(self, worker, reason):
        self.marked.append((worker.id, reason))

    async def probe(self, worker):
        self.probed.append(worker.id)
        return self.probe_up


class FakeRecorder:
    """Keeps what the request reported, in order."""

    otel = None
    trace_output_ids = False

    def __init__(self) -> None:
        self.calls: list = []
        self.records: list[RequestState] = []
        self.gaps: list[float] = []

    def request_started(self) -> None:
        self.calls.append("started")

    def request_ended(self, st: RequestState) -> None:
        self.calls.append("ended")

    def request_finished(self, st: RequestState) -> None:
        self.calls.append(("finished", st.request_id, st.status, st.output_tokens))
        self.records.append(st)

    async def items_finished(self, states: list[RequestState]) -> None:
        for st in states:
            self.request_finished(st)

    def inter_token_latency(self, fmt: str):
        return self.gaps.append


class FakeContext:
    """A :class:`RequestContext` of plain objects; every abort is acked."""

    def __init__(self, router: Router, **settings) -> None:
        self.settings = Settings(**{"sse_keepalive": 0, **settings})
        self.router = router
        self.recorder = FakeRecorder()
        self.watchdog = Watchdog()
        self.body_budget = BodyBudget(1 << 20)
        self.migrations = MigrationSlots(lambda: 4)
        self.admission = None
        self.inflight: dict = {}
        self.open_requests: dict = {}
        self.shutting_down = False
        self.aborted: list[tuple[str, str]] = []

    async def abort_engine_request(self, worker, engine_id: str) -> str:
        self.aborted.append((worker.id, engine_id))
        return "acked"


# -- a misbehaving SGLang worker on a socket ------------------------------------------

#: The SGLang requests sent to a :class:`FakeWorker`: unary, and streamed as rid ``mine``.
BODY = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
STREAM = {**BODY, "stream": True, "rid": "mine"}


class LoopbackServer:
    """A TCP server on 127.0.0.1 in a thread of its own (an anyio blocking
    portal), for the test's synchronous code: ``with`` starts it, its
    :attr:`url` names it, each connection runs the subclass's
    ``async _handle(stream)``; leaving the block stops it."""

    url: str

    def __enter__(self):
        self._cm = anyio.from_thread.start_blocking_portal()
        portal = self._cm.__enter__()
        self._portal = portal
        self._listener = portal.call(functools.partial(anyio.create_tcp_listener, local_host="127.0.0.1"))
        self.url = f"http://127.0.0.1:{self._listener.extra(anyio.abc.SocketAttribute.local_port)}"
        self._serving = portal.start_task_soon(self._listener.serve, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._serving.cancel()
        self._portal.call(self._listener.aclose)
        self._cm.__exit__(None, None, None)

    async def _handle(self, stream) -> None:
        raise NotImplementedError


class FakeWorker(LoopbackServer):
    """An SGLang worker whose ``/generate`` misbehaves as told.

    ``mode``: ``stall`` (headers, one event, then only ``: ping`` comments),
    ``no_headers`` (never answers), ``headers_only`` (headers, then only
    comments), ``unavailable`` (503). Setting ``blackhole`` makes it answer nothing more at all,
    health probes included, while still accepting connections.
    ``generates`` and ``aborts`` list the rids it was sent.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.blackhole = False
        self.generates: list[str] = []
        self.aborts: list[str] = []

    async def _handle(self, stream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            async with stream:
                while True:
                    request, body = await self._read(stream, conn)
                    if request is None:
                        return
                    if self.blackhole:
                        await anyio.sleep_forever()
                    path = request.target
                    if path == b"/health":
                        await self._reply(stream, conn, b"")
                    elif path == b"/get_server_info":
                        await self._reply(stream, conn, orjson.dumps({"model_path": "fake"}))
                    elif path == b"/abort_request":
                        self.aborts.append(orjson.loads(body)["rid"])
                        await self._reply(stream, conn, b"")
                    elif path == b"/generate":
                        rid = orjson.loads(body)["rid"]
                        self.generates.append(rid)
                        await self._generate(stream, conn, rid)
                        return
                    else:  # e.g. /v1/models: FastAPI's 404
                        await self._reply(stream, conn, b'{"detail":"Not Found"}', 404)
                    conn.start_next_cycle()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream):
            return

    _read = staticmethod(read_h11_request)
    _reply = staticmethod(send_h11_answer)

    async def _generate(self, stream, conn, rid: str) -> None:
        if self.mode == "no_headers":
            await anyio.sleep_forever()
        if self.mode == "unavailable":  # an engine going away (SGLang while shutting down)
            await self._reply(stream, conn, b'{"error": {"message": "shutting down"}}', 503)
            return
        head = h11.Response(status_code=200, headers=[("content-type", "text/event-stream")])
        await stream.send(conn.send(head))
        if self.mode == "stall":
            chunk = {"text": "a", "output_ids": [5],
                     "meta_info": {"id": rid, "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 1}}
            await stream.send(conn.send(h11.Data(data=b"data: " + orjson.dumps(chunk) + b"\n\n")))
        while True:  # comments only: alive, but no token
            await anyio.sleep(0.05)
            await stream.send(conn.send(h11.Data(data=b": ping\n\n")))


# -- the admin routes' context --------------------------------------------------------

class FakeAdminContext:
    """The app as the admin routes see it (:class:`~asgi_generate.ops.fanout.AdminContext`)."""

    def __init__(self, router: Router, **settings) -> None:
        self.settings = Settings(**settings)
        self.router = router
        self.codecs: list = []
        self.inflight: dict = {}

    async def abort_engine_request(self, worker, engine_id: str) -> str:
        return "acked"


def admin_fleet(*answers, protocol: str = "sglang") -> tuple[Router, list[CallPool]]:
    """A router with one worker per answer (``None``: a worker that is down)."""
    router = Router([(protocol, f"http://127.0.0.1:{9 + i}") for i in range(len(answers))])
    pools = []
    for w, answer in zip(router.workers, answers):
        w.pool = CallPool(answer)
        w.healthy = answer is not None
        w.last_error = None if answer is not None else "connection refused"
        pools.append(w.pool)
    return router, pools


async def admin_call(ctx: FakeAdminContext, method: str, path: str, body: bytes = b"", query: bytes = b"",
               headers: list[tuple[bytes, bytes]] = ()) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request to the admin router; its status, headers and body."""
    return await asgi_request(admin.build(ctx), method, path, body, query, headers)


ADMIN_OK = CannedAnswer(200, b'{"success": true}')
