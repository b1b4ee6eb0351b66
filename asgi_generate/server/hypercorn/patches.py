"""hypercorn's patches, installed all together or not at all.

The patches (:mod:`.fixes`, :mod:`.lean`, :mod:`.asyncio_serve`,
:mod:`.trio_serve`, :mod:`.graceful`) replace seven hypercorn module
globals and subclass or call hypercorn internals that no release promises to
keep. They were written and tested against hypercorn :data:`SUPPORTED`
(setup.cfg pins the same range). :func:`install` first checks the installed
release and the shape of every internal they touch (:data:`EXPECTED`); on
any mismatch it logs one WARNING naming each one and patches nothing, so
hypercorn serves as released: every request then watches its client with a
guard task on ``receive()``
(:func:`asgi_generate.request.handler.handle_generate`), and the bugs of
``UPSTREAM.md`` (beside this module) are hypercorn's again. ``/stats``
says which (:func:`status`).

Nothing is patched on import; the entry points call :func:`install`:
:func:`asgi_generate.server.serving.run` and the ``hypercorn`` entry module
:mod:`asgi_generate.server.asgi`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import re
from typing import Any

log = logging.getLogger("asgi_generate.server.hypercorn")

#: The hypercorn releases the patches were written and tested against (a
#: pip requirement specifier; setup.cfg's ``install_requires`` says the same).
SUPPORTED = ">=0.18,<0.19"
_SUPPORTED_MINOR = (0, 18)

#: What the patches replace: ``(module, global)``, each the hypercorn object
#: named beside it until :func:`install` replaces it.
REPLACED = {
    ("hypercorn.protocol", "H11Protocol"): "hypercorn.protocol.h11.H11Protocol",
    ("hypercorn.protocol.h11", "HTTPStream"): "hypercorn.protocol.http_stream.HTTPStream",
    ("hypercorn.protocol.h2", "HTTPStream"): "hypercorn.protocol.http_stream.HTTPStream",
    ("hypercorn.asyncio.run", "worker_serve"): "hypercorn.asyncio.run.worker_serve",
    ("hypercorn.trio.run", "TCPServer"): "hypercorn.trio.tcp_server.TCPServer",
    ("hypercorn.trio.run", "WorkerContext"): "hypercorn.trio.worker_context.WorkerContext",
    ("hypercorn.trio.run", "worker_serve"): "hypercorn.trio.run.worker_serve",
}

#: Every hypercorn callable the patches replace, subclass, override or call,
#: with its parameters in hypercorn 0.18.0 (a class: its constructor's;
#: annotations and defaults left out); ``None``: only its presence counts.
EXPECTED: dict[str, str | None] = {
    # fixes: the HTTP/1.1 protocol and the HTTP stream (h11 and h2)
    "hypercorn.protocol.h11.H11Protocol": "(app, config, context, task_group, connection_state, ssl, client, server, send)",
    "hypercorn.protocol.h11.H11Protocol.stream_send": "(self, event)",
    "hypercorn.protocol.h11.H11Protocol._send_h11_event": "(self, event)",
    "hypercorn.protocol.h11.H11Protocol._send_error_response": "(self, status_code)",
    "hypercorn.protocol.h11.H11Protocol.initiate": "(self)",
    "hypercorn.protocol.h11.H11Protocol.handle": "(self, event)",
    "hypercorn.protocol.http_stream.HTTPStream": "(app, config, context, task_group, ssl, client, server, send, stream_id)",
    "hypercorn.protocol.http_stream.HTTPStream.handle": "(self, event)",
    "hypercorn.protocol.http_stream.HTTPStream.app_send": "(self, message)",
    "hypercorn.protocol.http_stream.ASGIHTTPState.CLOSED": None,
    "hypercorn.app_wrappers.ASGIWrapper.__call__": "(self, scope, receive, send, sync_spawn, call_soon)",
    "hypercorn.config.Config.h11_max_incomplete_size": None,
    "hypercorn.config.Config.response_headers": "(self, protocol)",
    # both connections: hypercorn's protocol switch and task group interface
    "hypercorn.protocol.ProtocolWrapper": "(app, config, context, task_group, state, ssl, client, server, send, alpn_protocol)",
    "hypercorn.asyncio.task_group.TaskGroup.spawn_app": "(self, app, config, scope, send)",
    "hypercorn.trio.task_group.TaskGroup.spawn_app": "(self, app, config, scope, send)",
    "hypercorn.config.Config.max_app_queue_size": None,
    # asyncio_serve: the asyncio worker
    "hypercorn.asyncio.run.worker_serve": "(app, config, *, sockets, shutdown_trigger)",
    "hypercorn.asyncio.lifespan.Lifespan": "(app, config, loop, lifespan_state)",
    "hypercorn.asyncio.udp_server.UDPServer": "(app, loop, config, context, state)",
    "hypercorn.asyncio.worker_context.WorkerContext": "(max_requests)",
    "hypercorn.asyncio.worker_context.WorkerContext.event_class": None,
    # graceful: the worker classes' serve, the app wrapper, the timeout
    "hypercorn.trio.run.worker_serve": "(app, config, *, sockets, shutdown_trigger, task_status)",
    "hypercorn.utils.wrap_app": "(app, wsgi_max_body_size, mode)",
    "hypercorn.app_wrappers.ASGIWrapper": "(app)",
    "hypercorn.config.Config.graceful_timeout": None,
    # trio_serve and lean: the trio connection, its keep-alive task, events
    "hypercorn.trio.tcp_server.TCPServer": "(app, config, context, state, stream)",
    "hypercorn.trio.tcp_server.TCPServer.protocol_send": "(self, event)",
    "hypercorn.trio.tcp_server.TCPServer._close": "(self)",
    "hypercorn.trio.tcp_server.TCPServer._idle_timeout": "(self)",
    "hypercorn.trio.tcp_server.TCPServer._initiate_server_close": "(self)",
    "hypercorn.trio.worker_context.WorkerContext": "(max_requests)",
    "hypercorn.trio.worker_context.WorkerContext.event_class": None,
    "hypercorn.trio.worker_context.TrioSingleTask": "()",
    "hypercorn.trio.worker_context.TrioSingleTask.restart": "(self, task_group, action)",
    "hypercorn.trio.worker_context.TrioSingleTask.stop": "(self)",
    # what the patches import, read or call besides: the events they send
    # and match, the settings they read, the serve loops' helpers
    "hypercorn.events.Closed": None,
    "hypercorn.events.Event": None,
    "hypercorn.events.RawData": None,
    "hypercorn.events.Updated": None,
    "hypercorn.protocol.events.Body": None,
    "hypercorn.protocol.events.EndBody": None,
    "hypercorn.protocol.events.Event": None,
    "hypercorn.protocol.events.Response": None,
    "hypercorn.protocol.events.StreamClosed": None,
    "hypercorn.protocol.http_stream.ASGIHTTPState": None,
    "hypercorn.config.Sockets": None,
    "hypercorn.config.Config": None,
    "hypercorn.config.Config.backlog": None,
    "hypercorn.config.Config.create_sockets": None,
    "hypercorn.config.Config.create_ssl_context": None,
    "hypercorn.config.Config.keep_alive_max_requests": None,
    "hypercorn.config.Config.keep_alive_timeout": None,
    "hypercorn.config.Config.log": None,
    "hypercorn.config.Config.max_requests": None,
    "hypercorn.config.Config.max_requests_jitter": None,
    "hypercorn.config.Config.read_timeout": None,
    "hypercorn.config.Config.set_statsd_logger_class": None,
    "hypercorn.config.Config.ssl_enabled": None,
    "hypercorn.config.Config.ssl_handshake_timeout": None,
    "hypercorn.config.Config.workers": None,
    "hypercorn.config.Config.wsgi_max_body_size": None,
    "hypercorn.asyncio.run._share_socket": None,
    "hypercorn.asyncio.statsd.StatsdLogger": None,
    "hypercorn.utils.ShutdownError": None,
    "hypercorn.utils.parse_socket_addr": None,
    "hypercorn.utils.raise_shutdown": None,
    "hypercorn.utils.repr_socket_addr": None,
}

#: Instance attributes of hypercorn's classes that the patches' subclasses
#: read or assign: each must be assigned (``self.name = ...``) in the
#: class's own source, as in hypercorn 0.18.0 (an instance attribute is on
#: no class to look up). trio_serve.TCPServer replaces its base's
#: ``__init__`` and sets these itself, so that ``__init__`` must set no
#: other (:data:`REPLACED_INITS`).
INSTANCE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "hypercorn.protocol.h11.H11Protocol": ("config", "connection", "keep_alive_requests", "send"),
    "hypercorn.protocol.http_stream.HTTPStream": ("app", "closed", "scope", "task_group"),
    "hypercorn.trio.tcp_server.TCPServer": (
        "_task_group", "app", "config", "context", "idle_task", "protocol", "send_lock", "state", "stream"),
    "hypercorn.trio.worker_context.TrioSingleTask": ("_handle", "_lock"),
}

#: hypercorn ``__init__`` methods a patch replaces without calling them:
#: the attributes each sets, all of which the replacement sets too.
REPLACED_INITS: dict[str, tuple[str, ...]] = {
    "hypercorn.trio.tcp_server.TCPServer": ("app", "config", "context", "idle_task", "send_lock", "state", "stream"),
}

#: ``True``: installed; ``False``: a mismatch, stock hypercorn; ``None``: not tried.
_installed: bool | None = None
#: What :func:`install` found did not match (:func:`mismatches`).
_found: list[str] = []
#: What :func:`mismatches` found nothing at.
_MISSING = object()
#: The modules of the patches (they import hypercorn's names as they load).
_PATCH_MODULES = ("fixes", "lean", "asyncio_serve", "trio_serve", "graceful")


def parameters(obj: Any) -> str:
    """``obj``'s parameters as :data:`EXPECTED` writes them, e.g.
    ``"(app, config, *, sockets, shutdown_trigger)"``.

    Raises:
        TypeError, ValueError: ``obj`` has no signature.
    """
    out: list[str] = []
    star = False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name)
    return f"({', '.join(out)})"


def _resolve(path: str) -> Any:
    """The object at a dotted ``path`` (a module, then attributes).

    Raises:
        AttributeError, ImportError: something on the way is missing.
    """
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            if i == 1:
                raise
            continue
        break
    for name in parts[i:]:
        obj = getattr(obj, name)
    return obj


def _assigned(obj: Any) -> set[str]:
    """The ``self.<name>`` attributes ``obj``'s source (a class or a
    function) assigns; empty when it has none to read."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return set()
    return set(_SELF_ASSIGNED.findall(source))


