"""Phase deadlines of one engine leg, shared by the aggregated and the P/D
paths: a streamed leg gets ``headers_timeout`` to its response head, then
``first_token_timeout`` to its first event, then ``inter_token_timeout``
between events; a unary leg gets ``request_timeout`` in all (0 = none)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from .config import Settings


def deadline_in(limit: float) -> float:
    """The anyio clock time ``limit`` seconds from now; ``math.inf`` when
    ``limit`` is 0 (no deadline)."""
    return anyio.current_time() + limit if limit > 0 else math.inf


def opening_phase(settings: "Settings", stream: bool) -> tuple[str, float]:
    """A leg's first phase and its limit in seconds: the response headers of a
    streamed leg, the whole answer of a unary one."""
    return ("headers", settings.headers_timeout) if stream else ("request", settings.request_timeout)


def timeout_message(worker_id: str, phase: str, limit: float) -> str:
    """What a client is told when worker ``worker_id`` missed ``phase``'s deadline of ``limit`` seconds."""
    what = {
        "headers": "sent no response headers within",
        "first_token": "sent no token within",
        "inter_token": "sent no token for",
        "request": "did not answer within",
    }[phase]
    return f"worker {worker_id} {what} {limit:g} s"
