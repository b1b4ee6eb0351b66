"""Engine descriptions: how the frontend talks to an engine besides generating.

Each engine's native API has its own health, info and abort routes, its own
P/D handshake, admin and weight routes. A :class:`WorkerProtocol` holds all
of that as data; each engine's description is registered through the
``asgi_generate.engines`` entry point group, as codecs are through
``asgi_generate.codecs``::

    [options.entry_points]
    asgi_generate.engines =
        myengine = my_package.engine:ENGINE

The entry point names a :class:`WorkerProtocol` (or a zero-argument
factory returning one) carrying the entry point's name. SGLang's and
vLLM's descriptions live in their codec distributions. :data:`PROTOCOLS`,
the descriptions by name, loads the group on first use; an entry point that
fails to load, gives something else, or claims a name another one claims is
reported by name (:class:`EngineLoadError`). Codecs name the engine they
ride on; the handler uses its description to abort and pair legs, the
router to probe. Pure data at the bottom of the package: the settings check
worker specs against it (:mod:`asgi_generate.worker_specs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable, Iterator, Mapping
from urllib.parse import parse_qsl

import orjson

from .exceptions import EngineLoadError

GROUP = "asgi_generate.engines"
#: A fanned-out route: path and the HTTP methods it takes.
RouteSpec = tuple[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class PublicAbort:
    """How the frontend serves an engine's own abort route
    (:attr:`WorkerProtocol.abort_path`) for the requests it runs
    (:mod:`asgi_generate.ops.admin`).

    Attributes:
        read: the route's body (bytes) read as ``(public ids named, abort
            all)``, or a refusal: ``(its 400 JSON body, None)``.
        by_prefix: a named id aborts every public id it begins (SGLang's
            scheduler); else only the id itself (vLLM).
        answer: the 200 body, given the route's body and how many engine
            legs the frontend aborted.
        fan_out_all: abort all is the body sent as it is to every worker of
            the engine (SGLang ``abort_all``); else each live leg the
            frontend runs there is aborted by its engine id.
    """

    read: "Callable[[bytes], tuple[list[str], bool] | tuple[bytes, None]]"
    by_prefix: bool
    answer: "Callable[[bytes, int], bytes]"
    fan_out_all: bool


@dataclass(frozen=True, slots=True)
class WorkerProtocol:
    """One engine's description, as data.

    Attributes:
        name: the engine's name (its entry point's), as worker specs and
            codecs name it.
        health_path: GET, 200 when the engine serves.
        info_path: GET, JSON server info (see :meth:`read_info`).
        abort_path: POST route that aborts requests by id.
        info_reader: the info route's JSON object, normalised (see
            :meth:`read_info`).
        abort_field: the abort body's one field, naming the ids to abort.
        abort_takes_list: whether that field is a list (vLLM's
            ``/abort_requests``), so one abort request can name many ids;
            else it names one (SGLang's ``/abort_request``: one ``rid``).
        engine_id_prefix: what the engine puts before the id it was given
            (vLLM's ``generate-tokens-``).
        version_path: GET, ``{"version": ...}``, when the info route does
            not carry the engine version (vLLM ``show_version``).
        pd: the P/D handshake the frontend runs this protocol's
            prefill/decode pairs with (:mod:`asgi_generate.request.handshakes`):
            ``concurrent`` (both legs at once, joined by :attr:`pair_join`'s
            fields) or ``sequential`` (the prefill leg's answer carried by
            the decode leg); ``None``: no P/D.
        pair_join: a ``concurrent`` pair's join fields, which both legs'
            bodies carry: ``pair_join(host, join_port, rooms)`` with the
            prefill worker's host (IPv6 in brackets), its join port
            (:attr:`join_query`) and the room minted per pair (a list, one
            per entry, for a batch).
        pd_items_refusal: why a request of several items (a batch, ``n`` >
            1) cannot run on this protocol's pairs, the client's 400;
            ``None``: it can.
        models_path: GET, the OpenAI model list, read for ``max_model_len``
            when the info route lacks the context length (SGLang).
        weight_version_path: GET, ``{"weight_version": ...}``: the weights
            the engine serves (SGLang ``get_model_info``, vLLM
            ``rl/online/api_router.py`` ``weight_info``).
        join_query: the URL query parameter naming a prefill worker's join
            port (SGLang's ``bootstrap_port``): a prefill worker's URL may
            end ``?NAME=PORT``; ``None``: no worker URL takes a query.
        default_join_port: a prefill worker's join port when its URL names
            none (SGLang's ``--disaggregation-bootstrap-port`` default).
        join_port_info_field: the server info field in which a prefill
            worker reports the join port it took (the embedded simulators
            take a free one).
        simulated: the simulator (``asgi-generate sim --protocol NAME``)
            speaks this engine, so ``serve`` can embed it.
        sim_pd_flags: the simulator's flags for a prefill and a decode
            worker; ``None``: no simulated P/D.
        admin_routes: the engine's admin routes the frontend fans out to its
            workers as they are.
        weight_routes: the engine's weight routes fanned out as they are.
        group_init: the weight-update group set-up route and the body field
            wrapping its arguments (vLLM's ``init_info``; ``None``: the body
            is the arguments); ``None``: no such route.
        parallel_size: the GET route and field of a worker's parallel size
            (ranks), read to assign group ranks; ``None``: none.
        health_generate: how to ask a worker for one token: the path and,
            for a POST, its JSON body (``None``: GET).
        native_admin: the frontend's own server info routes and
            ``/abort_request`` speak for this engine's workers (they are
            SGLang's routes).
        generate_path: the engine's native generate route (the trace
            replay's target).
        replay_body: the streamed native request body of a replayed row:
            ``replay_body(token_ids, max_tokens, request_id)``.
        replay_progress: one streamed event of that request read as
            ``(output tokens so far, finished)``:
            ``replay_progress(event, so_far)``.
        load_path: GET, the engine's own queue figures, summed over its DP
            ranks by :attr:`load_reader` (:mod:`asgi_generate.workers.engine_load`);
            ``None``: it serves none.
        load_reader: that route's body read as ``(requests running plus
            waiting, prompt tokens waiting uncached)``, optionally with a
            third figure: the KV cache's usage as a fraction (``None``:
            not reported).

            Raises ValueError for a body not of the route's shape.
        weight_loads: the weight routes that change the weights or their
            version: ``(path, the body field naming the new version or
            None, whether the call loads weights too)`` (the version fence,
            :mod:`asgi_generate.workers.fence`; :meth:`weight_load`).
        cache_resets: admin routes that empty the engine's prefix cache
            (the routing policy forgets what it knew of it).
        resumes: admin routes that end a pause
            (:mod:`asgi_generate.workers.pauses`).
        pauses: admin routes after which the engine serves no generation
            (its health route may stall) until another is called: ``(the
            route, the route that ends it)`` (a pause, a sleep, a release
            of memory); while one the frontend sent holds, a failing health
            probe does not take the worker out, and the ending route
            reaches it even when it is down
            (:mod:`asgi_generate.ops.fanout`).
        kv_events_path: GET, where the worker says it publishes its KV
            cache events (:mod:`asgi_generate.workers.policies.kv_sources`);
            ``None``: it says nowhere.
        kv_events_reader: that route's JSON read with the worker URL's host
            as ``((publisher endpoint, replay endpoint or None, topic) or
            None, block size or None, why there is none)``, a wildcard host
            dialled as the worker's (:func:`dial`).
        pause_path: GET, whether the engine is paused now, read by every
            frontend process (:mod:`asgi_generate.workers.fleet_state`);
            ``None``: it says nowhere.
        pause_reader: that route's answer read as paused (``True``), not
            paused (``False``) or unknown (``None``):
            ``pause_reader(status, body)``.
        aborting_pause: whether an admin call is a pause that aborts running
            requests: ``aborting_pause(path, query, body)`` with the query
            parameters and the body as parsed JSON (a callable, read only
            when needed); ``None``: the engine has no such pause.
        aborting_call: whether a weight call aborts running requests
            without pausing (its streams may be held until the call was
            answered): ``aborting_call(path, query, body)`` as
            :attr:`aborting_pause`; ``None``: no such call.
        public_abort: the frontend serves :attr:`abort_path` for the
            requests it runs on this engine, as :class:`PublicAbort` says;
            ``None``: it does not.
    """

    name: str
    health_path: bytes
    info_path: bytes | None
    abort_path: bytes
    info_reader: Callable[[dict], dict]
    abort_field: str
    abort_takes_list: bool = False
    engine_id_prefix: str = ""
    version_path: bytes | None = None
    pd: str | None = None
    pair_join: "Callable[[str, int | None, list[int] | int], dict] | None" = None
    pd_items_refusal: str | None = None
    models_path: bytes | None = None
    weight_version_path: bytes | None = None
    join_query: str | None = None
    default_join_port: int | None = None
    join_port_info_field: str | None = None
    simulated: bool = False
    sim_pd_flags: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    admin_routes: tuple[RouteSpec, ...] = ()
    weight_routes: tuple[RouteSpec, ...] = ()
    group_init: tuple[str, str | None] | None = None
    parallel_size: tuple[bytes, str] | None = None
    health_generate: tuple[bytes, bytes | None] | None = None
    native_admin: bool = False
    generate_path: str = "/generate"
    replay_body: "Callable[[list[int], int, str], dict] | None" = None
    replay_progress: "Callable[[dict, int], tuple[int, bool]] | None" = None
    load_path: bytes | None = None
    load_reader: "Callable[[bytes], tuple[int, int] | tuple[int, int, float | None]] | None" = None
    weight_loads: tuple[tuple[str, str | None, bool], ...] = ()
    cache_resets: tuple[str, ...] = ()
    resumes: tuple[str, ...] = ()
    pauses: tuple[tuple[str, str], ...] = ()
    aborting_pause: "Callable[[str, Mapping[str, str], Callable[[], object]], bool] | None" = None
    aborting_call: "Callable[[str, Mapping[str, str], Callable[[], object]], bool] | None" = None
    pause_path: bytes | None = None
    pause_reader: "Callable[[int, bytes], bool | None] | None" = None
    public_abort: PublicAbort | None = None
    kv_events_path: bytes | None = None
    kv_events_reader: "Callable[[object, str], tuple[tuple[str, str | None, str] | None, int | None, str]] | None" = None

    def read_info(self, obj: object) -> dict:
        """Normalise the info route's JSON, with the context length in tokens
        as ``max_model_len`` (``None`` when unknown), by :attr:`info_reader`
        (:func:`read_model_card` for an OpenAI model list). Anything
        unexpected gives ``{}``."""
        if not isinstance(obj, dict):
            return {}
        return self.info_reader(obj)

    @staticmethod
    def read_version(obj: object, field: str = "version") -> str | None:
        """The ``field`` string of a ``version_path`` (or, with
        ``weight_version``, ``weight_version_path``) answer, else ``None``."""
        version = obj.get(field) if isinstance(obj, dict) else None
        return version if isinstance(version, str) else None

    def abort_body(self, engine_ids: list[str]) -> bytes:
        """The abort request body for ``engine_ids`` (ids as minted; more
        than one only where :attr:`abort_takes_list`), each with the
        engine's prefix."""
        named = [self.engine_id_prefix + i for i in engine_ids]
        if self.abort_takes_list:
            return orjson.dumps({self.abort_field: named})
        (engine_id,) = named
        return orjson.dumps({self.abort_field: engine_id})

    def weight_load(self, path: str) -> tuple[str | None, bool] | None:
        """What a call of weight route ``path`` changes (see
        :attr:`weight_loads`), ``None`` when it changes neither the weights
        nor their version."""
        for route, version_field, loads in self.weight_loads:
            if route == path:
                return version_field, loads
        return None

    def split_url(self, url: str, role: str) -> tuple[str, int | None]:
        """A configured worker URL's base URL and join port: a prefill
        worker's ``?`` :attr:`join_query` ``=PORT``, else
        :attr:`default_join_port`, for an engine with a join query; ``None``
        for the others."""
        base, _, query = url.partition("?")
        if role != "prefill" or self.join_query is None:
            return base.rstrip("/"), None
        port = dict(parse_qsl(query)).get(self.join_query)
        return base.rstrip("/"), int(port) if port else self.default_join_port


def read_model_card(obj: object) -> dict:
    """``{"served_model_name", "max_model_len", "root"}`` of the first model of an
    OpenAI ``/v1/models`` list; both engines put the context length they
    enforce there (SGLang ``http_server.available_models``:
    ``model_config.context_len``; vLLM ``OpenAIServingModels.show_available_models``:
    ``max_model_len``). Anything unexpected gives ``{}``."""
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return {}
    first = data[0]
    return {"served_model_name": first.get("id"), "max_model_len": positive_int(first.get("max_model_len")),
            "root": first.get("root")}


#: Hosts an engine binds its publisher to that a subscriber cannot dial.
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


def dial(name: str, host: str) -> str:
    """The host to dial for a publisher bound to ``name``: ``host`` (the
    worker URL's) for a wildcard, else ``name``."""
    return host if name in WILDCARD_HOSTS else name


def positive_int(value: object) -> int | None:
    """``value`` when it is an int > 0 (not a bool), else ``None``."""
    return value if type(value) is int and value > 0 else None


def plugin_entry_points(group: str) -> list[tuple[EntryPoint, str, str]]:
    """The entry points of ``group`` with their distribution's name and
    version (``?`` when unknown), in (name, distribution) order, so that
    what is loaded and every message do not depend on the order of
    ``sys.path``. Shared by the engine and codec loaders."""
    found = []
    for ep in entry_points(group=group):
        found.append((ep, ep.dist.name if ep.dist else "?", ep.dist.version if ep.dist else "?"))
    return sorted(found, key=lambda e: (e[0].name, e[1] if e[1] != "?" else ""))


def load_engines(group: str = GROUP) -> dict[str, WorkerProtocol]:
    """Every engine description in the entry point ``group``, by name,
    taken in (name, distribution) order.

    Raises:
        EngineLoadError: an entry point failed to import or to build, gave
            something other than a :class:`WorkerProtocol` named as the entry
            point, or claims a name another distribution claims (both named).
    """
    found: dict[str, tuple[WorkerProtocol, str]] = {}
    problems: list[str] = []
    for ep, dist, version in plugin_entry_points(group):
        where = f"{ep.name!r} ({dist} {version}, {ep.value})"
        try:
            # A plugin that calls sys.exit at import must not end the server unnamed.
            engine = ep.load()
            if not isinstance(engine, WorkerProtocol) and callable(engine):
                engine = engine()
            if not isinstance(engine, WorkerProtocol):
                raise TypeError(f"{ep.value} gave a {type(engine).__name__}, not an "
                                "asgi_generate.protocols.WorkerProtocol")
            if engine.name != ep.name:
                raise ValueError(f"the engine is named {engine.name!r}; its entry point must carry the same name")
        except (Exception, SystemExit) as exc:
            problems.append(f"engine {where} failed to load: {type(exc).__name__}: {exc}")
            continue
        if engine.name in found:
            problems.append(f"engines {found[engine.name][1]} and {where} both use the name {engine.name!r}")
            continue
        found[engine.name] = (engine, where)
    if problems:
        raise EngineLoadError("\n".join(problems))
    return {name: engine for name, (engine, _) in found.items()}


class Engines(Mapping[str, WorkerProtocol]):
    """The engine descriptions by name, loaded from :data:`GROUP` on first
    use (so an engine's module may import this one), in name order.

    Raises:
        EngineLoadError: on first use, as :func:`load_engines`.
    """

    def __init__(self) -> None:
        self._engines: dict[str, WorkerProtocol] | None = None

    def _loaded(self) -> dict[str, WorkerProtocol]:
        if self._engines is None:
            self._engines = load_engines()
        return self._engines

    def __getitem__(self, name: str) -> WorkerProtocol:
        return self._loaded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())

    def __repr__(self) -> str:
        return f"Engines({list(self)!r})"

    def where(self, **fields: Any) -> list[WorkerProtocol]:
        """The descriptions whose attributes are truthy (``field=True``) or
        equal the given values, in name order."""
        return [e for e in self.values()
                if all(bool(getattr(e, k)) if v is True else getattr(e, k) == v for k, v in fields.items())]


#: The installed engines' descriptions by name.
PROTOCOLS = Engines()
