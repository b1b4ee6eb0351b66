"""vLLM as an asgi-generate engine: its description
(:class:`~asgi_generate.protocols.WorkerProtocol`), registered in the
``asgi_generate.engines`` entry point group.

Routes from ``vllm/entrypoints/openai/api_server.py`` (``health``,
``show_available_models``, ``show_version``), on a ``--tokens-only`` server
``vllm/entrypoints/serve/disagg/api_router.py`` (``abort_requests``:
``{"request_ids"}`` with the engine's prefixed ids) and the RL routes of
``rl/online/api_router.py`` (admin and weights, below).
"""

from __future__ import annotations

from typing import Callable, Mapping

import orjson
from prometheus_client.parser import text_string_to_metric_families

from asgi_generate.sdk import PublicAbort, WorkerProtocol, dial, read_model_card

#: vLLM runs each of the ``n`` choices as a request of its own
#: (``ParentRequest.get_child_info`` in ``v1/engine/parallel_sampling.py``),
#: each sharing the one ``kv_transfer_params`` and reading the producer's
#: blocks, which the producer frees after the first reader's notification
#: (``consumer_notification_counts_by_req`` in
#: ``distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py``).
ITEMS_REFUSAL = ("n > 1 cannot run on a vLLM prefill/decode pair: each choice would read the one "
                 "prefill's KV, which the producer frees after the first read; send n requests of n = 1, "
                 "or add an aggregated worker")


def replay_body(ids: list[int], max_tokens: int, rid: str) -> dict:
    """A streamed ``/inference/v1/generate`` request, usage included."""
    return {"token_ids": ids, "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
            "stream": True, "stream_options": {"include_usage": True}, "request_id": rid}


def replay_progress(obj: dict, so_far: int) -> tuple[int, bool]:
    """Output tokens and whether it finished, from one streamed event's
    ``choices`` (their ``token_ids`` added, any ``finish_reason``)."""
    choices = obj.get("choices") or []
    added = sum(len(c.get("token_ids") or []) for c in choices)
    return so_far + added, any(c.get("finish_reason") for c in choices)


#: The scheduler gauges of ``GET /metrics`` (``PrometheusStatLogger`` in
#: ``vllm/v1/metrics/loggers.py``), one sample per engine (DP rank). vLLM's
#: ``GET /load`` is not used: it counts only with
#: ``--enable-server-load-tracking``.
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
#: The KV cache usage gauge (``PrometheusStatLogger``, vllm/v1/metrics/loggers.py).
KV_USAGE = "vllm:kv_cache_usage_perc"


def read_metrics(body: bytes) -> tuple[int, int, float | None]:
    """``GET /metrics``: the :data:`GAUGES` summed over their samples, as
    (requests running plus waiting, 0: vLLM serves no uncached prompt
    token figure, the fullest engine's ``vllm:kv_cache_usage_perc``, a
    fraction despite its name, or ``None`` when it serves none).

    Raises:
        ValueError: a gauge is missing, or the text is not Prometheus'.
    """
    total, seen, usage = 0.0, set(), None
    for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
        if family.name in GAUGES:
            seen.add(family.name)
            total += sum(sample.value for sample in family.samples)
        elif family.name == KV_USAGE and family.samples:
            usage = max(sample.value for sample in family.samples)
    if len(seen) != len(GAUGES):
        raise ValueError(f"/metrics lacks {sorted(set(GAUGES) - seen)}")
    return int(total), 0, usage


