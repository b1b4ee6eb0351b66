"""The handler's record of one engine leg: the SDK's
:class:`~asgi_generate.sdk.codec.Attempt` (what the leg's codec reads)
and the handler's bookkeeping of the leg beside it. The request's state
lists one per leg (``RequestState.attempts``), which its trace record and
spans are built from; the state machine (:mod:`asgi_generate.request.state`)
changes its ``outcome``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..sdk.codec import Attempt, Usage


@dataclass(slots=True)
class LegRecord(Attempt):
    """One engine leg of a request, as the handler keeps it.

    Attributes:
        worker: the router's worker object the leg runs on.
        live: the engine may be running this leg.
        outcome: how the leg ended: ``finished``, ``aborted``, ``error``,
            ``connect_failed``, ``worker_lost``, ``timeout``; ``None`` while
            it runs.
        abort_acked: the engine acknowledged an abort of this leg.
        tokens: output tokens this leg contributed to the client's answer.
        span_id: with OpenTelemetry export on, the leg's span id (sent to
            the engine in its ``traceparent``), else 0; ``t_sent``/``t_ended``
            the leg's start and end (``time.monotonic()``), then only.
        unfinished: batch legs: the carried items not finished yet.
        entry_acked: batch legs: item index -> whether the engine
            acknowledged its abort.
        usage: the counts the leg's engine reported with the end of its
            answer (:meth:`Event.reported`), for the record; ``None`` when
            none came.
    """

    worker: Any = None
    live: bool = False
    outcome: str | None = None
    abort_acked: bool | None = None
    tokens: int = 0
    span_id: int = 0
    t_sent: float | None = None
    t_ended: float | None = None
    unfinished: set[int] | None = None
    entry_acked: dict[int, bool] | None = None
    usage: Usage | None = None
