"""The frontend's own exceptions, in one module every layer may import.

Grouped by where they are raised: a worker's transport
(:mod:`asgi_generate.workers.http`), a client's request body
(:mod:`asgi_generate.request.framing`), and the start-up checks of the
trace writer, the metrics and the codec registry. The codecs' request
errors (:class:`asgi_generate.sdk.RequestError` and its subclasses) are
part of the SDK's public surface and stay there; the simulator keeps its
own (it shares no code with what it checks).
"""

from __future__ import annotations

__all__ = [
    "BodyTimeout", "BodyTooLarge", "ClientDisconnected", "CodecLoadError", "ConnectFailed", "MetricsSetupError",
    "TimedOut", "TraceSetupError", "Unanswered", "WorkerDisconnected", "WorkerError",
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


# Start-up: settings or installed parts that cannot be served.

class TraceSetupError(ValueError):
    """The trace settings are inconsistent, or the tokenizer or a parser
    cannot be loaded."""


class MetricsSetupError(ValueError):
    """``PROMETHEUS_MULTIPROC_DIR`` names no folder."""


class CodecLoadError(Exception):
    """The installed codecs cannot be served together, or some failed to
    load; the message has one line per problem."""
