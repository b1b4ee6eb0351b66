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

Admin routes, each fanned out to every worker of its protocol that is up,
every role, within ``admin_timeout`` seconds, as
:mod:`asgi_generate.ops.fanout` says (the admin token, a named worker, the
combined answer, skipped workers):

- SGLang (``http_server.py``): ``GET``/``POST /flush_cache``,
  ``POST /pause_generation``, ``/continue_generation``,
  ``GET``/``POST /release_memory_occupation``,
  ``/resume_memory_occupation``; ``POST /abort_request`` (below).
- vLLM dev routes (``vllm/entrypoints/serve/dev/``): ``POST /reset_prefix_cache``,
  ``/sleep``, ``/wake_up``, ``GET /is_sleeping``, ``POST /pause``, ``/resume``,
  ``GET /is_paused``; ``POST /abort_requests`` (below).

The weight routes are :mod:`asgi_generate.ops.weights`'s.

A pause that aborts running requests (SGLang ``/pause_generation``
``abort``, vLLM ``/pause?mode=abort``) is noted before it reaches the
engines, and the fleet's resume (``/continue_generation``, ``/resume``)
after it was answered, so that streams may be held across it
(:mod:`asgi_generate.workers.pauses`, ``--resume-after-pause``). The
sibling processes of ``serve --workers N`` are told of the pause before
the engines get it; they and other replicas learn the resume from the
engines (:mod:`asgi_generate.workers.fleet_state`). vLLM's
``/pause?mode=wait`` answers once the engines' running requests finished.

