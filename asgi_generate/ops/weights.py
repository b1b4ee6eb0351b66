"""Weight routes: a trainer's weight updates, made to the whole fleet.

A trainer talks to one URL, the frontend's; behind it are N engines, each
with its own parallel size. Every route here is an admin route (the token,
a named worker, skipped workers and the combined answer as
:mod:`asgi_generate.ops.fanout` says) whose deadline per worker is
``weight_update_timeout``. It is a fleet transaction: 200 only when every
worker called answered 200, else 502 with each worker's result.

The same body goes to every worker of the protocol, but for the rank
arithmetic below:

- SGLang (``srt/entrypoints/http_server.py``): ``POST
  /destroy_weights_update_group``, ``/update_weights_from_distributed``,
  ``/update_weights_from_tensor``, ``/update_weights_from_ipc``,
  ``/update_weights_from_disk``, ``/begin_weight_update``,
  ``/end_weight_update``, ``GET``/``POST
  /get_weights_by_name``, ``/weights_checker``. Tensor handles and IPC
  socket paths name one engine's devices: name the worker (``?worker=w1``).
- vLLM (``vllm/entrypoints/rl/online/api_router.py``): ``POST
  /shutdown_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, ``/weight_checker``,
  ``GET /weight_info``.
- Both: ``POST /update_weight_version`` (``new_version``) goes to every
  worker of either protocol.

Rank arithmetic. ``POST /init_weights_update_group`` (SGLang,
``InitWeightsUpdateGroupReqInput``) and ``POST /init_weight_transfer_engine``
(vLLM, its ``init_info``: ``NCCLWeightTransferInitInfo``) set up one NCCL
group of the trainer's ranks and every engine's. The client's
``rank_offset`` is the first engine rank (the trainer's ranks are below it,
usually just rank 0). Each worker called, in the order ``/v1/models`` lists
them, gets the ranks after the previous workers': worker ``i``'s
``rank_offset`` is the client's plus the parallel sizes of workers ``0 ..
i-1``, and every worker gets one ``world_size``, the client's ``rank_offset``
plus the sum of the parallel sizes. A worker's parallel size is read from
it first: SGLang ``GET /get_server_info`` ``tp_size`` (its ranks are
``rank_offset + tp_rank``, ``weight_updater.py``
``init_weights_update_group``), vLLM ``GET /get_world_size`` ``world_size``
(tensor x pipeline x data parallel). A client ``world_size`` that is not that
sum is refused with 400 (the trainer joins the same group with it); leave it
out, or read it first from ``GET /get_world_size``, which answers the
fleet's sum for vLLM (``{"world_size"}``) and, with ``?protocol=sglang``, for
SGLang. The 200 answer is the first worker's plus ``world_size`` and
``assignment``: ``[{"worker", "rank_offset", "ranks"}]`` per worker; a 502's
list gives each worker's ``rank_offset`` and ``ranks`` with its result.

A call that aborts running requests without pausing (each engine's
``aborting_call``: SGLang's weight routes with ``abort_all_requests``, true
by default for ``/update_weight_version``) is a fleet transaction
(:meth:`asgi_generate.workers.pauses.Pauses.call`) from before the engines
get it until it was answered: with ``--resume-after-pause`` the streams it
aborted are held until then and resume on the new weights.

The version fence (:mod:`asgi_generate.workers.router`). A route that loads
weights or sets their version (each engine's ``weight_loads``, and
:data:`LOADS`) tells the router which workers
now serve which version; called on the whole fleet, its version becomes the
fleet's, and every worker that did not answer 200 is fenced out of the
rotation, unless every worker refused the call with a 4xx (a bad body: no
weights changed anywhere, nothing is fenced). A fenced worker named in a
later call that loads the fleet's version (any, while no fleet call set
one) is back. ``POST /clear_weight_fence?worker=wN`` lets a fenced worker back
(an operator fixed it): its weight version is read from its engine again,
and it takes requests once that is the fleet's; the answer is ``{"worker",
"weight_version", "in_rotation"}``. Fences are no engine's state: the
process that took the call tells its siblings of one ``serve --workers N``
(:meth:`~asgi_generate.workers.fleet_state.FleetState.tell_siblings`); the
weight versions every process reads from the engines
(:mod:`asgi_generate.workers.fleet_state`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..protocols import PROTOCOLS
from ..workers.fleet_state import WEIGHTS
from ..workers.router import Worker
from .fanout import (JSON, WORKER_HEADER, AdminContext, Answer, Endpoint, body_of, call_each, chosen, error, failed,
                     guarded, none_up, parsed, skipped_header, to_every_worker)

#: The frontend's own route that sets the weight version, on every engine:
#: the body field naming it, and no weights loaded (the engines' own weight
#: routes are their descriptions' ``weight_loads``).
LOADS = {"/update_weight_version": ("new_version", False)}


@cache
def paths() -> frozenset[str]:
    """Every path this module serves: each engine's weight routes
    (:attr:`~asgi_generate.protocols.WorkerProtocol.weight_routes`) and
    group set-up route, ``/get_world_size``, ``/update_weight_version``
    (both engines') and ``/clear_weight_fence``."""
    engines = PROTOCOLS.values()
    return frozenset({*(path for e in engines for path, _ in e.weight_routes),
                      *(e.group_init[0] for e in engines if e.group_init is not None),
                      "/get_world_size", "/update_weight_version", "/clear_weight_fence"})


def routes(ctx: AdminContext) -> list[Route]:
    """The starlette routes of :func:`paths` for ``ctx``."""
    engines = PROTOCOLS.values()
    out = [Route(path, guarded(ctx, _fan_out(ctx, e.name)), methods=list(methods))
           for e in engines for path, methods in e.weight_routes]
    out.append(Route("/update_weight_version", guarded(ctx, _version(ctx)), methods=["POST"]))
    out += [Route(e.group_init[0], guarded(ctx, _init_group(ctx, e.name)), methods=["POST"])
            for e in engines if e.group_init is not None]
    out.append(Route("/get_world_size", guarded(ctx, _world_size(ctx)), methods=["GET"]))
    out.append(Route("/clear_weight_fence", guarded(ctx, _clear_fence(ctx)), methods=["POST"]))
    return out


def _fan_out(ctx: AdminContext, protocol: str) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        body = await body_of(ctx, request)
        if isinstance(body, Response):
            return body
        return await _to_fleet(ctx, protocol, request, body)

    return endpoint


async def _to_fleet(ctx: AdminContext, protocol: str, request: Request, body: bytes) -> Response:
    """The call to every worker of ``protocol`` (or the named one); when
    it changes weights, the router told who loaded what and who failed."""
    with ctx.router.fleet.local_call(protocol, WEIGHTS):  # the fleet's readings wait for its answer
        response, answers = await _weight_call(ctx, protocol, request, body)
    if answers:
        await ctx.router.fleet.tell_siblings(protocol)  # fences are this process's: no engine holds them
    return response


async def _weight_call(ctx: AdminContext, protocol: str, request: Request, body: bytes) -> tuple[Response, list]:
    """:func:`_to_fleet`'s call, its answer and, when it changed weights or their
    version, the workers' answers (else none)."""
    aborts = PROTOCOLS[protocol].aborting_call
    if aborts is not None and aborts(request.url.path, request.query_params,
                                     lambda: parsed(body) if body.strip() else {}):
        # A fleet transaction from before the engines abort until answered:
        # the streams they abort may be held until then.
        async with ctx.router.fleet.aborting_call(protocol, ctx.settings.weight_update_timeout):
            response, answers = await to_every_worker(ctx, protocol, request, body,
                                                      ctx.settings.weight_update_timeout)
    else:
        response, answers = await to_every_worker(ctx, protocol, request, body, ctx.settings.weight_update_timeout)
    path = request.url.path
    load = LOADS.get(path) or PROTOCOLS[protocol].weight_load(path)
    if load is not None and answers:
        field, with_weights = load
        obj = parsed(body) if body.strip() else {}
        version = obj.get(field) if field is not None and isinstance(obj, dict) else None
        failed = {a.worker: f"failed {request.url.path}: {a.status or 'no answer'} "
                            f"{a.body[:200].decode('utf-8', 'replace')}"
                  for a in answers if a.status != 200}
        fleet = not (request.query_params.get("worker") or request.headers.get(WORKER_HEADER))
        loaded = [a.worker for a in answers if a.status == 200]
        if fleet and not loaded and all(a.status is not None and 400 <= a.status < 500 for a in answers):
            # Every worker refused the call (a bad body): no weights changed
            # anywhere, so no worker is behind the others and none is fenced.
            return response, []
        ctx.router.weights_loaded(protocol, loaded, failed, version if isinstance(version, str) else None, fleet,
                                  with_weights)
        return response, answers
    return response, []


def _version(ctx: AdminContext) -> Endpoint:
    """``/update_weight_version``: both engines serve it, with one body
    (``new_version``); every worker of either protocol gets it."""
    async def endpoint(request: Request) -> Response:
        body = await body_of(ctx, request)
        if isinstance(body, Response):
            return body
        protocols = [e.name for e in PROTOCOLS.where(weight_version_path=True)
                     if any(w.protocol is e for w in ctx.router.workers)]
        if not protocols:
            return error(503, "no worker configured")
        responses = [await _to_fleet(ctx, p, request, body) for p in protocols]
        refused = [r for r in responses if r.status_code != 200]
        if not refused:
            return responses[0]
        if len(responses) == 1:
            return refused[0]
        return Response(orjson.dumps([x for r in refused for x in _listed(r)]), 502, media_type=JSON)

    return endpoint


def _listed(response: Response) -> list[Any]:
    """A refused answer's per-worker list (a 502's), or the answer as one entry."""
    obj = parsed(bytes(response.body))
    return obj if isinstance(obj, list) else [{"status": response.status_code, "body": obj}]


async def _parallel_sizes(ctx: AdminContext, protocol: str, request: Request, workers: list[Worker],
                          skipped: list[Worker]) -> list[Answer]:
    path, _ = PROTOCOLS[protocol].parallel_size  # type: ignore[misc]
    return await call_each(ctx, request, workers, skipped, lambda w: b"", ctx.settings.weight_update_timeout,
                           "GET", path)


def _size(protocol: str, answer: Answer) -> int | None:
    """A worker's parallel size from its info answer, ``None`` when it gave none."""
    obj = parsed(answer.body) if answer.status == 200 else None
    _, field = PROTOCOLS[protocol].parallel_size  # type: ignore[misc]
    size = obj.get(field) if isinstance(obj, dict) else None
    return size if type(size) is int and size > 0 else None


async def _sizes(ctx: AdminContext, protocol: str, request: Request) -> tuple[list[tuple[Worker, int]],
                                                                                list[Worker]] | Response:
    """The workers to call with their parallel sizes and the ones skipped,
    or the error answer (502 naming a worker whose size cannot be read)."""
    picked = chosen(ctx, protocol, request)
    if isinstance(picked, Response):
        return picked
    workers, skipped = picked
    answers = await _parallel_sizes(ctx, protocol, request, workers, skipped)
    if not answers:
        return none_up(protocol, skipped)
    unread = [a for a in answers if _size(protocol, a) is None]
    if unread:
        return failed([{**a.result(), "body": f"no parallel size: {a.body.decode('utf-8', 'replace')}"}
                       for a in unread], skipped)
    return [(a.worker, _size(protocol, a)) for a in answers], skipped  # type: ignore[misc]


def _world_size(ctx: AdminContext) -> Endpoint:
    """``GET /get_world_size``: the fleet's sum (vLLM's shape)."""
    async def endpoint(request: Request) -> Response:
        sized = [e.name for e in PROTOCOLS.where(parallel_size=True)]
        # By default the engine whose own route this is.
        native = [e.name for e in PROTOCOLS.values() if e.parallel_size and e.parallel_size[0] == b"/get_world_size"]
        protocol = request.query_params.get("protocol", native[0] if native else "")
        if protocol not in sized:
            return error(400, f"protocol must be {' or '.join(map(repr, sized))}")
        sizes = await _sizes(ctx, protocol, request)
        if isinstance(sizes, Response):
            return sizes
        total = sum(size for _, size in sizes[0])
        return Response(orjson.dumps({"world_size": total}), 200, skipped_header(sizes[1]), media_type=JSON)

    return endpoint


def _init_group(ctx: AdminContext, protocol: str) -> Endpoint:
    """A group's set-up, with each worker's ranks (module docstring)."""
    async def endpoint(request: Request) -> Response:
        body = await body_of(ctx, request)
        if isinstance(body, Response):
            return body
        obj = parsed(body) if body.strip() else None
        wrap = PROTOCOLS[protocol].group_init[1]  # type: ignore[index]
        args = obj.get(wrap) if wrap is not None and isinstance(obj, dict) else obj
        if not isinstance(args, dict):
            what = f"an object with an {wrap!r} object" if wrap is not None else "a JSON object"
            return error(400, f"the body must be {what}")
        offset = args.get("rank_offset")
        if type(offset) is not int or offset < 0:
            return error(400, "'rank_offset' (the first engine rank: the trainer's ranks are below it) "
                              "must be an integer >= 0")
        sizes = await _sizes(ctx, protocol, request)
        if isinstance(sizes, Response):
            return sizes
        workers, skipped = sizes
        world = offset + sum(size for _, size in workers)
        given = args.get("world_size")
        if given is not None and given != world:
            return error(400, f"world_size {given!r} is not the group's: rank_offset {offset} plus the "
                              f"workers' parallel sizes ({', '.join(f'{w.id}: {n}' for w, n in workers)}) "
                              f"is {world}")
        assignment: dict[str, dict[str, Any]] = {}
        for w, size in workers:
            assignment[w.id] = {"worker": w.id, "rank_offset": offset, "ranks": size}
            offset += size

        def body_for(w: Worker) -> bytes:
            mine = {**args, "rank_offset": assignment[w.id]["rank_offset"], "world_size": world}
            return orjson.dumps({**obj, wrap: mine} if wrap is not None else mine)

        answers = await call_each(ctx, request, [w for w, _ in workers], skipped, body_for,
                                  ctx.settings.weight_update_timeout)
        if not answers:
            return none_up(protocol, skipped)
        if all(a.status == 200 for a in answers):
            first = parsed(answers[0].body)
            answer = {**(first if isinstance(first, dict) else {"answer": first}), "world_size": world,
                      "assignment": [assignment[a.worker.id] for a in answers]}
            return Response(orjson.dumps(answer), 200, skipped_header(skipped), media_type=JSON)
        return failed([{**a.result(), **assignment[a.worker.id]} for a in answers], skipped)

    return endpoint


def _clear_fence(ctx: AdminContext) -> Endpoint:
    """``POST /clear_weight_fence?worker=wN``: an operator lets a fenced
    worker back; its weight version is read from its engine again."""
    async def endpoint(request: Request) -> Response:
        named = request.query_params.get("worker") or request.headers.get(WORKER_HEADER)
        worker = next((w for w in ctx.router.workers if w.id == named), None)
        if worker is None:
            return error(404, f"no worker {named!r}" if named else "name the worker: ?worker=wN")
        ctx.router.clear_fence(worker, await ctx.router.read_weight_version(worker))
        await ctx.router.fleet.tell_siblings(worker.protocol.name)
        answer = {"worker": worker.id, "weight_version": worker.weight_version,
                  "in_rotation": ctx.router.routable(worker)}
        return Response(orjson.dumps(answer), 200, media_type=JSON)

    return endpoint
