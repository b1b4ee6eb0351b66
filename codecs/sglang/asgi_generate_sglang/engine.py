"""SGLang as an asgi-generate engine: its description
(:class:`~asgi_generate.protocols.WorkerProtocol`), registered in the
``asgi_generate.engines`` entry point group.

Routes from ``python/sglang/srt/entrypoints/http_server.py``: ``health``,
``get_server_info``, ``abort_request`` (``{"rid"}``, 200 with an empty
body), ``get_model_info`` (the weight version), the admin and weight routes
below, ``ready`` (paused or not) and ``model_info`` (the weight version),
read by every frontend process; P/D from ``disaggregation/mini_lb.py``.
"""

from __future__ import annotations

import orjson

from typing import Callable, Mapping

from asgi_generate.sdk import PublicAbort, WorkerProtocol, dial, positive_int


def read_server_info(obj: dict) -> dict:
    """SGLang's ``/get_server_info`` (``http_server.get_server_info``: the
    ``ServerArgs`` fields and scheduler info; its ``version`` is the
    engine's) as is, its ``context_length`` (``--context-length``, null
    unless given) copied to ``max_model_len``."""
    return {**obj, "max_model_len": positive_int(obj.get("context_length"))}


def bootstrap(host: str, port: int | None, rooms: "list[int] | int") -> dict:
    """SGLang's P/D join fields (``disaggregation/mini_lb.py``:
    ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``; a list of
    rooms for a batch, ``io_struct.GenerateReqInput._normalize_bootstrap_params``)."""
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": rooms}


def replay_body(ids: list[int], max_tokens: int, rid: str) -> dict:
    """A streamed ``/generate`` request (``io_struct.GenerateReqInput``)."""
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
            "stream": True, "rid": rid}


def replay_progress(obj: dict, so_far: int) -> tuple[int, bool]:
    """Output tokens and whether it finished, from one streamed event's
    ``meta_info`` (``completion_tokens``, ``finish_reason``)."""
    meta = obj.get("meta_info", {})
    return meta.get("completion_tokens", so_far), meta.get("finish_reason") is not None


def read_loads(body: bytes) -> tuple[int, int, float | None]:
    """``GET /v1/loads?include=core`` (``sglang/srt/entrypoints/v1_loads.py``
    ``get_loads``): ``{"loads": [{"num_running_reqs", "num_waiting_reqs",
    "num_waiting_uncached_tokens", "token_usage", ...}, ...]}``, one entry per
    DP rank (``LoadSnapshot`` in ``sglang/srt/managers/load_snapshot.py``), as
    (requests running plus waiting, uncached prompt tokens waiting, the
    fullest rank's KV token usage as a fraction, ``None`` when no rank says).

    Raises:
        ValueError: no loads list, or an entry without its counts.
    """
    loads = orjson.loads(body).get("loads")
    if not isinstance(loads, list):
        raise ValueError("/v1/loads has no loads list")
    try:
        usage = [float(x["token_usage"]) for x in loads if isinstance(x.get("token_usage"), (int, float))]
        return (sum(int(x["num_running_reqs"]) + int(x["num_waiting_reqs"]) for x in loads),
                sum(int(x.get("num_waiting_uncached_tokens", 0)) for x in loads),
                max(usage) if usage else None)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"/v1/loads entry without its counts: {exc!r}") from None


def read_abort(body: bytes) -> "tuple[list[str], bool] | tuple[bytes, None]":
    """``POST /abort_request``'s body (``AbortReq``: ``rid``, ``abort_all``;
    ``http_server.py`` ``abort_request``) as ``(rids, abort all)``; an
    empty body or ``rid`` names nothing. A body of the wrong shape is
    refused in the frontend's error shape."""
    try:
        obj = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        return orjson.dumps({"error": {"message": "the body must be a JSON object"}}), None
    rid, abort_all = obj.get("rid", ""), obj.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(abort_all, bool):
        return orjson.dumps({"error": {"message": "'rid' must be a string and 'abort_all' a boolean"}}), None
    return ([rid] if rid else []), abort_all


def aborting_pause(path: str, query: "Mapping[str, str]", body: "Callable[[], object]") -> bool:
    """``/pause_generation`` with ``mode`` ``abort`` (the default,
    ``PauseGenerationReqInput``) aborts running requests."""
    if path != "/pause_generation":
        return False
    obj = body()
    return isinstance(obj, dict) and obj.get("mode", "abort") == "abort"


#: The weight routes with ``abort_all_requests``, and its default
#: (``io_struct.py``: ``UpdateWeightVersionReqInput`` true;
#: ``UpdateWeightFromDiskReqInput``, ``UpdateWeightsFromDistributedReqInput``,
#: ``UpdateWeightsFromTensorReqInput`` false).
ABORT_ALL_DEFAULTS = {
    "/update_weight_version": True,
    "/update_weights_from_disk": False,
    "/update_weights_from_distributed": False,
    "/update_weights_from_tensor": False,
}


