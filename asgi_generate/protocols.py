"""Worker protocols: how the frontend talks to an engine besides generating.

Each engine's native API has its own health, info and abort routes: SGLang's
``python/sglang/srt/entrypoints/http_server.py`` (``health``,
``get_server_info``, ``abort_request``: ``{"rid"}``, 200 with an empty body);
vLLM's ``vllm/entrypoints/openai/api_server.py`` (``health``,
``show_available_models``, ``show_version``) and, on a ``--tokens-only``
server, ``vllm/entrypoints/serve/disagg/api_router.py`` (``abort_requests``:
``{"request_ids"}`` with the engine's prefixed ids). Codecs name the protocol
they ride on; the handler uses this table to abort and the router to probe.
Pure data at the bottom of the package: the settings check worker specs
against it (:mod:`asgi_generate.worker_specs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import orjson


@dataclass(frozen=True, slots=True)
class WorkerProtocol:
    """One engine protocol's control routes, as data.

    Attributes:
        name: ``sglang`` or ``vllm``.
        health_path: GET, 200 when the engine serves.
        info_path: GET, JSON server info (see :meth:`read_info`).
        abort_path: POST route that aborts requests by id.
        info_reader: the info route's JSON object, normalised (see
            :meth:`read_info`).
        abort_field: the abort body's one field, naming the ids to abort.
        abort_takes_list: whether that field is a list (vLLM's
            ``/abort_requests``), so one abort request can name many ids;
            else it names one (SGLang's ``/abort_request``: one ``rid``).
        engine_id_prefix: what the engine puts before the id it was given
            (vLLM's ``generate-tokens-``).
        version_path: GET, ``{"version": ...}``, when the info route does
            not carry the engine version (vLLM ``show_version``).
        pd: the P/D handshake the frontend runs this protocol's
            prefill/decode pairs with (:mod:`asgi_generate.request.handshakes`):
            ``concurrent`` (both legs at once, joined by :attr:`pair_join`'s
            fields) or ``sequential`` (the prefill leg's answer carried by
            the decode leg); ``None``: no P/D.
        pair_join: a ``concurrent`` pair's join fields, which both legs'
            bodies carry: ``pair_join(host, bootstrap_port, rooms)`` with the
            prefill worker's host (IPv6 in brackets), its bootstrap port and
            the room minted per pair (a list, one per entry, for a batch).
        pd_items_refusal: why a request of several items (a batch, ``n`` >
            1) cannot run on this protocol's pairs, the client's 400;
            ``None``: it can.
        models_path: GET, the OpenAI model list, read for ``max_model_len``
            when the info route lacks the context length (SGLang).
        weight_version_path: GET, ``{"weight_version": ...}``: the weights
            the engine serves (SGLang ``get_model_info``, vLLM
            ``rl/online/api_router.py`` ``weight_info``).
    """

    name: str
    health_path: bytes
    info_path: bytes | None
    abort_path: bytes
    info_reader: Callable[[dict], dict]
    abort_field: str
    abort_takes_list: bool = False
    engine_id_prefix: str = ""
    version_path: bytes | None = None
    pd: str | None = None
    pair_join: "Callable[[str, int | None, list[int] | int], dict] | None" = None
    pd_items_refusal: str | None = None
    models_path: bytes | None = None
    weight_version_path: bytes | None = None

    def read_info(self, obj: object) -> dict:
        """Normalise the info route's JSON, with the context length in tokens
        as ``max_model_len`` (``None`` when unknown): :func:`read_server_info`
        (SGLang) or :func:`read_model_card` (vLLM). Anything unexpected
        gives ``{}``."""
        if not isinstance(obj, dict):
            return {}
        return self.info_reader(obj)

    @staticmethod
    def read_version(obj: object, field: str = "version") -> str | None:
        """The ``field`` string of a ``version_path`` (or, with
        ``weight_version``, ``weight_version_path``) answer, else ``None``."""
        version = obj.get(field) if isinstance(obj, dict) else None
        return version if isinstance(version, str) else None

    def abort_body(self, engine_ids: list[str]) -> bytes:
        """The abort request body for ``engine_ids`` (ids as minted; more
        than one only where :attr:`abort_takes_list`), each with the
        engine's prefix."""
        named = [self.engine_id_prefix + i for i in engine_ids]
        if self.abort_takes_list:
            return orjson.dumps({self.abort_field: named})
        (engine_id,) = named
        return orjson.dumps({self.abort_field: engine_id})


def read_server_info(obj: dict) -> dict:
    """SGLang's ``/get_server_info`` (``http_server.get_server_info``: the
    ``ServerArgs`` fields and scheduler info; its ``version`` is the
    engine's) as is, its ``context_length`` (``--context-length``, null
    unless given) copied to ``max_model_len``."""
    return {**obj, "max_model_len": _int(obj.get("context_length"))}


def read_model_card(obj: object) -> dict:
    """``{"served_model_name", "max_model_len", "root"}`` of the first model of an
    OpenAI ``/v1/models`` list; both engines put the context length they
    enforce there (SGLang ``http_server.available_models``:
    ``model_config.context_len``; vLLM ``OpenAIServingModels.show_available_models``:
    ``max_model_len``). Anything unexpected gives ``{}``."""
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return {}
    first = data[0]
    return {"served_model_name": first.get("id"), "max_model_len": _int(first.get("max_model_len")), "root": first.get("root")}


def _int(value: object) -> int | None:
    return value if type(value) is int and value > 0 else None


def sglang_bootstrap(host: str, port: int | None, rooms: "list[int] | int") -> dict:
    """SGLang's P/D join fields (``disaggregation/mini_lb.py``:
    ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``; a list of
    rooms for a batch, ``io_struct.GenerateReqInput._normalize_bootstrap_params``)."""
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": rooms}


SGLANG = WorkerProtocol(
    "sglang", b"/health", b"/get_server_info", b"/abort_request", read_server_info, "rid", pd="concurrent",
    pair_join=sglang_bootstrap, models_path=b"/v1/models", weight_version_path=b"/get_model_info",
)
#: vLLM runs each of the ``n`` choices as a request of its own
#: (``ParentRequest.get_child_info`` in ``v1/engine/parallel_sampling.py``),
#: each sharing the one ``kv_transfer_params`` and reading the producer's
#: blocks, which the producer frees after the first reader's notification
#: (``consumer_notification_counts_by_req`` in
#: ``distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py``).
VLLM_ITEMS_REFUSAL = ("n > 1 cannot run on a vLLM prefill/decode pair: each choice would read the one "
                      "prefill's KV, which the producer frees after the first read; send n requests of n = 1, "
                      "or add an aggregated worker")
VLLM = WorkerProtocol(
    "vllm", b"/health", b"/v1/models", b"/abort_requests", read_model_card, "request_ids", abort_takes_list=True,
    engine_id_prefix="generate-tokens-", version_path=b"/version", pd="sequential",
    pd_items_refusal=VLLM_ITEMS_REFUSAL, weight_version_path=b"/weight_info",
)
PROTOCOLS = {p.name: p for p in (SGLANG, VLLM)}