_SELF_ASSIGNED = re.compile(r"\bself\.(\w+)\s*(?::[^=\n]*)?=(?!=)")


def _ours(obj: Any) -> bool:
    return getattr(obj, "__module__", "").startswith(__package__)


def mismatches() -> list[str]:
    """What of the installed hypercorn differs from what the patches were
    written against, one phrase each (empty: everything matches): its
    release outside :data:`SUPPORTED`, an :data:`EXPECTED` name missing (a
    name under it is not named again) or taking other parameters, an
    instance attribute of :data:`INSTANCE_ATTRIBUTES` its class no longer
    assigns, an attribute a replaced ``__init__`` sets that its replacement
    does not (:data:`REPLACED_INITS`), a :data:`REPLACED` global missing or
    something else than hypercorn's own (one of ours, installed already,
    passes); else a patch module that does not import."""
    found: list[str] = []
    try:
        version = importlib.metadata.version("hypercorn")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or tuple(map(int, match.groups())) != _SUPPORTED_MINOR:
        found.append(f"hypercorn {version} is installed, not {SUPPORTED}")
    missing: list[str] = []

    def lookup(path: str) -> Any:
        if any(path == m or path.startswith(m + ".") for m in missing):
            return _MISSING
        try:
            return _resolve(path)
        except (AttributeError, ImportError):
            missing.append(path)
            found.append(f"{path} is missing")
            return _MISSING

    for path, shape in EXPECTED.items():
        obj = lookup(path)
        if obj is _MISSING or shape is None:
            continue
        try:
            actual = parameters(obj)
        except (TypeError, ValueError):
            actual = "no signature"
        if actual != shape:
            found.append(f"{path} takes {actual}, expected {shape}")
    for path, names in INSTANCE_ATTRIBUTES.items():
        cls = lookup(path)
        if cls is not _MISSING:
            assigned = _assigned(cls)
            found.extend(f"{path} sets no attribute {name}" for name in names if name not in assigned)
    for path, names in REPLACED_INITS.items():
        cls = lookup(path)
        if cls is not _MISSING:
            extra = sorted(_assigned(cls.__init__) - set(names))
            found.extend(f"{path}.__init__ sets {name}, which the patches' replacement does not" for name in extra)
    for (module, name), original in REPLACED.items():
        current, expected = lookup(f"{module}.{name}"), lookup(original)
        if _MISSING not in (current, expected) and current is not expected and not _ours(current):
            found.append(f"{module}.{name} is not {original}")
    for module in _PATCH_MODULES if not found else ():
        try:  # they import and subclass hypercorn's names as they load
            importlib.import_module(f"{__package__}.{module}")
        except Exception as exc:
            found.append(f"{__package__}.{module} does not import: {exc}")
            break
    return found