``POST /abort_request`` ``{"abort_all": true}`` fans out as above. With
``{"rid": R}`` it aborts the frontend's own live SGLang requests whose
public id starts with ``R`` (SGLang's scheduler matches by prefix), each by
its minted engine id on whichever workers run its legs (a batch's items each
by their own public id, ``rid_0``, ``rid_1``, ..., so ``rid`` ends every
unfinished item); their clients see the engine's abort finish. An empty ``rid`` aborts nothing, as SGLang does.

``POST /abort_requests`` ``{"request_ids": [...]}`` does the same for vLLM
requests, matching whole public ids (vLLM ignores ids it does not know);
an empty or absent list aborts every vLLM request the frontend runs (vLLM
``rl/online/api_router.py`` ``abort_requests`` aborts all it tracks), each
by its engine id. It answers vLLM's ``{"status": "aborted", "aborted": N}``.

Both routes are one endpoint, :func:`_abort`, read from the engine's
:attr:`~asgi_generate.protocols.WorkerProtocol.public_abort`. Each engine id
is sent at most one abort, whatever the calls that name it
(:class:`~asgi_generate.workers.aborts.AbortQueue`).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import cache

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from ..protocols import PROTOCOLS
from ..sdk import _ids as ids
from ..request.batches import named_legs
from ..workers.aborts import ACKED
from ..workers.fleet_state import PAUSE
from ..workers.router import Worker
from . import weights
from .fanout import (AdminContext, Answer, Endpoint, body_of, call, combined, error, gather, guarded, parsed,
                     target, to_every_worker)

INFO_PATHS = ("/get_model_info", "/model_info", "/get_server_info", "/server_info")


@cache
def paths() -> frozenset[str]:
    """Every path this module serves (the app's dispatch sends these here):
    the info routes, ``/health_generate``, each engine's abort route (where
    it has :attr:`~asgi_generate.protocols.WorkerProtocol.public_abort`), its admin routes
    (:attr:`~asgi_generate.protocols.WorkerProtocol.admin_routes`) and the
    weight routes (:func:`asgi_generate.ops.weights.paths`)."""
    return frozenset({*INFO_PATHS, "/health_generate",
                      *(engine.abort_path.decode() for engine in PROTOCOLS.values() if engine.public_abort),
                      *(path for engine in PROTOCOLS.values() for path, _ in engine.admin_routes), *weights.paths()})


def _aborting_pause(protocol: str, request: Request, body: bytes) -> bool:
    """Whether the call is a pause that aborts running requests, as
    ``protocol``'s description says (SGLang ``/pause_generation`` with
    ``mode`` ``abort``, vLLM ``/pause`` with ``mode=abort``)."""
    says = PROTOCOLS[protocol].aborting_pause
    return says is not None and says(request.url.path, request.query_params,
                                     lambda: parsed(body) if body.strip() else {})


def build(ctx: AdminContext) -> Router:
    """The starlette router serving :func:`paths` for ``ctx`` (its workers,
    in-flight requests and settings), which it reads at each request."""
    routes = [Route(path, _info(ctx), methods=["GET"]) for path in INFO_PATHS]
    routes.append(Route("/health_generate", _health_generate(ctx), methods=["GET"]))
    for engine in PROTOCOLS.values():
        if engine.public_abort is not None:
            routes.append(Route(engine.abort_path.decode(), guarded(ctx, _abort(ctx, engine.name)), methods=["POST"]))
    for engine in PROTOCOLS.values():
        for path, methods in engine.admin_routes:
            routes.append(Route(path, guarded(ctx, _fan_out(ctx, engine.name)), methods=list(methods)))
    routes += weights.routes(ctx)
    return Router(routes)


def _fan_out(ctx: AdminContext, protocol: str) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        body = await body_of(ctx, request)
        if isinstance(body, Response):
            return body
        pauses, path = ctx.router.pauses, request.url.path
        engine = PROTOCOLS[protocol]
        aborting = _aborting_pause(protocol, request, body)
        if not aborting and path not in engine.resumes:
            response, answers = await to_every_worker(ctx, protocol, request, body)
        else:
            # This process's own pause or resume: the fleet's readings wait for its answer.
            fleet = ctx.router.fleet
            with fleet.local_call(protocol, PAUSE):
                if aborting:
                    pauses.begin(protocol)  # before the engines abort: their aborts are the pause's
                # ... and in the sibling processes, told before the engines get it.
                async with fleet.aborting_pause(protocol, ctx.settings.admin_timeout) if aborting else nullcontext():
                    response, answers = await to_every_worker(ctx, protocol, request, body)
                if path in engine.resumes:
                    pauses.end(protocol)
        if path in engine.cache_resets:
            for a in answers:
                if a.status == 200:  # that engine's prefix cache is empty now
                    ctx.router.policy.forget(a.worker)
        return response

    return endpoint


def _abort(ctx: AdminContext, protocol: str) -> Endpoint:
    """The engine's own abort route (:attr:`~asgi_generate.protocols.WorkerProtocol.abort_path`)
    for the requests the frontend runs on it, as its
    :attr:`~asgi_generate.protocols.WorkerProtocol.public_abort` says."""
    how = PROTOCOLS[protocol].public_abort

    async def endpoint(request: Request) -> Response:
        body = await body_of(ctx, request)
        if isinstance(body, Response):
            return body
        named, abort_all = how.read(body)
        if abort_all is None:
            return Response(named, 400, media_type="application/json")
        if abort_all and how.fan_out_all:
            return (await to_every_worker(ctx, protocol, request, body))[0]
        answers, aborted = await abort_named(ctx, protocol, named, abort_all)
        if ctx.router.fleet.share is not None:
            # The sibling processes of serve --workers N run the rest of the requests.
            await ctx.router.fleet.share({"kind": "abort", "protocol": protocol, "named": named, "all": abort_all})
        if not all(a.status == 200 for a in answers):
            return combined(answers)
        answer = how.answer(body, aborted)
        return Response(answer, 200, media_type="application/json" if answer else None)

    return endpoint


async def abort_named(ctx: AdminContext, protocol: str, named: list[str], abort_all: bool) -> tuple[list[Answer], int]:
    """Abort, on its engine, every live leg of this process's ``protocol``
    requests whose public id ``named`` holds (as the engine description's
    :attr:`~asgi_generate.protocols.WorkerProtocol.public_abort` matches
    ids), or every one with ``abort_all``: each leg's answer (200 once its
    engine acknowledged) and how many legs that is."""
    how = PROTOCOLS[protocol].public_abort
    exact = set(named)

    def hit(public: str | None) -> bool:
        if abort_all:
            return True
        if how.by_prefix:
            return any(public is not None and public.startswith(r) for r in named)
        return public in exact

    legs = {
        (worker.id, engine_id): (worker, engine_id)
        for gen in list(ctx.inflight.values())
        if gen.codec.worker_protocol == protocol
        for public, worker, engine_id in named_legs(gen)
        if hit(public)
    }

    async def abort(worker: Worker, engine_id: str) -> Answer:
        result = await ctx.abort_engine_request(worker, engine_id)
        if result == ACKED:
            return Answer(worker, 200, b"")
        return Answer(worker, None, f"abort {result}".encode())

    return await gather([(lambda w=w, e=e: abort(w, e)) for w, e in legs.values()]), len(legs)


def _info(ctx: AdminContext) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        native = _native()
        for worker in _healthy(ctx, native):
            answer = await call(worker, "GET", target(request), b"", [], ctx.settings.admin_timeout)
            if answer.status is not None:
                return Response(answer.body, answer.status, media_type=answer.content_type)
        return error(503, f"no healthy worker for protocol {native!r}")

    return endpoint


def _native() -> str:
    """The engine the frontend's own info routes speak for (:attr:`~asgi_generate.protocols.WorkerProtocol.native_admin`:
    they are SGLang's routes); ``""`` when none is installed."""
    native = PROTOCOLS.where(native_admin=True)
    return native[0].name if native else ""


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
            return error(503, "no worker generated a token for: " + ", ".join(map(repr, failures)))
        return Response(b"", 200)

    return endpoint


async def _generates(ctx: AdminContext, protocol: str) -> bool:
    """Whether one healthy worker of ``protocol`` generates a token now."""
    asked = PROTOCOLS[protocol].health_generate
    if asked is None:
        return False
    path, body = asked
    for worker in _healthy(ctx, protocol):
        if body is None:
            answer = await call(worker, "GET", path, b"", [], ctx.settings.admin_timeout)
        else:
            headers = [(b"content-type", b"application/json"), (b"x-request-id", b"health-" + ids.mint().encode())]
            answer = await call(worker, "POST", path, body, headers, ctx.settings.admin_timeout)
        if answer.status == 200:
            return True
    return False
