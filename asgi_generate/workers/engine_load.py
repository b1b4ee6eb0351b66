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
