"""The frontend's own exceptions, in one module every layer may import.

Grouped by where they are raised: a worker's transport
(:mod:`asgi_generate.workers.http`), a client's request body
(:mod:`asgi_generate.request.framing`), a client gone mid-answer (the
hypercorn patches), the start-up checks of the trace writer, its parsers,
the metrics and the codec registry, and the offline tools. The codecs' request
errors (:class:`asgi_generate.sdk.RequestError` and its subclasses) are
part of the SDK's public surface and stay there; the simulator keeps its
own (it shares no code with what it checks).
"""

from __future__ import annotations

__all__ = [
    "BodyTimeout", "BodyTooLarge", "ClientDisconnected", "ClientGone", "CodecLoadError", "ConnectFailed",
    "EngineLoadError", "MetricsSetupError", "Overrun", "ParserError", "ReportUnavailable", "TimedOut",
    "TokenIdOutOfRange", "TraceSetupError", "Unanswered", "WorkerDisconnected", "WorkerError",
]


# A worker's transport (raised by workers.http.ConnectionPool).

class WorkerError(Exception):
    """A transport failure talking to a worker (the worker may be gone)."""


class ConnectFailed(WorkerError):
    """No TCP connection could be opened within the connect timeout."""


class WorkerDisconnected(WorkerError):
    """The connection broke or the worker broke HTTP before the response ended."""


class Unanswered(WorkerDisconnected):
    """The connection closed (or broke) before the response head: the worker
    may or may not have read the request, so the pool did not send it again
    (an ``idempotent`` request's one retry included)."""


class Overrun(Exception):
    """A worker sent bytes past its response's end: the parse stops there
    (raised from httptools' message-begin callback, caught by the pool,
    which retires the connection rather than read them as the next answer)."""


class TimedOut(Exception):
    """The caller's deadline passed before the worker sent what was awaited.

    Not a :class:`WorkerError`: a slow worker is not a dead one.
    """


# A client's request body (raised by request.framing.read_body).

class ClientDisconnected(Exception):
    """The client sent ``http.disconnect`` before the request body was whole."""


class BodyTimeout(Exception):
    """The client did not send its whole body within the deadline."""


class BodyTooLarge(Exception):
    """The request body exceeds the cap; ``limit`` is the cap in bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds the limit of {limit} bytes")
        self.limit = limit


# A client gone while its answer is written (raised by the patched hypercorn's
# streams, server/hypercorn/fixes.py, for apps that ask for it).

class ClientGone(ConnectionError):
    """``send()`` of a response message on a connection the client closed;
    nothing of the message reached the socket (bug 3 of
    asgi_generate/server/hypercorn/fixes.py)."""


# Start-up: settings or installed parts that cannot be served.

class TraceSetupError(ValueError):
    """The trace settings are inconsistent, or the tokenizer or a parser
    cannot be loaded."""


class MetricsSetupError(ValueError):
    """``PROMETHEUS_MULTIPROC_DIR`` names no folder."""


class CodecLoadError(Exception):
    """The installed codecs cannot be served together, or some failed to
    load; the message has one line per problem."""


class TokenIdOutOfRange(ValueError):
    """A token id does not fit an unsigned 32-bit integer (the replay hash
    chain's input, tracing/hashing.py)."""


class EngineLoadError(Exception):
    """The installed engine descriptions cannot be used: one failed to
    load, or two claim one name; the message has one line per problem."""


class ParserError(ValueError):
    """A reasoning or tool-call parser is unknown, or cannot work with the
    given tokenizer (tracing/parser_api.py)."""


# The offline tools.

class ReportUnavailable(RuntimeError):
    """matplotlib is not installed (asgi-generate-trace's HTML report)."""
