"""Codec discovery through the ``asgi_generate.codecs`` entry point group.

Each entry point, named after its codec, names a
:class:`~asgi_generate.sdk.Codec` subclass or a zero-argument factory
returning one::

    [options.entry_points]
    asgi_generate.codecs =
        zstd = asgi_generate_zstd.codec:ZstdCodec

At startup every entry point in the group is loaded and checked. A codec that
fails to import or to build, or declares itself wrongly, is reported by name
with its error, and the server refuses to start unless asked to skip broken
codecs. Two codecs claiming the same name or the same method and path are
never served together, skip or not: the message names both.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from typing import Collection

from ..exceptions import CodecLoadError
from ..protocols import plugin_entry_points
from ._codec import Codec, Route

GROUP = "asgi_generate.codecs"
#: Paths :class:`asgi_generate.server.app.App` serves itself; a codec route there
#: would shadow them (the app matches codec paths first).
RESERVED_PATHS = ("/health", "/v1/models", "/stats")
SKIP_HINT = "start with --skip-broken-codecs to serve without the codecs that failed to load"
_METHOD = re.compile(r"[A-Z]+")
log = logging.getLogger("asgi_generate.sdk._registry")


@dataclass(frozen=True, slots=True)
class LoadedCodec:
    """A codec with where it came from.

    Attributes:
        codec: the instance the app serves.
        entry_point: the entry point's name (the codec's name).
        distribution, version: the installed distribution that declared it.
        target: the entry point's ``module:attribute``.
    """

    codec: Codec
    entry_point: str
    distribution: str
    version: str
    target: str = ""

    def describe(self) -> str:
        """``'name' (distribution version, module:attr)``, for messages."""
        return f"{self.entry_point!r} ({self.distribution} {self.version}, {self.target})"


@dataclass(frozen=True, slots=True)
class CodecFailure:
    """An entry point that did not give a servable codec.

    Attributes:
        entry_point, distribution, version, target: as in :class:`LoadedCodec`.
        error: ``ExceptionType: message`` of what went wrong.
    """

    entry_point: str
    distribution: str
    version: str
    target: str
    error: str

    def __str__(self) -> str:
        return (
            f"codec {self.entry_point!r} ({self.distribution} {self.version}, {self.target}) "
            f"failed to load: {self.error}"
        )


@dataclass(slots=True)
class Discovery:
    """Everything found in the entry point group.

    Attributes:
        loaded: the codecs that loaded, in entry point name order.
        failures: the entry points that did not.
        collisions: one message per name or route claimed twice among
            ``loaded``.
    """

    loaded: list[LoadedCodec] = field(default_factory=list)
    failures: list[CodecFailure] = field(default_factory=list)
    collisions: list[str] = field(default_factory=list)


def _check(codec: object, ep: EntryPoint, protocols: Collection[str]) -> Codec:
    """``codec`` if it can be served (riding on one of ``protocols``, the
    frontend's worker protocol names), else raise saying why."""
    if not isinstance(codec, Codec):
        raise TypeError(f"{ep.value} gave a {type(codec).__name__}, not an asgi_generate.sdk.Codec")
    if codec.name != ep.name:
        raise ValueError(f"the codec is named {codec.name!r}; its entry point must carry the same name")
    if codec.worker_protocol not in protocols:
        known = ", ".join(sorted(protocols))
        raise ValueError(f"unknown worker protocol {codec.worker_protocol!r} (known: {known})")
    if not codec.routes:
        raise ValueError("the codec declares no routes")
    seen: set[Route] = set()
    for route in codec.routes:
        if not isinstance(route, Route):
            raise TypeError(f"route {route!r} is not an asgi_generate.sdk.Route")
        if not _METHOD.fullmatch(route.method):
            raise ValueError(f"route {route.method} {route.path}: the method must be upper-case letters")
        if not route.path.startswith("/"):
            raise ValueError(f"route {route.method} {route.path}: the path must start with '/'")
        if route.path in RESERVED_PATHS:
            raise ValueError(f"route {route.method} {route.path}: the frontend serves {route.path} itself")
        if route in seen:
            raise ValueError(f"route {route.method} {route.path} is declared twice")
        seen.add(route)
    return codec


def discover(protocols: Collection[str]) -> Discovery:
    """Load and check every entry point in :data:`GROUP` against the
    worker protocol names ``protocols``; never raises.

    Entry points are taken in (name, distribution) order, so results and
    messages do not depend on the order of ``sys.path``.
    """
    found = Discovery()
    for ep, dist, version in plugin_entry_points(GROUP):
        try:
            # A plugin that calls sys.exit at import must not end the server unnamed.
            codec = _check(ep.load()(), ep, protocols)
        except (Exception, SystemExit) as exc:
            found.failures.append(CodecFailure(ep.name, dist, version, ep.value, f"{type(exc).__name__}: {exc}"))
            continue
        found.loaded.append(LoadedCodec(codec, ep.name, dist, version, ep.value))
    found.collisions = collisions(found.loaded)
    return found


def collisions(loaded: list[LoadedCodec]) -> list[str]:
    """One message per name or (method, path) that two of ``loaded`` claim,
    naming both codecs; empty when they can be served together."""
    problems: list[str] = []
    names: dict[str, LoadedCodec] = {}
    routes: dict[Route, LoadedCodec] = {}
    for item in loaded:
        other = names.setdefault(item.codec.name, item)
        if other is not item:
            problems.append(
                f"codecs {other.describe()} and {item.describe()} both use the name {item.codec.name!r}"
            )
            continue
        for route in item.codec.routes:
            other = routes.setdefault(route, item)
            if other is not item:
                problems.append(
                    f"codecs {other.describe()} and {item.describe()} both serve {route.method} {route.path}"
                )
    return problems


def load_codecs(skip_broken: bool = False, *, protocols: Collection[str]) -> list[LoadedCodec]:
    """Every installed codec, ready to serve, each logged with its
    distribution and version.

    Args:
        skip_broken: log codecs that fail to load and serve the others.
        protocols: the worker protocol names a codec may ride on.

    Raises:
        CodecLoadError: a codec failed to load (unless ``skip_broken``; the
            message then ends with a hint naming the flag), two loaded
            codecs claim the same name or the same method and path, or no
            codec is left to serve.
    """
    found = discover(protocols)
    if found.failures and not skip_broken:
        raise CodecLoadError("\n".join([*map(str, found.failures), SKIP_HINT]))
    for failure in found.failures:
        log.error("%s; skipped (--skip-broken-codecs)", failure)
    if found.collisions:
        raise CodecLoadError("\n".join(found.collisions))
    if not found.loaded:
        raise CodecLoadError(f"no codec to serve: none is installed in the entry point group {GROUP}")
    for item in found.loaded:
        routes = ", ".join(f"{r.method} {r.path}" for r in item.codec.routes)
        log.info("codec %s from %s %s: %s, on %s workers", item.codec.name, item.distribution,
                 item.version, routes, item.codec.worker_protocol)
    return found.loaded
