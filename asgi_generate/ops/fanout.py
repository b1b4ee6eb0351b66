"""One admin call to the fleet: every worker of a protocol that is up, or the
one a client names; their answers combined into one.

Used by the admin routes (:mod:`asgi_generate.ops.admin`) and the weight
routes (:mod:`asgi_generate.ops.weights`); their docstrings say what each
route sends. The rules every fanned-out call follows:

- Every admin route needs ``Authorization: Bearer <admin_token>`` when one is
  set (the scheme in any case, RFC 9110 section 11.1); a 401 says
  ``WWW-Authenticate: Bearer`` (RFC 6750 section 3).
- The method, query string and body go to each worker as sent, within the
  route's deadline (``admin_timeout``, or ``weight_update_timeout`` for a
  weight route).
- A client may name one worker, by its id (``w0``, ``w1``, ... as
  ``/v1/models`` lists them), with the ``worker`` query parameter (removed
  from the query sent on) or the :data:`WORKER_HEADER` header; only it is
  called. An id that is no worker of the route's protocol is 404, a named
  worker that is down 503.
- When every worker called answered 200 the client gets the first one's
  answer (status, body, content type): what existing clients check.
  Otherwise 502 with a JSON list of ``{"worker", "status", "body"}`` per
  worker (``status`` ``null`` and ``body`` the error when it did not answer;
  ``body`` parsed when JSON).
- A worker the router has out of the rotation (down: its probe gave it up,
  or a connection to it was refused) is skipped, not called: a dead worker
  cannot hold every admin call at 502 (embedded simulators are never
  restarted). So is one whose connection the call itself finds refused (the
  engine never got it; it is marked down as a request's leg would mark it),
  and one that closed a reused connection before answering and then refuses
  a new one (a worker killed just now: whatever it read died with it).
  Skipped workers are named in every such answer: the header
  :data:`SKIPPED_HEADER` (``w1, w3``; the 200 body stays the engine's own),
  and in a 502 list as ``{"worker", "status": null, "skipped": true, "body":
  "down: <why>"}``; each skip is logged. With no worker of the protocol up,
  503 names them. What a skipped worker serves when it comes back (e.g. its
  weights) is for its health probe and the weight version to decide.
- A call in flight on a worker, and a pause it took (a route of its engine
  description's ``pauses``: SGLang ``/pause_generation``,
  ``/release_memory_occupation``; vLLM ``/pause``, ``/sleep``) until the
  route that ends it answered 200, keep its failing health probes from
  taking it out (:attr:`~asgi_generate.workers.worker.Worker.busy`,
  :mod:`~asgi_generate.workers.probes`). A pause counts from the moment it
  is sent; an answer other than 200 (the engine refused it) undoes it, no
  answer leaves it counted.
- The route that ends a pause (``/continue_generation``, ``/resume``,
  ``/wake_up``, ``/resume_memory_occupation``) reaches every worker that
  took the pause and has not answered 200 to it since, down or not. One it
  could not reach (its connection refused) makes the answer 502, naming it
  as skipped: it is still paused, and the next such call tries it again.

Errors the frontend makes itself are SGLang's shape
(``_create_error_response``): ``{"error": {"message"}}``.
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, Sequence
from urllib.parse import parse_qsl, urlencode

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response

from ..exceptions import BodyTimeout, BodyTooLarge, ClientDisconnected, ConnectFailed, Unanswered, WorkerError
from ..request.framing import read_body
from ..workers.router import Worker

if TYPE_CHECKING:
    from ..config import Settings
    from ..request.context import Running
    from ..sdk._registry import LoadedCodec
    from ..workers.router import Router as WorkerRouter

Endpoint = Callable[[Request], Awaitable[Response]]
JSON = "application/json"
#: The header naming the workers an admin fan-out skipped.
SKIPPED_HEADER = "asgi-generate-skipped-workers"
#: The header naming the one worker an admin call is for.
WORKER_HEADER = "asgi-generate-worker"
log = logging.getLogger("asgi_generate.admin")


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """SGLang's error shape (``_create_error_response``)."""
    return Response(orjson.dumps({"error": {"message": message}}), status, headers, media_type=JSON)


def parsed(body: bytes) -> Any:
    """``body`` as JSON, or as text when it is not JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")


class Answer:
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
        """The answer as a 502 list names it."""
        return {"worker": self.worker.id, "status": self.status, "body": parsed(self.body) if self.body else ""}


class AdminContext(Protocol):
    """The process as the admin routes see it (the app).

    Attributes:
        settings: the configuration (``admin_token``, ``admin_timeout``,
            ``weight_update_timeout``, the body limits).
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