def read_abort(body: bytes) -> "tuple[list[str], bool] | tuple[bytes, None]":
    """``POST /abort_requests``'s body as ``rl/online/api_router.py``
    ``abort_requests`` reads it (the route a ``VLLM_SERVER_DEV_MODE``
    server serves, ahead of the tokens-only one): ``request_ids`` named,
    or, when empty or absent, every request (abort all). Its 400 bodies are
    FastAPI's ``{"detail"}``; ids of another type than a list of strings (or
    one string, which vLLM's ``abort`` takes too) are refused here, where
    vLLM would answer 500."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return orjson.dumps({"detail": "Invalid JSON format"}), None
    if not isinstance(obj, dict):
        return orjson.dumps({"detail": "Request body must be a JSON object"}), None
    ids = obj.get("request_ids")
    if not ids:
        return [], True
    ids = [ids] if isinstance(ids, str) else ids
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return orjson.dumps({"detail": "'request_ids' must be a list of strings"}), None
    return ids, False


def abort_answer(body: bytes, aborted: int) -> bytes:
    """``abort_requests``'s answer: ``{"status": "aborted", "aborted": N}``,
    ``N`` the number of ids the body named (known or not, as vLLM counts
    them) or, for abort all, of the requests aborted (the frontend's live
    engine legs; vLLM counts every request its engine tracks)."""
    ids = orjson.loads(body).get("request_ids")
    return orjson.dumps({"status": "aborted", "aborted": len(ids) if ids else aborted})


def aborting_pause(path: str, query: "Mapping[str, str]", body: "Callable[[], object]") -> bool:
    """``/pause`` with ``mode=abort`` (the default, ``rl/online/api_router.py``
    ``pause_generation``) aborts running requests."""
    return path == "/pause" and query.get("mode", "abort") == "abort"


def read_is_paused(status: int, body: bytes) -> bool | None:
    """``GET /is_paused`` (``rl/online/api_router.py`` ``is_paused``):
    ``{"is_paused": bool}``, true in every pause mode and while asleep
    (``EngineCore.is_scheduler_paused``); anything else: unknown."""
    if status != 200:
        return None
    try:
        paused = orjson.loads(body).get("is_paused")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return paused if isinstance(paused, bool) else None


def kv_event_sources(info: object, host: str) -> tuple[tuple[str, str | None, str] | None, int | None, str]:
    """``GET /kv_event_sources`` (``entrypoints/serve/instrumentator/basic.py``: DP rank
    -> the ``KVEventsConfig`` it publishes with) read as rank 0's ZMQ
    publisher and replay endpoints and topic (see
    ``WorkerProtocol.kv_events_reader``); vLLM says no block size there."""
    config = info.get("0") if isinstance(info, dict) else None
    if not isinstance(config, dict) or config.get("publisher") != "zmq":
        return None, None, "GET /kv_event_sources lists no zmq publisher"
    replay = config.get("replay_endpoint")
    return (_dialled(config["endpoint"], host), replay and _dialled(replay, host), config.get("topic") or ""), None, ""


def _dialled(endpoint: str, host: str) -> str:
    name, _, port = endpoint[len("tcp://"):].rpartition(":")
    return f"tcp://{dial(name, host)}:{port}"


ENGINE = WorkerProtocol(
    "vllm", b"/health", b"/v1/models", b"/abort_requests", read_model_card, "request_ids", abort_takes_list=True,
    engine_id_prefix="generate-tokens-", version_path=b"/version", pd="sequential",
    pd_items_refusal=ITEMS_REFUSAL, weight_version_path=b"/weight_info",
    simulated=True,
    sim_pd_flags=(("--kv-role", "producer"), ("--kv-role", "consumer")),
    admin_routes=(
        ("/reset_prefix_cache", ("POST",)),
        ("/sleep", ("POST",)),
        ("/wake_up", ("POST",)),
        ("/is_sleeping", ("GET",)),
        ("/pause", ("POST",)),
        ("/resume", ("POST",)),
        ("/is_paused", ("GET",)),
    ),
    weight_routes=(
        ("/shutdown_weight_transfer_engine", ("POST",)),
        ("/start_weight_update", ("POST",)),
        ("/update_weights", ("POST",)),
        ("/finish_weight_update", ("POST",)),
        ("/weight_checker", ("POST",)),
        ("/weight_info", ("GET",)),
    ),
    group_init=("/init_weight_transfer_engine", "init_info"),
    parallel_size=(b"/get_world_size", "world_size"),
    health_generate=(b"/inference/v1/generate", orjson.dumps({"token_ids": [0], "sampling_params": {"max_tokens": 1}})),
    generate_path="/inference/v1/generate",
    replay_body=replay_body,
    replay_progress=replay_progress,
    load_path=b"/metrics",
    load_reader=read_metrics,
    weight_loads=(("/update_weights", None, True), ("/finish_weight_update", "weight_version", False)),
    cache_resets=("/reset_prefix_cache",),
    resumes=("/resume",),
    # rl/online/api_router.py pause_generation; serve/dev sleep (weights and
    # KV cache offloaded until /wake_up).
    pauses=(("/pause", "/resume"), ("/sleep", "/wake_up")),
    kv_events_path=b"/kv_event_sources",
    kv_events_reader=kv_event_sources,
    aborting_pause=aborting_pause,
    pause_path=b"/is_paused",
    pause_reader=read_is_paused,
    # vLLM matches whole ids; an abort all reaches the legs the frontend
    # runs, each by its engine id (a tokens-only server takes ids only).
    public_abort=PublicAbort(read_abort, by_prefix=False, answer=abort_answer, fan_out_all=False),
)
