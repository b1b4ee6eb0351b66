"""An engine's own load figures: what every frontend replica reads alike.

A frontend replica knows only the requests it sent; the engine knows them
all. Both engines serve their scheduler's queue over HTTP:

- SGLang ``GET /v1/loads?include=core`` (``sglang/srt/entrypoints/v1_loads.py``
  ``get_loads``): ``{"loads": [{"num_running_reqs", "num_waiting_reqs",
  "num_waiting_uncached_tokens", ...}, ...]}``, one entry per DP rank
  (``LoadSnapshot`` in ``sglang/srt/managers/load_snapshot.py``).
- vLLM ``GET /metrics``: the Prometheus gauges ``vllm:num_requests_running``
  and ``vllm:num_requests_waiting``, one sample per engine (DP rank)
  (``PrometheusStatLogger`` in ``vllm/v1/metrics/loggers.py``). vLLM's
  ``GET /load`` is not used: it counts only with
  ``--enable-server-load-tracking``.

Figures are summed over DP ranks: the frontend routes to the server, the
server to its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from prometheus_client.parser import text_string_to_metric_families

#: The route each worker protocol serves its load on.
LOAD_PATHS = {"sglang": b"/v1/loads?include=core", "vllm": b"/metrics"}
_VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One reading of an engine's queue.

    Attributes:
        requests: requests running plus waiting.
        waiting_tokens: prompt tokens waiting for prefill that its cache
            does not hold (SGLang's ``num_waiting_uncached_tokens``; vLLM
            serves no such figure: 0).
    """

    requests: int
    waiting_tokens: int


def parse_load(protocol: str, body: bytes) -> EngineLoad:
    """The load in ``body``, the answer of ``LOAD_PATHS[protocol]``.

    Raises:
        ValueError: a body that is not the route's shape (orjson's
            ``JSONDecodeError`` is one).
    """
    if protocol == "sglang":
        loads = orjson.loads(body).get("loads")
        if not isinstance(loads, list):
            raise ValueError("/v1/loads has no loads list")
        try:
            return EngineLoad(sum(int(x["num_running_reqs"]) + int(x["num_waiting_reqs"]) for x in loads),
                              sum(int(x.get("num_waiting_uncached_tokens", 0)) for x in loads))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"/v1/loads entry without its counts: {exc!r}") from None
    total, seen = 0.0, set()
    for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
        if family.name in _VLLM_GAUGES:
            seen.add(family.name)
            total += sum(sample.value for sample in family.samples)
    if len(seen) != len(_VLLM_GAUGES):
        raise ValueError(f"/metrics lacks {sorted(set(_VLLM_GAUGES) - seen)}")
    return EngineLoad(int(total), 0)