def guarded(ctx: AdminContext, endpoint: Endpoint) -> Endpoint:
    """``endpoint`` behind the admin token check (401 without it)."""
    async def checked(request: Request) -> Response:
        token = ctx.settings.admin_token
        if token:
            scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
                return error(401, "Unauthorized: admin routes need 'Authorization: Bearer <admin token>'",
                             {"www-authenticate": "Bearer"})
        return await endpoint(request)

    return checked


async def call(worker: Worker, method: str, target: bytes, body: bytes, headers: list[tuple[bytes, bytes]],
               timeout: float) -> Answer:
    """One request to ``worker`` within ``timeout`` seconds."""
    try:
        with anyio.fail_after(timeout):
            async with worker.pool.request(method.encode(), target, body, headers) as resp:
                data = await resp.read()
                ctype = None if resp.content_type is None else resp.content_type.decode("latin-1")
                return Answer(worker, resp.status, data, ctype)
    except TimeoutError:
        return Answer(worker, None, f"no answer within {timeout:g} s".encode())
    except Unanswered as exc:
        return Answer(worker, None, (str(exc) or type(exc).__name__).encode(), refused=await _refuses(worker, timeout))
    except WorkerError as exc:
        return Answer(worker, None, (str(exc) or type(exc).__name__).encode(), refused=isinstance(exc, ConnectFailed))


async def _refuses(worker: Worker, timeout: float) -> bool:
    """Whether ``worker`` now refuses a new connection (its health read,
    within ``timeout`` seconds): after a call went unanswered, that tells a
    dead worker from a live one that may have taken the call."""
    try:
        with anyio.fail_after(timeout):
            async with worker.probe_pool.request(b"GET", worker.protocol.health_path, idempotent=True) as resp:
                await resp.read()
    except ConnectFailed:
        return True
    except (WorkerError, TimeoutError):
        pass
    return False


async def body_of(ctx: AdminContext, request: Request) -> bytes | Response:
    """The request's body, or the error answer when it cannot be read."""
    try:
        return await read_body(request.receive, ctx.settings.max_body_bytes, None, ctx.settings.body_read_timeout)
    except BodyTooLarge as exc:
        return error(413, str(exc))
    except BodyTimeout:
        return error(408, f"the body was not whole within {ctx.settings.body_read_timeout:g} s")
    except ClientDisconnected:
        return Response(b"", 400)  # nobody is left to read it


def target(request: Request) -> bytes:
    """The request's path and query, less a ``worker`` parameter."""
    query = request.scope.get("query_string", b"")
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    if any(k == "worker" for k, _ in pairs):
        query = urlencode([(k, v) for k, v in pairs if k != "worker"]).encode("latin-1")
    return request.scope["path"].encode() + (b"?" + query if query else b"")


def content_headers(request: Request) -> list[tuple[bytes, bytes]]:
    """The request's content type, to send on."""
    ctype = request.headers.get("content-type")
    return [(b"content-type", ctype.encode("latin-1"))] if ctype else []


def combined(answers: list[Answer], skipped: Sequence[Worker] = ()) -> Response:
    """200 with the first answer when all are 200, else 502 listing each
    (and each of ``skipped``); ``skipped`` named in :data:`SKIPPED_HEADER`."""
    if answers and all(a.status == 200 for a in answers):
        first = answers[0]
        return Response(first.body, 200, skipped_header(skipped), media_type=first.content_type)
    return failed([a.result() for a in answers], skipped)


def failed(results: list[dict[str, Any]], skipped: Sequence[Worker] = ()) -> Response:
    """502 with ``results`` and an entry for each of ``skipped``."""
    results = results + [{"worker": w.id, "status": None, "skipped": True, "body": f"down: {why(w)}"}
                         for w in skipped]
    return Response(orjson.dumps(results), 502, skipped_header(skipped), media_type=JSON)


def skipped_header(skipped: Sequence[Worker]) -> dict[str, str] | None:
    """:data:`SKIPPED_HEADER` naming ``skipped``, if any."""
    return {SKIPPED_HEADER: ", ".join(w.id for w in skipped)} if skipped else None


def why(worker: Worker) -> str:
    """Why ``worker`` is out of the rotation, as the router last said."""
    return worker.last_error or "no health probe passed yet"


