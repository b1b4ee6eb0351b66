"""How workers are written down: ``PROTOCOL=URL`` worker specs (the
``--worker``, ``--prefill`` and ``--decode`` values and their variables),
the workers file (``--workers-file``) and where a worker publishes its KV
events (``--kv-events``).

Pure parsing, below both the settings that check these values before the
server starts and :mod:`asgi_generate.workers.discovery`, which rereads the
workers file while it runs.
"""

from __future__ import annotations

import tomllib
from urllib.parse import parse_qsl, urlsplit

import orjson

from .protocols import PROTOCOLS

#: The workers file's keys and the role of the workers each lists.
FILE_ROLES = {"workers": "aggregated", "prefill": "prefill", "decode": "decode"}

#: URL schemes of a worker spec: a worker, or a DNS name whose every
#: address is one (:mod:`asgi_generate.workers.discovery`).
WORKER_SCHEMES = ("http", "https", "dns")


def parse_worker_spec(spec: str, role: str = "aggregated") -> tuple[str, str]:
    """Split ``PROTOCOL=http://HOST:PORT`` (``https://`` for TLS, or
    ``dns://NAME:PORT``: every address NAME resolves to) into protocol and
    URL. A prefill worker of an engine with a join query
    (:attr:`~asgi_generate.protocols.WorkerProtocol.join_query`, SGLang's
    ``bootstrap_port``) may end ``?NAME=B`` (kept in the URL;
    :meth:`~asgi_generate.protocols.WorkerProtocol.split_url` reads it). IPv6 hosts are bracketed.

    Raises:
        ValueError: unknown protocol, not an ``http://``, ``https://`` or
            ``dns://`` ``HOST:PORT`` URL, a query other than a prefill's
            join port, or a protocol without P/D support in a P/D role.
    """
    protocol, sep, url = spec.partition("=")
    if not sep:
        raise ValueError(f"worker {spec!r}: expected PROTOCOL=http://HOST:PORT")
    if protocol not in PROTOCOLS:
        raise ValueError(f"worker {spec!r}: unknown protocol {protocol!r} (known: {', '.join(PROTOCOLS)})")
    if role != "aggregated" and not PROTOCOLS[protocol].pd:
        raise ValueError(f"{role} worker {spec!r}: the frontend runs no {protocol} P/D yet")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in WORKER_SCHEMES or not parts.hostname or not port:
        raise ValueError(f"worker {spec!r}: expected an http(s)://HOST:PORT or dns://NAME:PORT URL")
    if parts.query:
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        takes = [e for e in PROTOCOLS.values() if e.join_query is not None]
        name = PROTOCOLS[protocol].join_query
        join = query.pop(name, None) if name is not None else None
        if query or role != "prefill" or name is None:
            who = " or ".join(f"an {e.name} prefill worker" for e in takes) or "no worker"
            what = ", ".join(f"?{e.join_query}=B" for e in takes)
            raise ValueError(f"worker {spec!r}: only {who} takes a query ({what})")
        if not (join or "").isdigit() or not 0 < int(join) < 65536:
            raise ValueError(f"worker {spec!r}: {name} must be a port number, not {join!r}")
    return protocol, url.rstrip("/")


def parse_kv_source(text: str) -> tuple[str, str, str | None]:
    """``URL=ENDPOINT[+REPLAY]`` (``--kv-events``): a worker's base URL, its
    KV events' PUB endpoint and its replay endpoint (or ``None``).

    Raises:
        ValueError: no ``=``, or an endpoint that is not ``tcp://HOST:PORT``.
    """
    url, eq, endpoints = text.rpartition("=")
    if not eq or not url:
        raise ValueError(f"{text!r} is not URL=ENDPOINT[+REPLAY]")
    pub, _, replay = endpoints.partition("+")
    for e in (pub, *filter(None, [replay])):
        if not e.startswith("tcp://") or not e.rpartition(":")[2].isdigit():
            raise ValueError(f"{e!r} in {text!r} is not tcp://HOST:PORT")
    return url.rstrip("/"), pub, replay or None


def kv_source_text(source: tuple[str, str, str | None]) -> str:
    """The text :func:`parse_kv_source` reads back."""
    url, pub, replay = source
    return f"{url}={pub}" + (f"+{replay}" if replay else "")


def read_workers_file(path: str) -> list[tuple[str, tuple[str, str]]]:
    """The ``(role, (protocol, url))`` specs a workers file lists, in file
    order (``workers``, then ``prefill``, then ``decode``).

    Raises:
        ValueError: one line saying why: unreadable, not JSON (not TOML for
            a ``.toml`` name), not an object of lists of strings, an
            unknown key, or a spec :func:`parse_worker_spec` refuses.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
        data = tomllib.loads(raw.decode()) if path.endswith(".toml") else orjson.loads(raw)
    except OSError as exc:
        raise ValueError(f"workers file {path!r}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, orjson.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"workers file {path!r}: does not parse: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"workers file {path!r}: expected an object with {', '.join(FILE_ROLES)}")
    unknown = sorted(set(data) - set(FILE_ROLES))
    if unknown:
        raise ValueError(f"workers file {path!r}: unknown key {unknown[0]!r} (known: {', '.join(FILE_ROLES)})")
    specs = []
    for key, role in FILE_ROLES.items():
        listed = data.get(key, [])
        if not isinstance(listed, list) or not all(isinstance(s, str) for s in listed):
            raise ValueError(f"workers file {path!r}: {key} must be a list of PROTOCOL=URL strings")
        for spec in listed:
            try:
                specs.append((role, parse_worker_spec(spec, role)))
            except ValueError as exc:
                raise ValueError(f"workers file {path!r}: {exc}") from None
    return specs
