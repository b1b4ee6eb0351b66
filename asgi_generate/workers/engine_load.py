"""An engine's own load figures: what every frontend replica reads alike.

A frontend replica knows only the requests it sent; the engine knows them
all. An engine that serves its scheduler's queue over HTTP says where and
how to read it in its description
(:attr:`~asgi_generate.protocols.WorkerProtocol.load_path` and
``load_reader``): SGLang ``GET /v1/loads?include=core``
(``sglang/srt/entrypoints/v1_loads.py`` ``get_loads``), vLLM ``GET
/metrics`` (its ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` gauges, ``PrometheusStatLogger`` in
``vllm/v1/metrics/loggers.py``).

Figures are summed over DP ranks: the frontend routes to the server, the
server to its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..protocols import PROTOCOLS


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One reading of an engine's queue.

    Attributes:
        requests: requests running plus waiting.
        waiting_tokens: prompt tokens waiting for prefill that its cache
            does not hold (SGLang's ``num_waiting_uncached_tokens``; an
            engine that serves no such figure: 0).
        kv_usage: the KV cache's usage as a fraction (SGLang's
            ``token_usage``, vLLM's ``vllm:kv_cache_usage_perc``; of the
            fullest DP rank), ``None`` when the engine reports none.
    """

    requests: int
    waiting_tokens: int
    kv_usage: float | None = None


def parse_load(protocol: str, body: bytes) -> EngineLoad:
    """The load in ``body``, the answer of the engine's ``load_path``, read
    by its ``load_reader``.

    Raises:
        ValueError: a body that is not the route's shape (orjson's
            ``JSONDecodeError`` is one).
        KeyError: ``protocol`` has no load route.
    """
    reader = PROTOCOLS[protocol].load_reader
    if reader is None:
        raise KeyError(protocol)
    return EngineLoad(*reader(body))


class LoadShare(Protocol):
    """A reader of a worker's engine load that lets another take the
    readings for it (the ``kv-aware`` policy's, when admission reads the
    same route: :mod:`asgi_generate.workers.policies.kv_loads`), so the
    engine is asked once.

    Attributes:
        interval: seconds between its turns (it says at each whether it
            wants a reading: :meth:`due`).
    """

    interval: float

    def due(self, now: float) -> bool:
        """Whether it wants a reading at ``now`` (monotonic seconds)."""

    def until_due(self, now: float) -> float:
        """Seconds from ``now`` until it wants a reading if nothing happens
        at the worker meanwhile (0: :meth:`due` now)."""

    def notify(self, event: Any) -> None:
        """Set ``event`` (an :class:`anyio.Event`) when something at the
        worker makes a reading due sooner than :meth:`until_due` said."""

    def begin(self) -> int:
        """A reading is being asked for now; what :meth:`end` is handed back."""

    def end(self, load: EngineLoad | None, why: str | None, begun: int) -> None:
        """The reading's ``load``, or ``None`` and ``why`` it failed;
        ``begun`` is what :meth:`begin` returned."""

    def down(self) -> None:
        """The worker is down: no reading."""