def install(send_errors: bool, header_read_timeout: float | None = None) -> bool:
    """Check hypercorn (:func:`mismatches`) and, if it matches, patch it;
    returns whether it did. Idempotent: later calls only choose, again, the
    stream class (``send_errors``: a ``send()`` to a client that is gone
    raises :class:`asgi_generate.server.hypercorn.fixes.ClientGone`, for
    apps that handle it) and the request head's deadline
    (``header_read_timeout``, seconds from accept, or from a later head's
    first byte, to its end:
    :data:`asgi_generate.server.hypercorn.fixes.header_read_timeout`;
    ``None``: none of its own, as in hypercorn). On a mismatch: one WARNING (logger
    ``asgi_generate.server.hypercorn``) naming each, nothing patched, and
    ``False`` from every call. Must run before hypercorn serves: it replaces
    the globals of :data:`REPLACED`, which hypercorn looks up per worker and
    per connection."""
    global _installed
    if _installed is None:
        found = mismatches()
        if found:
            _found[:] = found
            log.warning("hypercorn patches not installed: %s; serving with stock hypercorn (a guard task "
                        "per request, the bugs of asgi_generate/server/hypercorn/UPSTREAM.md unfixed)",
                        "; ".join(found))
            _installed = False
            return False
    elif not _installed:
        return False
    from hypercorn import protocol
    from hypercorn.asyncio import run as asyncio_run
    from hypercorn.protocol import h11 as protocol_h11, h2 as protocol_h2
    from hypercorn.trio import run as trio_run

    from . import asyncio_serve, fixes, graceful, lean, trio_serve

    fixes.header_read_timeout = header_read_timeout
    protocol.H11Protocol = fixes._H11Protocol
    # h2's streams too: the disconnect watch (no guard task per stream) and
    # ClientGone; a fixes._Continue reaches H2Protocol.stream_send, which
    # sends nothing for an event it does not know (no 100 on h2).
    stream = fixes._HTTPStream if send_errors else fixes._LazyContinueStream
    protocol_h11.HTTPStream = stream
    protocol_h2.HTTPStream = stream
    asyncio_run.worker_serve = asyncio_serve.worker_serve
    trio_run.TCPServer = trio_serve.TCPServer
    trio_run.WorkerContext = lean.TrioWorkerContext
    trio_run.worker_serve = graceful.trio_worker_serve
    _installed = True
    return True


def status() -> dict[str, Any]:
    """Whether hypercorn serves patched, for ``/stats``:
    ``{"installed": True | False | None, "mismatches": [phrase, ...]}``,
    ``None`` when :func:`install` never ran in this process (the app served
    another way), ``mismatches`` what its WARNING named."""
    return {"installed": _installed, "mismatches": list(_found)}