async def gather(calls: list[Callable[[], Awaitable[Answer]]]) -> list[Answer]:
    """Run ``calls`` concurrently; their answers in order."""
    answers: list[Answer | None] = [None] * len(calls)

    async def one(i: int) -> None:
        answers[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return answers  # type: ignore[return-value]


def chosen(ctx: AdminContext, protocol: str, request: Request) -> tuple[list[Worker], list[Worker]] | Response:
    """The workers of ``protocol`` a call goes to and the ones skipped as
    down, or the error answer: every one of the protocol, or the one the
    request names; a route ending a pause goes to a worker paused by it
    even when it is down (module docstring)."""
    workers = [w for w in ctx.router.workers if w.protocol.name == protocol]
    if not workers:
        return error(503, f"no worker configured for protocol {protocol!r}")
    path = request.url.path
    named = request.query_params.get("worker") or request.headers.get(WORKER_HEADER)
    if named:
        workers = [w for w in workers if w.id == named]
        if not workers:
            return error(404, f"no worker {named!r} of protocol {protocol!r}")
        if not workers[0].healthy and path not in workers[0].paused:
            return error(503, f"worker {named!r} is down: {why(workers[0])}")
    called = [w for w in workers if w.healthy or path in w.paused]
    return called, [w for w in workers if w not in called]


def _ended_by(worker: Worker, path: str) -> str | None:
    """The route that ends the pause ``path`` puts ``worker``'s engine in,
    ``None`` when ``path`` pauses nothing."""
    return next((end for start, end in worker.protocol.pauses if start == path), None)


async def _counted_call(worker: Worker, method: str, path: str, tgt: bytes, body: bytes,
                       headers: list[tuple[bytes, bytes]], timeout: float) -> Answer:
    """:func:`call`, counted in ``worker.calls`` while in flight, with the
    pause it starts or ends noted in ``worker.paused`` (module docstring)."""
    end = _ended_by(worker, path)
    known = end is None or end in worker.paused
    if end is not None:
        worker.paused.add(end)  # from the moment it is sent: the engine may act on it at once
    worker.calls += 1
    try:
        answer = await call(worker, method, tgt, body, headers, timeout)
    finally:
        worker.calls -= 1
    if not known and (answer.refused or answer.status not in (None, 200)):
        worker.paused.discard(end)  # the engine never got it, or refused it
    if answer.status == 200:
        worker.paused.discard(path)
    return answer


async def call_each(ctx: AdminContext, request: Request, workers: list[Worker], skipped: list[Worker],
                    bodies: Callable[[Worker], bytes], timeout: float,
                    method: str | None = None, path: bytes | None = None) -> list[Answer]:
    """Call every one of ``workers`` (its body from ``bodies``; the request's
    method and target unless given); the answers of those the call reached.
    A worker whose connection was refused is marked down and added to
    ``skipped``; skips are logged."""
    tgt, headers = path or target(request), content_headers(request)
    route = path.decode("latin-1") if path is not None else request.url.path
    called = await gather([(lambda w=w: _counted_call(w, method or request.method, route, tgt, bodies(w), headers,
                                                     timeout))
                           for w in workers])
    answers = []
    for a in called:
        if a.refused:  # the engine never got the call
            ctx.router.mark_down(a.worker, a.body.decode())
            skipped.append(a.worker)
        else:
            answers.append(a)
    if skipped:
        log.warning("%s %s skipped workers that are down: %s", request.method, request.url.path,
                    ", ".join(f"{w.id} ({why(w)})" for w in skipped))
    return answers


def none_up(protocol: str, skipped: list[Worker]) -> Response:
    """503 naming the workers of ``protocol``, all down."""
    down = ", ".join(f"{w.id} ({why(w)})" for w in skipped)
    return error(503, f"no worker of protocol {protocol!r} is up: {down}", skipped_header(skipped))


async def to_every_worker(ctx: AdminContext, protocol: str, request: Request, body: bytes,
                          timeout: float | None = None) -> tuple[Response, list[Answer]]:
    """The call to every worker of ``protocol`` that is up (or the one
    named), within ``timeout`` (default ``admin_timeout``); the combined
    answer and the answers it combined."""
    picked = chosen(ctx, protocol, request)
    if isinstance(picked, Response):
        return picked, []
    workers, skipped = picked
    answers = await call_each(ctx, request, workers, skipped, lambda w: body, timeout or ctx.settings.admin_timeout)
    if not answers:
        return none_up(protocol, skipped), []
    if any(request.url.path in w.paused for w in skipped):  # a pause it could not end
        return failed([a.result() for a in answers], skipped), answers
    return combined(answers, skipped), answers
