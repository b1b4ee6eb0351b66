"""The engines' own load routes, as the simulator serves them.

- SGLang ``GET /v1/loads`` (``sglang/srt/entrypoints/v1_loads.py``
  ``get_loads``, 0.5.23): ``{"timestamp", "version", "accelerator",
  "num_accelerators", "loads": [...]}``, one load per DP rank, each the
  core keys of ``LoadSnapshot.to_dict`` (``sglang/srt/managers/load_snapshot.py``);
  ``?include=`` picks sections (the simulator has only ``core``),
  ``?dp_rank=`` one rank, ``?format=prometheus`` the gauges as text. With
  the capacity model (:mod:`asgi_generate.sim.capacity`) the token figures
  are the scheduler's, as ``SchedulerLoadInquirer.get_loads`` reports them:
  ``num_used_tokens`` the pool held, ``num_total_tokens`` that plus the
  waiting requests' tokens, ``num_active_tokens`` the same (aggregated),
  ``token_usage`` used over ``max_total_num_tokens``, and
  ``max_running_requests`` the limit (0: none); without it they are 0.
- vLLM ``GET /metrics``: the Prometheus scheduler gauges
  ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, labelled
  ``model_name`` and ``engine`` (``vllm/v1/metrics/loggers.py``
  ``PrometheusStatLogger``); with the capacity model also
  ``vllm:kv_cache_usage_perc`` (used blocks over the pool) and the counter
  ``vllm:num_preemptions_total``. vLLM's ``GET /load`` counts only the routes
  wrapped in ``load_aware_call`` and only with
  ``--enable-server-load-tracking``, so the gauges are what every vLLM
  serves.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

import orjson

if TYPE_CHECKING:
    from .engine import SimEngine

#: ``LoadSnapshot``'s core keys in their order (the section fields,
#: ``memory`` ... ``queues``, are absent: the simulator has none of them).
CORE_KEYS = (
    "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
    "num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens",
    "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
    "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments",
)
SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
#: Prometheus' text exposition format, as both engines label it.
PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"
JSON = b"application/json"


def sglang_loads(engine: "SimEngine", query: bytes, version: str,
                 max_total_num_tokens: int) -> tuple[int, bytes, bytes]:
    """``(status, body, content type)`` of SGLang ``GET /v1/loads`` for
    ``query`` (its raw query string)."""
    args = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}
    include = {s.strip() for s in args["include"].split(",")} if "include" in args else None
    if include is not None and not include <= SECTIONS:
        return 400, orjson.dumps({"detail": f"Invalid include sections: {include - SECTIONS}. "
                                            f"Valid options: {sorted(SECTIONS)}"}), JSON
    running, waiting, uncached = engine.load()
    hits = engine.cached_tokens / engine.prompt_tokens if engine.prompt_tokens else 0.0
    load = dict.fromkeys(CORE_KEYS, 0)
    load.update(timestamp=time.time(), num_running_reqs=running, num_waiting_reqs=waiting,
                num_waiting_uncached_tokens=uncached, max_total_num_tokens=max_total_num_tokens,
                token_usage=0.0, gen_throughput=0.0, cache_hit_rate=round(hits, 4), utilization=0.0,
                decode_moments=None)
    cap = engine.capacity
    if cap is not None:
        pool = cap.pool()
        total = pool if pool is not None else max_total_num_tokens
        used = cap.used()
        pending = used + cap.waiting_tokens()
        load.update(num_used_tokens=used, num_total_tokens=pending, num_active_tokens=pending,
                    max_total_num_tokens=total, max_running_requests=cap.config.max_running or 0,
                    token_usage=used / total)
    loads = [load] if args.get("dp_rank", "0") == "0" else []
    if args.get("format") == "prometheus":
        lines = []
        for key, value in load.items():
            if key != "dp_rank" and isinstance(value, (int, float)):
                lines += [f"# TYPE sglang_{key} gauge", f'sglang_{key}{{dp_rank="0"}} {value}']
        return 200, ("\n".join(lines) + "\n").encode(), PROMETHEUS
    return 200, orjson.dumps({"timestamp": datetime.now(timezone.utc).isoformat(), "version": version,
                              "accelerator": None, "num_accelerators": 1, "loads": loads}), JSON


def vllm_metrics(engine: "SimEngine", model_name: str) -> bytes:
    """vLLM ``GET /metrics``: the scheduler's two gauges, Prometheus text."""
    running, waiting, _ = engine.load()
    labels = f'engine="0",model_name="{model_name}"'
    cap = engine.capacity
    extra = ""
    if cap is not None:
        pool = cap.pool()
        usage = cap.used() / pool if pool else 0.0
        extra = (
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {float(usage)}\n"
            "# HELP vllm:num_preemptions Cumulative number of preemption from the engine.\n"
            "# TYPE vllm:num_preemptions counter\n"
            f"vllm:num_preemptions_total{{{labels}}} {float(cap.preemptions)}\n"
        )
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}\n"
        f"{extra}"
    ).encode()