def aborting_call(path: str, query: "Mapping[str, str]", body: "Callable[[], object]") -> bool:
    """A weight route whose ``abort_all_requests`` (:data:`ABORT_ALL_DEFAULTS`)
    is true aborts every running request before it runs
    (``http_server.py`` ``update_weight_version``,
    ``tokenizer_control_mixin.py`` ``update_weights_from_distributed``/
    ``_tensor``, ``tokenizer_manager.py`` ``update_weights_from_disk``)."""
    default = ABORT_ALL_DEFAULTS.get(path)
    if default is None:
        return False
    obj = body()
    return isinstance(obj, dict) and obj.get("abort_all_requests", default) is True


def read_ready(status: int, body: bytes) -> bool | None:
    """``GET /ready`` (``http_server.ready``): 200 when the server takes
    new requests, 503 while it is paused, in any mode (``is_pause``, set by
    ``/pause_generation`` before it aborts anything, cleared by
    ``/continue_generation``), and while it is starting, unhealthy or
    shutting down (``tokenizer_manager.is_ready``), which a frontend whose
    health probe finds the worker up reads as paused; anything else: unknown."""
    return {200: False, 503: True}.get(status)


def kv_events(info: object, host: str) -> tuple[tuple[str, str | None, str] | None, int | None, str]:
    """``GET /server_info``'s ``kv_events`` (the ``--kv-events-config``
    the scheduler publishes with: ``endpoint_host``, ``endpoint_port_base``,
    ``replay_endpoint_port_base``, ``topic``, ``block_size``) read as DP
    rank 0's ZMQ endpoints (see ``WorkerProtocol.kv_events_reader``)."""
    events = info.get("kv_events") if isinstance(info, dict) else None
    if not isinstance(events, dict) or events.get("publisher") != "zmq":
        return None, None, "/server_info has no kv_events publisher"
    name = dial(events.get("endpoint_host") or host, host)
    replay = events.get("replay_endpoint_port_base")
    return ((f"tcp://{name}:{events['endpoint_port_base']}", f"tcp://{name}:{replay}" if replay is not None else None,
             events.get("topic") or ""), events.get("block_size"), "")


ENGINE = WorkerProtocol(
    "sglang", b"/health", b"/get_server_info", b"/abort_request", read_server_info, "rid", pd="concurrent",
    # ``/model_info``: ``/get_model_info`` logs a deprecation warning on each call.
    pair_join=bootstrap, models_path=b"/v1/models", weight_version_path=b"/model_info",
    join_query="bootstrap_port",
    # ``--disaggregation-bootstrap-port``'s default (server_args.py).
    default_join_port=8998,
    join_port_info_field="disaggregation_bootstrap_port",
    simulated=True,
    sim_pd_flags=(("--disaggregation-mode", "prefill", "--bootstrap-port", "0"), ("--disaggregation-mode", "decode")),
    admin_routes=(
        ("/flush_cache", ("GET", "POST")),
        ("/pause_generation", ("POST",)),
        ("/continue_generation", ("POST",)),
        ("/release_memory_occupation", ("GET", "POST")),
        ("/resume_memory_occupation", ("GET", "POST")),
    ),
    weight_routes=(
        ("/destroy_weights_update_group", ("POST",)),
        ("/update_weights_from_distributed", ("POST",)),
        ("/update_weights_from_tensor", ("POST",)),
        ("/update_weights_from_ipc", ("POST",)),
        ("/update_weights_from_disk", ("POST",)),
        ("/begin_weight_update", ("POST",)),
        ("/end_weight_update", ("POST",)),
        ("/get_weights_by_name", ("GET", "POST")),
        ("/weights_checker", ("GET", "POST")),
    ),
    group_init=("/init_weights_update_group", None),
    parallel_size=(b"/get_server_info", "tp_size"),
    health_generate=(b"/health_generate", None),
    native_admin=True,
    generate_path="/generate",
    replay_body=replay_body,
    replay_progress=replay_progress,
    load_path=b"/v1/loads?include=core",
    load_reader=read_loads,
    weight_loads=(
        ("/update_weights_from_distributed", "weight_version", True),
        ("/update_weights_from_tensor", "weight_version", True),
        ("/update_weights_from_ipc", "weight_version", True),
        ("/update_weights_from_disk", "weight_version", True),
    ),
    cache_resets=("/flush_cache",),
    resumes=("/continue_generation",),
    # A paused scheduler (any mode) serves no generation, /health's included
    # (tokenizer_manager.py pause_generation, http_server.py health_generate);
    # released memory holds no weights or KV cache to run one with.
    pauses=(("/pause_generation", "/continue_generation"),
            ("/release_memory_occupation", "/resume_memory_occupation")),
    kv_events_path=b"/server_info",
    kv_events_reader=kv_events,
    aborting_pause=aborting_pause,
    aborting_call=aborting_call,
    pause_path=b"/ready",
    pause_reader=read_ready,
    # SGLang answers 200 with an empty body, matched or not; its scheduler
    # aborts every rid the named one begins.
    public_abort=PublicAbort(read_abort, by_prefix=True, answer=lambda body, n: b"", fan_out_all=True),
)
