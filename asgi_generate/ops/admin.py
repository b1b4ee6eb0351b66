"""Info and admin routes: off the hot path, served with starlette's routing.

Info routes (no token):

- ``GET /get_model_info``, ``/model_info``, ``/get_server_info``,
  ``/server_info``: the answer of one healthy SGLang worker, verbatim (so
  ``model_path``, ``tokenizer_path``, ``is_generation``... are the
  engine's; SGLang ``http_server.py`` ``get_model_info``/``get_server_info``);
  503 ``{"error": {"message"}}`` (SGLang's ``_create_error_response`` shape)
  when no SGLang worker answers.
- ``GET /health_generate``: 200 (empty, as SGLang's ``health_generate``)
  only if, for each protocol a served codec rides on, a worker generated one
  token now: SGLang workers through their own ``/health_generate``, vLLM
  workers with a one-token ``POST /inference/v1/generate``; else 503 naming
  what failed.

Admin routes (``Authorization: Bearer <admin_token>`` when one is set, the
scheme in any case, RFC 9110 section 11.1; a 401 says ``WWW-Authenticate:
Bearer``, RFC 6750 section 3), each fanned out to every worker of its
protocol that is up, every role, within ``admin_timeout`` seconds:

- SGLang (``http_server.py``): ``GET``/``POST /flush_cache``,
  ``POST /pause_generation``, ``/continue_generation``,
  ``/update_weights_from_disk``, ``GET``/``POST /release_memory_occupation``,
  ``/resume_memory_occupation``; ``POST /abort_request`` (below).
- vLLM dev routes (``vllm/entrypoints/serve/dev/``): ``POST /reset_prefix_cache``,
  ``/sleep``, ``/wake_up``, ``GET /is_sleeping``, ``POST /pause``, ``/resume``,
  ``GET /is_paused``.

The method, query string and body go to each worker as sent. When every
worker called answered 200 the client gets the first one's answer (status,
body, content type): what existing clients check. Otherwise 502 with a JSON
list of ``{"worker", "status", "body"}`` per worker (``status`` ``null`` and
``body`` the error when it did not answer; ``body`` parsed when JSON).

A worker the router has out of the rotation (down: its probe gave it up,
or a connection to it was refused) is skipped, not called: a dead worker
cannot hold every admin call at 502 (embedded simulators are never
restarted). So is one whose connection the call itself finds refused (the
engine never got it; it is marked down as a request's leg would mark it).
Skipped workers are named in every such answer: the header
``asgi-generate-skipped-workers: w1, w3`` (the 200 body stays the engine's
own), and in a 502 list as ``{"worker", "status": null, "skipped": true,
"body": "down: <why>"}``; each skip is logged. With no worker of the
protocol up, 503 names them. What a skipped worker serves when it comes back
(e.g. its weights) is for its health probe and the weight version to decide.

``POST /abort_request`` ``{"abort_all": true}`` fans out as above. With
``{"rid": R}`` it aborts the frontend's own live SGLang requests whose
public id starts with ``R`` (SGLang's scheduler matches by prefix), each by
its minted engine id on whichever workers run its legs (a batch's items each
by their own public id, ``rid_0``, ``rid_1``, ..., so ``rid`` ends every
unfinished item); their clients see the engine's abort finish. An empty ``rid`` aborts nothing, as SGLang does.
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, Sequence

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from ..sdk import ids
from ..request.batches import named_legs
from ..request.framing import BodyTimeout, BodyTooLarge, ClientDisconnected, read_body
from ..workers.aborts import ACKED
from ..workers.http import ConnectFailed, WorkerError
from ..workers.router import Worker

if TYPE_CHECKING:
    from ..config import Settings
    from ..request.context import Running
    from ..sdk.registry import LoadedCodec
    from ..workers.router import Router as WorkerRouter

Endpoint = Callable[[Request], Awaitable[Response]]
INFO_PATHS = ("/get_model_info", "/model_info", "/get_server_info", "/server_info")
#: Fanned-out admin routes: path, methods, protocol.
FAN_OUT = (
    ("/flush_cache", ("GET", "POST"), "sglang"),
    ("/pause_generation", ("POST",), "sglang"),
    ("/continue_generation", ("POST",), "sglang"),
    ("/update_weights_from_disk", ("POST",), "sglang"),
    ("/release_memory_occupation", ("GET", "POST"), "sglang"),
    ("/resume_memory_occupation", ("GET", "POST"), "sglang"),
    ("/reset_prefix_cache", ("POST",), "vllm"),
    ("/sleep", ("POST",), "vllm"),
    ("/wake_up", ("POST",), "vllm"),
    ("/is_sleeping", ("GET",), "vllm"),
    ("/pause", ("POST",), "vllm"),
    ("/resume", ("POST",), "vllm"),
    ("/is_paused", ("GET",), "vllm"),
)
#: Every path this module serves (the app's dispatch sends these here).
PATHS = frozenset({*INFO_PATHS, "/health_generate", "/abort_request", *(p for p, _, _ in FAN_OUT)})
JSON = "application/json"
#: The header naming the workers an admin fan-out skipped.
SKIPPED_HEADER = "asgi-generate-skipped-workers"
log = logging.getLogger("asgi_generate.admin")


#: Admin routes that empty the engines' prefix caches.
CACHE_RESETS = ("/flush_cache", "/reset_prefix_cache")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """SGLang's error shape (``_create_error_response``)."""
    return Response(orjson.dumps({"error": {"message": message}}), status, headers, media_type=JSON)


