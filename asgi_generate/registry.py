"""Codec discovery through the ``asgi_generate.codecs`` entry point group.

Each entry point names a :class:`~asgi_generate.codec.Codec` subclass (or a
zero-argument factory). Loading refuses two codecs with the same name or the
same (method, path), naming both, and a codec that fails to import, naming it
with its error, unless asked to skip broken codecs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import entry_points

from .codec import Codec

GROUP = "asgi_generate.codecs"
log = logging.getLogger("asgi_generate.registry")


class CodecLoadError(Exception):
    """The installed codecs cannot be served together, or one failed to load."""


@dataclass(frozen=True, slots=True)
class LoadedCodec:
    """A codec with where it came from."""

    codec: Codec
    entry_point: str
    distribution: str
    version: str


def load_codecs(skip_broken: bool = False) -> list[LoadedCodec]:
    """Instantiate every installed codec, in entry point name order.

    Raises:
        CodecLoadError: a codec failed to load (unless ``skip_broken``), or
            two codecs claim the same name or the same method and path.
    """
    loaded: list[LoadedCodec] = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        dist = ep.dist.name if ep.dist else "?"
        version = ep.dist.version if ep.dist else "?"
        try:
            codec = ep.load()()
            if not isinstance(codec, Codec):
                raise TypeError(f"{ep.value} did not produce a Codec")
        except Exception as exc:
            message = f"codec {ep.name!r} ({dist} {version}, {ep.value}) failed to load: {exc!r}"
            if not skip_broken:
                raise CodecLoadError(message) from exc
            log.error("%s; skipped", message)
            continue
        loaded.append(LoadedCodec(codec, ep.name, dist, version))
    check_collisions(loaded)
    for item in loaded:
        routes = ", ".join(f"{r.method} {r.path}" for r in item.codec.routes)
        log.info("codec %s from %s %s: %s on %s workers", item.codec.name, item.distribution,
                 item.version, routes, item.codec.worker_protocol)
    return loaded


def check_collisions(loaded: list[LoadedCodec]) -> None:
    """Raise :class:`CodecLoadError` if two codecs share a name or a route."""
    names: dict[str, LoadedCodec] = {}
    routes: dict[tuple[str, str], LoadedCodec] = {}
    for item in loaded:
        other = names.get(item.codec.name)
        if other is not None:
            raise CodecLoadError(
                f"codecs {other.entry_point!r} ({other.distribution}) and {item.entry_point!r} "
                f"({item.distribution}) both use the name {item.codec.name!r}"
            )
        names[item.codec.name] = item
        for route in item.codec.routes:
            key = (route.method, route.path)
            other = routes.get(key)
            if other is not None:
                raise CodecLoadError(
                    f"codecs {other.codec.name!r} ({other.distribution}) and {item.codec.name!r} "
                    f"({item.distribution}) both serve {route.method} {route.path}"
                )
            routes[key] = item