def _parsed(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")


class _Answer:
    """One worker's answer: ``status`` ``None`` when it gave none;
    ``refused`` when no connection to it could be opened."""

    __slots__ = ("worker", "status", "body", "content_type", "refused")

    def __init__(self, worker: Worker, status: int | None, body: bytes, content_type: str | None = None,
                 refused: bool = False) -> None:
        self.worker = worker
        self.status = status
        self.body = body
        self.content_type = content_type
        self.refused = refused

    def result(self) -> dict[str, Any]:
        return {"worker": self.worker.id, "status": self.status, "body": _parsed(self.body) if self.body else ""}


class AdminContext(Protocol):
    """The process as the admin routes see it (the app).

    Attributes:
        settings: the configuration (``admin_token``, ``admin_timeout``,
            the body limits).
        router: the workers routes fan out to; its policy forgets what a
            worker cached once its cache is flushed.
        codecs: the served codecs; ``/health_generate`` checks a worker of
            each one's worker protocol.
        inflight: requests being generated, by minted id; ``/abort_request``
            finds them by public id.
    """

    settings: Settings
    router: WorkerRouter
    codecs: list[LoadedCodec]
    inflight: dict[str, Running]

    async def abort_engine_request(self, worker: Worker, engine_id: str) -> str:
        """Abort ``engine_id`` on ``worker``'s engine; ``"acked"``,
        ``"unacknowledged"`` or ``"lost"``."""


def build(ctx: AdminContext) -> Router:
    """The starlette router serving :data:`PATHS` for ``ctx`` (its workers,
    in-flight requests and settings), which it reads at each request."""
    routes = [Route(path, _info(ctx), methods=["GET"]) for path in INFO_PATHS]
    routes.append(Route("/health_generate", _health_generate(ctx), methods=["GET"]))
    routes.append(Route("/abort_request", _guarded(ctx, _abort_request(ctx)), methods=["POST"]))
    for path, methods, protocol in FAN_OUT:
        routes.append(Route(path, _guarded(ctx, _fan_out(ctx, protocol)), methods=list(methods)))
    return Router(routes)


def _guarded(ctx: AdminContext, endpoint: Endpoint) -> Endpoint:
    async def guarded(request: Request) -> Response:
        token = ctx.settings.admin_token
        if token:
            scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
                return _error(401, "Unauthorized: admin routes need 'Authorization: Bearer <admin token>'",
                              {"www-authenticate": "Bearer"})
        return await endpoint(request)

    return guarded


async def _call(ctx: AdminContext, worker: Worker, method: str, target: bytes, body: bytes,
                headers: list[tuple[bytes, bytes]]) -> _Answer:
    """One request to ``worker`` within ``admin_timeout``."""
    timeout = ctx.settings.admin_timeout
    try:
        with anyio.fail_after(timeout):
            async with worker.pool.request(method.encode(), target, body, headers) as resp:
                data = await resp.read()
                ctype = None if resp.content_type is None else resp.content_type.decode("latin-1")
                return _Answer(worker, resp.status, data, ctype)
    except TimeoutError:
        return _Answer(worker, None, f"no answer within {timeout:g} s".encode())
    except WorkerError as exc:
        return _Answer(worker, None, (str(exc) or type(exc).__name__).encode(), refused=isinstance(exc, ConnectFailed))


async def _body(ctx: AdminContext, request: Request) -> bytes | Response:
    try:
        return await read_body(request.receive, ctx.settings.max_body_bytes, None, ctx.settings.body_read_timeout)
    except BodyTooLarge as exc:
        return _error(413, str(exc))
    except BodyTimeout:
        return _error(408, f"the body was not whole within {ctx.settings.body_read_timeout:g} s")
    except ClientDisconnected:
        return Response(b"", 400)  # nobody is left to read it


def _target(request: Request) -> bytes:
    query = request.scope.get("query_string", b"")
    return request.scope["path"].encode() + (b"?" + query if query else b"")


def _content_headers(request: Request) -> list[tuple[bytes, bytes]]:
    ctype = request.headers.get("content-type")
    return [(b"content-type", ctype.encode("latin-1"))] if ctype else []


def _combined(answers: list[_Answer], skipped: Sequence[Worker] = ()) -> Response:
    """200 with the first answer when all are 200, else 502 listing each
    (and each of ``skipped``); ``skipped`` named in :data:`SKIPPED_HEADER`."""
    headers = {SKIPPED_HEADER: ", ".join(w.id for w in skipped)} if skipped else None
    if answers and all(a.status == 200 for a in answers):
        first = answers[0]
        return Response(first.body, 200, headers, media_type=first.content_type)
    results = [a.result() for a in answers]
    results += [{"worker": w.id, "status": None, "skipped": True, "body": f"down: {_why(w)}"} for w in skipped]
    return Response(orjson.dumps(results), 502, headers, media_type=JSON)


def _why(worker: Worker) -> str:
    """Why ``worker`` is out of the rotation, as the router last said."""
    return worker.last_error or "no health probe passed yet"


async def _gather(calls: list[Callable[[], Awaitable[_Answer]]]) -> list[_Answer]:
    answers: list[_Answer | None] = [None] * len(calls)

    async def one(i: int) -> None:
        answers[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return answers  # type: ignore[return-value]


def _fan_out(ctx: AdminContext, protocol: str) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        body = await _body(ctx, request)
        if isinstance(body, Response):
            return body
        return await _to_every_worker(ctx, protocol, request, body)

    return endpoint


async def _to_every_worker(ctx: AdminContext, protocol: str, request: Request, body: bytes) -> Response:
    """The call to every worker of ``protocol`` that is up; the others
    skipped (see the module docstring)."""
    workers = [w for w in ctx.router.workers if w.protocol.name == protocol]
    if not workers:
        return _error(503, f"no worker configured for protocol {protocol!r}")
    skipped = [w for w in workers if not w.healthy]
    target, headers = _target(request), _content_headers(request)
    called = await _gather([(lambda w=w: _call(ctx, w, request.method, target, body, headers))
                            for w in workers if w.healthy])
    answers = []
    for a in called:
        if a.refused:  # the engine never got the call
            ctx.router.mark_down(a.worker, a.body.decode())
            skipped.append(a.worker)
        else:
            answers.append(a)
    if skipped:
        log.warning("%s %s skipped workers that are down: %s", request.method, request.url.path,
                    ", ".join(f"{w.id} ({_why(w)})" for w in skipped))
    if not answers:
        down = ", ".join(f"{w.id} ({_why(w)})" for w in skipped)
        return _error(503, f"no worker of protocol {protocol!r} is up: {down}",
                      {SKIPPED_HEADER: ", ".join(w.id for w in skipped)})
    if request.url.path in CACHE_RESETS:
        for a in answers:
            if a.status == 200:  # that engine's prefix cache is empty now
                ctx.router.policy.forget(a.worker)
    return _combined(answers, skipped)


def _abort_request(ctx: AdminContext) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        body = await _body(ctx, request)
        if isinstance(body, Response):
            return body
        obj = _parsed(body) if body.strip() else {}
        if not isinstance(obj, dict):
            return _error(400, "the body must be a JSON object")
        rid, abort_all = obj.get("rid", ""), obj.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            return _error(400, "'rid' must be a string and 'abort_all' a boolean")
        if abort_all:
            return await _to_every_worker(ctx, "sglang", request, body)
        legs = [
            (worker, engine_id)
            for gen in list(ctx.inflight.values())
            if gen.codec.worker_protocol == "sglang" and rid
            for public, worker, engine_id in named_legs(gen)
            if (public or "").startswith(rid)
        ]

        async def abort(worker: Worker, engine_id: str) -> _Answer:
            result = await ctx.abort_engine_request(worker, engine_id)
            if result == ACKED:
                return _Answer(worker, 200, b"")
            return _Answer(worker, None, f"abort {result}".encode())

        answers = await _gather([(lambda w=w, e=e: abort(w, e)) for w, e in legs])
        # SGLang answers 200 with an empty body, matched or not.
        return Response(b"", 200) if all(a.status == 200 for a in answers) else _combined(answers)

    return endpoint


def _info(ctx: AdminContext) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        for worker in _healthy(ctx, "sglang"):
            answer = await _call(ctx, worker, "GET", _target(request), b"", [])
            if answer.status is not None:
                return Response(answer.body, answer.status, media_type=answer.content_type)
        return _error(503, "no healthy worker for protocol 'sglang'")

    return endpoint


def _healthy(ctx: AdminContext, protocol: str) -> list[Worker]:
    """Healthy workers of ``protocol``, aggregated ones first."""
    ws = [w for w in ctx.router.workers if w.healthy and w.protocol.name == protocol]
    return sorted(ws, key=lambda w: w.role != "aggregated")


def _health_generate(ctx: AdminContext) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        failures = []
        for protocol in sorted({item.codec.worker_protocol for item in ctx.codecs}):
            if not await _generates(ctx, protocol):
                failures.append(protocol)
        if failures:
            return _error(503, "no worker generated a token for: " + ", ".join(map(repr, failures)))
        return Response(b"", 200)

    return endpoint


async def _generates(ctx: AdminContext, protocol: str) -> bool:
    """Whether one healthy worker of ``protocol`` generates a token now."""
    for worker in _healthy(ctx, protocol):
        if protocol == "sglang":
            answer = await _call(ctx, worker, "GET", b"/health_generate", b"", [])
        else:
            body = orjson.dumps({"token_ids": [0], "sampling_params": {"max_tokens": 1}})
            headers = [(b"content-type", b"application/json"), (b"x-request-id", b"health-" + ids.mint().encode())]
            answer = await _call(ctx, worker, "POST", b"/inference/v1/generate", body, headers)
        if answer.status == 200:
            return True
    return False
