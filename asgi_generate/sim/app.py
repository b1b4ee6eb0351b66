"""The simulator's ASGI application: one engine behind one native protocol.

Routes (SGLang mode): ``POST|PUT /generate``, ``POST /abort_request``,
``GET /health``, ``/health_generate``, ``/ready`` (200 with an empty body,
503 while paused, in any mode, or while the health routes answer 503:
``http_server.ready``, ``tokenizer_manager.is_ready``), ``/get_server_info`` (``/server_info``),
``/get_model_info`` (``/model_info``), ``/v1/models``, ``/v1/loads``
(:mod:`asgi_generate.sim.loads`), the admin routes
(``/flush_cache``, ``/pause_generation``, ...: :mod:`asgi_generate.sim.admin`),
and ``GET /sim/stats`` for tests (``requests``: the requests served, by
``"METHOD path"``, including its own).

Routes (vLLM mode): ``POST /inference/v1/generate``, ``POST /abort_requests``,
``GET /health``, ``/version``, ``/v1/models``, ``/metrics`` (the scheduler's
gauges, :mod:`asgi_generate.sim.loads`), the dev admin routes
(``/sleep``, ``/pause``, ...: :mod:`asgi_generate.sim.admin`) and
``GET /sim/stats``.

Either mode has the fault hook for tests: ``POST /sim/faults`` with
``{"count": N, "after_tokens": T}`` (and optionally ``"input_len": L``)
makes the next ``N`` generate requests (with a prompt of ``L`` tokens) drop
their connection after ``T`` generated tokens (0: right after the
response headers of a stream), and from then on the health routes answer
503, so the frontend's probe finds the worker gone, until
``DELETE /sim/faults`` disarms everything. With ``"stall": true`` the
requests instead send nothing more after ``T`` tokens, their connection
open and the worker healthy, until they are aborted (an engine stuck on a
request). On an SGLang prefill server, ``{"count": N, "prefill_abort":
"before"}`` makes the next ``N`` prefill requests end with an abort (status
500, the worker healthy) instead of handing their KV over, and
``{"prefill_abort": "after", "delay_ms": D}`` D ms after the decode server
took it: a prefill leg failing before and after its decode leg streams.
``{"weight_updates": N}`` makes the next ``N`` weight loads fail
(:mod:`asgi_generate.sim.weights`).

SGLang's ``/health`` and ``/health_generate`` run a one-token generation
and answer once the scheduler sends anything (``http_server.py``
``health_generate``): while the engine is paused (any mode: the
generation waits on ``tokenizer_manager.is_pause_cond``) or loading weights
(``weight_load_s``; the load holds ``model_update_lock``), they stall until
that ends, and answer 503 after :data:`HEALTH_CHECK_TIMEOUT` seconds.
vLLM's ``/health`` only asks whether the engine died
(``serve/instrumentator/health.py``, ``AsyncLLM.check_health``): it answers
at once, paused, asleep or loading.

``tp_size`` is the tensor-parallel size the simulator plays: the ranks it
takes in a weight-update group, SGLang's ``/get_server_info`` ``tp_size``,
vLLM's ``/get_world_size``.

SGLang mode plays a P/D role with ``disaggregation_mode`` ``prefill`` (a
bootstrap listener on ``bootstrap_port``) or ``decode``
(:mod:`asgi_generate.sim.disagg`); ``/sim/stats`` then also shows the role,
the rooms waiting for their KV and the transfers done and timed out.

Either mode keeps, per request id (``rid``; vLLM's ``X-Request-Id``, else
``request_id``), the last
W3C ``traceparent`` header a generate request carried, for tests of trace
propagation: ``/sim/stats`` ``traceparents`` (the newest
:data:`MAX_TRACEPARENTS`).

Either mode reports the engine version it plays (``engine_version``): vLLM in
``GET /version``, SGLang in ``/get_server_info`` ``version``.
"""

from __future__ import annotations

import os
import time

import anyio
import orjson

from ..assets import ASSETS_DIR
from .framing import BodyTooLarge, ClientDisconnected, Receive, Send, read_body, send_unary
from .block_hash import block_hasher
from .disagg import DEFAULT_TIMEOUT_S, DecodeKV, PrefillRooms
from .kvconnector import DEFAULT_EXPIRY_S, KVConsumer, KVProducer
from .prefix_cache import DEFAULT_CACHE_TOKENS
from .admin import SimAdmin
from .capacity_flags import CapacityConfig
from .weights import GroupRegistry, SimWeights
from .engine import SimEngine, SimFault
from .loads import PROMETHEUS, sglang_loads, vllm_metrics
from .sglang import CONTEXT_LENGTH, MAX_TOTAL_NUM_TOKENS, SGLangProtocol
from .tokenizer import SimTokenizer
from .versions import VLLM_DEFAULT_VERSION
from .vllm import MAX_LOGPROBS, MAX_MODEL_LEN, VLLMProtocol, error

NOT_FOUND = orjson.dumps({"detail": "Not Found"})
#: What ``emit_markers`` answers start with: a Qwen3-style thought and one
#: hermes tool call (``<think>`` and ``<tool_call>`` are single tokens).
MARKER_TEXT = '<think>Checking.</think><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
MAX_BODY = 1 << 30
#: Seconds SGLang's health generation waits for the scheduler before it
#: answers 503 (``http_server.py`` ``HEALTH_CHECK_TIMEOUT``, the default
#: of ``SGLANG_HEALTH_CHECK_TIMEOUT``).
HEALTH_CHECK_TIMEOUT = 20.0
#: Request ids whose last ``traceparent`` /sim/stats keeps (the newest).
MAX_TRACEPARENTS = 4096
#: Distinct ``METHOD path`` pairs /sim/stats ``requests`` counts one by one;
#: any further pair counts under ``"other"``.
MAX_COUNTED_ROUTES = 64


class SimApp:
    """ASGI app of one simulated engine worker.

    Args:
        protocol: ``"sglang"`` or ``"vllm"``.
        ttft_ms, itl_ms: time to first token and inter-token latency.
        incremental_streaming_output: SGLang deltas instead of cumulative chunks.
        usage_chunk: vLLM: end streams with the usage chunk when asked (off:
            like a build that never sends it).
        parent_pid: exit when this process is gone (embedded workers).
        stream_interval: tokens per streamed event (>= 1).
        emit_markers: start every answer with :data:`MARKER_TEXT` then EOS.
        abort_after, abort_status: end every request after that many tokens
            with an ``abort`` finish of that HTTP status (``None``: never).
        engine_version: the engine version to play; ``None`` is the newest
            vLLM release the codec knows, or the simulator's own (SGLang).
        disaggregation_mode: SGLang P/D role: ``null`` (aggregated),
            ``prefill`` or ``decode``.
        bootstrap_port: a prefill server's bootstrap listener port.
        disaggregation_timeout_s: how long a prefill room waits for its
            decode and a decode request for its KV.
        kv_role: vLLM P/D role: ``producer`` (prefill) or ``consumer``
            (decode) of a KV connector (:mod:`asgi_generate.sim.kvconnector`);
            ``None`` for aggregated.
        kv_expiry_s: how long a producer keeps blocks no consumer read.
        kv_connector: the vLLM connector a producer plays: ``nixl`` (hands
            off a prefill that stopped at its cap or at a stop) or
            ``moriio`` (at its cap only).
        decode_expert_rows: a P/D decode's routed experts: ``sequence``
            (the engines' own, every position with zeros where it received
            the KV; see :mod:`asgi_generate.sim.sglang` and
            :mod:`asgi_generate.sim.vllm`) or ``own`` (only the positions it
            computed).
        routed_experts: vLLM ``--enable-return-routed-experts`` (SGLang
            requests ask with ``return_routed_experts``).
        disconnect_abort_s: SGLang: seconds after its client vanished that a
            request is aborted by the engine itself (SGLang's background abort
            task); tests raise it so only the frontend's abort can stop a job.
        cache_tokens: prefix cache capacity in tokens (0: none; default
            :data:`~asgi_generate.sim.prefix_cache.DEFAULT_CACHE_TOKENS`; see
            :class:`~asgi_generate.sim.engine.SimEngine`).
        prefill_us_per_token: prefill compute per uncached prompt token.
        enable_prompt_tokens_details: vLLM's server flag: the final usage
            reports ``prompt_tokens_details.cached_tokens``, the prefix-cache
            hit (0 included).
        context_length: SGLang ``--context-length`` (``None``: 32,768).
        max_model_len: vLLM ``--max-model-len`` (``None``: 32,768).
        max_logprobs: vLLM ``--max-logprobs`` (``None``: 20; -1: the
            vocabulary size).
        vocab_size: the model's vocabulary (``None``: the bundled
            tokenizer's 4,096); larger pads it past the tokenizer, as real
            checkpoints are: every id below it is in vocabulary, none of the
            padding is ever generated.
        block_size: the prefix cache's block (vLLM ``--block-size``, default
            16; SGLang ``--page-size``, default 1).
        kv_events_config: the engine's ``--kv-events-config`` JSON: publish
            the cache's KV events (:mod:`asgi_generate.sim.kv_events`).
        tp_size: the tensor-parallel size played (the ranks taken in a
            weight-update group).
        weights_group_registry: the file of the fleet's
            :class:`~asgi_generate.sim.weights.GroupRegistry`, or ``None``.
        weight_load_s: seconds each weight load takes (0: at once).
        capacity: the engine's scheduler limits and step costs
            (:func:`~asgi_generate.sim.capacity_flags.capacity_config`); ``None``:
            unbounded, timed by ``ttft_ms``/``itl_ms``/``prefill_us_per_token``.
        tokenizer: the bundled tokenizer, to share one among the workers of
            a process (:mod:`asgi_generate.sim.fleet`; it holds no state a
            request changes); ``None`` loads its own.

    Raises:
        ValueError: unknown protocol, a vLLM version that is not one, a
            flag of the other engine's, a model shape out of range, a
            cache smaller than one block, or a bad ``kv_events_config``.
    """

    def __init__(
        self,
        protocol: str = "sglang",
        ttft_ms: float = 0.0,
        itl_ms: float = 0.0,
        incremental_streaming_output: bool = False,
        model_name: str = "sim",
        parent_pid: int | None = None,
        usage_chunk: bool = True,
        engine_version: str | None = None,
        stream_interval: int = 1,
        emit_markers: bool = False,
        abort_after: int | None = None,
        abort_status: int = 503,
        disaggregation_mode: str = "null",
        bootstrap_port: int = 8998,
        disaggregation_timeout_s: float = DEFAULT_TIMEOUT_S,
        kv_role: str | None = None,
        kv_expiry_s: float = DEFAULT_EXPIRY_S,
        kv_connector: str = "nixl",
        decode_expert_rows: str = "sequence",
        disconnect_abort_s: float = 2.0,
        routed_experts: bool = False,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
        prefill_us_per_token: float = 0.0,
        enable_prompt_tokens_details: bool = False,
        context_length: int | None = None,
        max_model_len: int | None = None,
        max_logprobs: int | None = None,
        vocab_size: int | None = None,
        block_size: int | None = None,
        kv_events_config: str | None = None,
        tp_size: int = 1,
        weights_group_registry: str | None = None,
        weight_load_s: float = 0.0,
        capacity: CapacityConfig | None = None,
        tokenizer: SimTokenizer | None = None,
    ) -> None:
        if protocol not in ("sglang", "vllm"):
            raise ValueError(f"unknown simulator protocol {protocol!r}")
        if context_length is not None and protocol != "sglang":
            raise ValueError("--context-length is SGLang's; vLLM's is --max-model-len")
        if (max_model_len is not None or max_logprobs is not None) and protocol != "vllm":
            raise ValueError("--max-model-len and --max-logprobs are vLLM's; SGLang's length is --context-length")
        for name, value in (("--context-length", context_length), ("--max-model-len", max_model_len)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if max_logprobs is not None and max_logprobs < -1:
            raise ValueError(f"--max-logprobs must be -1 (the vocabulary size) or at least 0, got {max_logprobs}")
        if disaggregation_mode not in ("null", "prefill", "decode"):
            raise ValueError(f"unknown disaggregation mode {disaggregation_mode!r}")
        if disaggregation_mode != "null" and protocol != "sglang":
            raise ValueError("--disaggregation-mode is SGLang's; vLLM P/D uses --kv-role")
        self.disagg: PrefillRooms | DecodeKV | None = None
        if disaggregation_mode == "prefill":
            self.disagg = PrefillRooms(bootstrap_port, disaggregation_timeout_s)
        elif disaggregation_mode == "decode":
            self.disagg = DecodeKV(disaggregation_timeout_s)
        if kv_role not in (None, "producer", "consumer"):
            raise ValueError(f"unknown KV role {kv_role!r}")
        if routed_experts and protocol != "vllm":
            raise ValueError("--enable-return-routed-experts is vLLM's; SGLang requests ask return_routed_experts")
        if kv_role is not None and protocol != "vllm":
            raise ValueError("--kv-role is vLLM's; SGLang P/D uses --disaggregation-mode")
        if decode_expert_rows not in ("sequence", "own"):
            raise ValueError(f"unknown decode expert rows {decode_expert_rows!r}")
        self.kv: KVProducer | KVConsumer | None = (
            KVProducer(kv_expiry_s, kv_connector) if kv_role == "producer"
            else KVConsumer() if kv_role == "consumer" else None
        )
        if block_size is None:
            block_size = 16 if protocol == "vllm" else 1
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        if capacity is not None and (ttft_ms or itl_ms or prefill_us_per_token):
            raise ValueError("with the capacity model the step time (--step-ms, --step-us-per-seq, "
                             "--step-us-per-prefill-token) times every token: drop --ttft-ms, --itl-ms "
                             "and --prefill-us-per-token")
        self.tokenizer = tokenizer if tokenizer is not None else SimTokenizer()
        model = self.tokenizer.model(vocab_size)
        script = (*self.tokenizer.encode(MARKER_TEXT), self.tokenizer.eos_id) if emit_markers else ()
        self.engine = SimEngine(
            model, ttft_ms / 1000.0, itl_ms / 1000.0,
            script=script, abort_after=abort_after, abort_status=abort_status,
            cache_tokens=cache_tokens, cache_block=block_size, whole_runs=protocol == "sglang",
            prefill_us_per_token=prefill_us_per_token, hasher=block_hasher(protocol), capacity=capacity,
            abort_forwards_once=protocol == "sglang",
        )
        if kv_events_config:
            # Imported only here: pyzmq is needed only by a simulator that publishes.
            from .kv_events import EventWire, KVEventPublisher, KVEventsConfig

            events = KVEventsConfig.parse(protocol, kv_events_config)
            if events is not None:
                if self.engine.cache is None:
                    raise ValueError("--kv-events-config needs the prefix cache (--cache-tokens above 0)")
                self.engine.events = KVEventPublisher(events, EventWire(protocol, engine_version, block_size))
        self.protocol: SGLangProtocol | VLLMProtocol = (
            VLLMProtocol(
                self.engine, model.vocab_size, model_name, usage_chunk,
                engine_version or VLLM_DEFAULT_VERSION, stream_interval=stream_interval, kv=self.kv,
                routed_experts=routed_experts,
                prompt_tokens_details=enable_prompt_tokens_details,
                decode_expert_rows=decode_expert_rows,
                max_model_len=max_model_len or MAX_MODEL_LEN,
                max_logprobs=MAX_LOGPROBS if max_logprobs is None else max_logprobs,
            )
            if protocol == "vllm"
            else SGLangProtocol(self.engine, self.tokenizer, incremental_streaming_output, model_name,
                                disconnect_abort_s, stream_interval=stream_interval, disagg=self.disagg,
                                decode_expert_rows=decode_expert_rows,
                                context_length=context_length or CONTEXT_LENGTH)
        )
        registry = GroupRegistry(weights_group_registry) if weights_group_registry else None
        cleaned = self.protocol.behaviour.clean_validation_errors if protocol == "vllm" else True
        self.weights = SimWeights(self.engine, protocol, tp_size, registry, weight_load_s, cleaned)
        self.admin = SimAdmin(self.engine, protocol, self.weights)
        self.engine_version = engine_version
        self.traceparents: dict[str, str] = {}
        #: SGLang health calls that waited for a pause or a weight load to end.
        self.health_waits = 0
        #: Requests served by ``"METHOD path"`` (/sim/stats ``requests``).
        self.requests: dict[str, int] = {}
        self.model_name = model_name
        self.model_path = str(ASSETS_DIR)
        self.parent_pid = parent_pid

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        self._count(method, path)
        p = self.protocol
        if path == "/sim/faults":
            await self._faults(method, receive, send)
        elif path == "/sim/kv_events" and method == "POST":
            await self._kv_events(receive, send)
        elif isinstance(p, VLLMProtocol):
            await self._vllm(p, scope, receive, send)
        elif path == "/generate" and method in ("POST", "PUT"):
            self.engine.generate_requests += 1
            body = await self._body(receive, send)
            if body is not None:
                self._note_traceparent(scope, body)
                await _crashing(lambda tracked: p.generate(body, receive, tracked), send)
        elif path == "/abort_request" and method == "POST":
            body = await self._body(receive, send)
            if body is not None:
                await p.abort_request(body, send)
        elif path in ("/health", "/health_generate") and method == "GET":
            await self._health(send, await self._health_generation())
        elif path == "/ready" and method == "GET":
            await send_unary(send, 503 if self.engine.held or self.engine.down else 200, b"")
        elif path in ("/get_server_info", "/server_info") and method == "GET":
            info = p.server_info(self.model_path)
            info["tp_size"] = self.weights.tp_size
            if self.engine_version is not None:
                info["version"] = self.engine_version
            info["page_size"] = self.engine.cache.block if self.engine.cache is not None else 1
            events = self.engine.events
            info["kv_events"] = events.sglang_descriptor() if events is not None else None
            await send_unary(send, 200, orjson.dumps(info))
        elif path in ("/get_model_info", "/model_info") and method == "GET":
            info = p.model_info(self.model_path)
            info["weight_version"] = self.weights.version
            await send_unary(send, 200, orjson.dumps(info))
        elif path == "/v1/models" and method == "GET":
            await send_unary(send, 200, orjson.dumps(self._models()))
        elif path == "/v1/loads" and method == "GET":
            version = self.engine_version or p.server_info(self.model_path)["version"]
            status, body, kind = sglang_loads(self.engine, scope.get("query_string", b""), version,
                                              MAX_TOTAL_NUM_TOKENS)
            await send_unary(send, status, body, kind)
        elif path == "/sim/stats" and method == "GET":
            await send_unary(send, 200, orjson.dumps(self._stats()))
        elif self.admin.serves(method, path):
            body = await self._body(receive, send)
            if body is not None:
                await self.admin.serve(path, scope.get("query_string", b""), body, send)
        else:
            await send_unary(send, 404, NOT_FOUND)

    def _count(self, method: str, path: str) -> None:
        """Count a request by route (bounded by :data:`MAX_COUNTED_ROUTES`)."""
        key = f"{method} {path}"
        if key not in self.requests and len(self.requests) >= MAX_COUNTED_ROUTES:
            key = "other"
        self.requests[key] = self.requests.get(key, 0) + 1

    def _note_traceparent(self, scope: dict, body: bytes) -> None:
        """Keep the ``traceparent`` a generate request carried, by its id."""
        value = next((v for k, v in scope["headers"] if k == b"traceparent"), None)
        if value is None:
            return
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        # vLLM's id is its X-Request-Id header, else the body's request_id
        # (OpenAIServing._base_request_id); SGLang's is the body's rid.
        header_id = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid = (obj.get("rid") or header_id or obj.get("request_id")) if isinstance(obj, dict) else None
        if isinstance(rid, str):
            self.traceparents.pop(rid, None)
            self.traceparents[rid] = value.decode("latin-1")
            if len(self.traceparents) > MAX_TRACEPARENTS:
                del self.traceparents[next(iter(self.traceparents))]

    def _stats(self) -> dict:
        stats = self.engine.stats()
        if self.engine.events is not None:
            stats["kv_events"] = self.engine.events.stats()
        stats["admin_calls"] = dict(self.admin.calls)
        stats["weights"] = self.weights.stats()
        stats["health_waits"] = self.health_waits
        stats["requests"] = dict(self.requests)
        stats["traceparents"] = dict(self.traceparents)
        d = self.disagg
        if d is not None:
            stats["role"] = "prefill" if isinstance(d, PrefillRooms) else "decode"
            stats["rooms_waiting"] = d.waiting
            stats["transfers"] = d.transfers
            stats["transfer_timeouts"] = d.timeouts
        kv = self.kv
        if isinstance(kv, KVProducer):
            stats.update(role="producer", kv_blocks_held=kv.blocks_held, kv_blocks_expired=kv.expired,
                         transfers=kv.transfers)
        elif isinstance(kv, KVConsumer):
            stats.update(role="consumer", transfers=kv.transfers, local_prefills=kv.local_prefills)
        return stats

    async def _vllm(self, p: VLLMProtocol, scope: dict, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if path == "/inference/v1/generate" and method == "POST":
            self.engine.generate_requests += 1
            body = await self._body(receive, send)
            if body is not None and (self.admin.sleeping or self.admin.refusing):
                why = "sleeping; POST /wake_up" if self.admin.sleeping else "paused; POST /resume"
                refused = error(f"The engine is {why} first.", "ServiceUnavailableError", 503)
                await send_unary(send, 503, orjson.dumps(refused.body))
            elif body is not None:
                self._note_traceparent(scope, body)
                await _crashing(lambda tracked: p.generate(body, dict(scope["headers"]), receive, tracked), send)
        elif path == "/abort_requests" and method == "POST":
            body = await self._body(receive, send)
            if body is not None:
                await p.abort_requests(body, send)
        elif path == "/health" and method == "GET":
            await self._health(send)
        elif path == "/version" and method == "GET":
            await send_unary(send, 200, orjson.dumps({"version": p.version}))
        elif path == "/kv_event_sources" and method == "GET" and p.behaviour.kv_event_sources:
            events = self.engine.events
            await send_unary(send, 200, orjson.dumps(events.vllm_sources() if events is not None else {}))
        elif path == "/v1/models" and method == "GET":
            await send_unary(send, 200, orjson.dumps(p.models(self.model_path)))
        elif path == "/metrics" and method == "GET":
            await send_unary(send, 200, vllm_metrics(self.engine, p.model_name), PROMETHEUS)
        elif path == "/sim/stats" and method == "GET":
            await send_unary(send, 200, orjson.dumps(self._stats()))
        elif self.admin.serves(method, path):
            body = await self._body(receive, send)
            if body is not None:
                await self.admin.serve(path, scope.get("query_string", b""), body, send)
        else:
            await send_unary(send, 404, NOT_FOUND)

    async def _health(self, send: Send, generated: bool = True) -> None:
        await send_unary(send, 503 if self.engine.down or not generated else 200, b"")

    async def _health_generation(self) -> bool:
        """SGLang's health generation: whether the scheduler served it
        within :data:`HEALTH_CHECK_TIMEOUT` seconds, waiting while the
        engine is paused or loading weights (module docstring)."""
        busy = lambda: self.engine.held or self.weights.loading > 0  # noqa: E731
        if not busy():
            return True
        self.health_waits += 1
        with anyio.move_on_after(HEALTH_CHECK_TIMEOUT):
            while busy():  # polled: a paused or loading engine is an admin moment
                await anyio.sleep(0.01)
        return not busy()

    async def _faults(self, method: str, receive: Receive, send: Send) -> None:
        if method == "DELETE":
            self.engine.clear_faults()
            self.weights.failures = 0
            await send_unary(send, 200, b"{}")
            return
        body = await self._body(receive, send) if method == "POST" else None
        if body is None:
            await send_unary(send, 405, orjson.dumps({"detail": "Method Not Allowed"}))
            return
        try:
            spec = orjson.loads(body)
            if "prefill_abort" in spec:
                count, when, delay = spec.get("count", 1), spec["prefill_abort"], spec.get("delay_ms", 0)
                if when not in ("before", "after") or type(count) is not int or count < 1 or \
                        type(delay) not in (int, float) or delay < 0:
                    raise ValueError
                self.engine.prefill_faults.extend([(when, delay / 1000)] * count)
                await send_unary(send, 200, b"{}")
                return
            if isinstance(spec, dict) and set(spec) == {"weight_updates"}:
                failures = spec["weight_updates"]
                if type(failures) is not int or failures < 1:
                    raise ValueError
                self.weights.failures += failures
                await send_unary(send, 200, b"{}")
                return
            count, after, length = spec.get("count", 1), spec["after_tokens"], spec.get("input_len")
            stall = spec.get("stall", False)
            if type(count) is not int or type(after) is not int or count < 1 or after < 0 or type(stall) is not bool:
                raise ValueError
            if length is not None and (type(length) is not int or length < 1):
                raise ValueError
        except (orjson.JSONDecodeError, AttributeError, KeyError, ValueError):
            await send_unary(send, 400, orjson.dumps(
                {"detail": 'expected {"count": N >= 1, "after_tokens": T >= 0, "input_len": L >= 1 or null, '
                           '"stall": bool} or {"count": N >= 1, "prefill_abort": "before"|"after", '
                           '"delay_ms": D >= 0} or {"weight_updates": N >= 1}'}))
            return
        self.engine.arm(count, after, length, stall)
        await send_unary(send, 200, b"{}")

    async def _kv_events(self, receive: Receive, send: Send) -> None:
        """``POST /sim/kv_events``: ``{"drop": [START, STOP]}`` keeps those
        sequence numbers off the live wire (replay still has them);
        ``{"restart": true}`` starts the sequence over with an empty cache,
        as a restarted engine."""
        body = await self._body(receive, send)
        if body is None:
            return
        events = self.engine.events
        try:
            spec = orjson.loads(body)
            drop = spec.get("drop")
            if drop is not None and not (isinstance(drop, list) and len(drop) == 2
                                         and all(type(v) is int and v >= 0 for v in drop)):
                raise ValueError
        except (orjson.JSONDecodeError, AttributeError, ValueError):
            await send_unary(send, 400, orjson.dumps({"detail": 'expected {"drop": [START, STOP]} or {"restart": true}'}))
            return
        if events is None:
            await send_unary(send, 409, orjson.dumps({"detail": "no --kv-events-config"}))
            return
        if drop is not None:
            events.drop(*drop)
        if spec.get("restart"):
            events.restart()
            self.engine.cache.clear()
        await send_unary(send, 200, b"{}")

    async def _body(self, receive: Receive, send: Send) -> bytes | None:
        try:
            return await read_body(receive, MAX_BODY)
        except ClientDisconnected:
            return None
        except BodyTooLarge:
            await send_unary(send, 413, orjson.dumps({"detail": "Request Entity Too Large"}))
            return None

    def _models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "sglang",
                    "root": self.model_path,
                    "max_model_len": self.protocol.context_length,
                }
            ],
        }

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    if self.parent_pid is not None:
                        tg.start_soon(self._watch_parent)
                    if isinstance(self.disagg, PrefillRooms):
                        await tg.start(self.disagg.serve)
                    if isinstance(self.kv, KVProducer):
                        await tg.start(self.kv.serve)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self.engine.events is not None:
                        self.engine.events.close()
                    tg.cancel_scope.cancel()
                    break
        # Outside the cancelled scope, or the send itself would be cancelled.
        await send({"type": "lifespan.shutdown.complete"})

    async def _watch_parent(self) -> None:
        # An embedded worker must not outlive the frontend that started it.
        while os.getppid() == self.parent_pid:
            await anyio.sleep(0.5)
        os._exit(0)


def _tracked(send: Send) -> Send:
    """``send`` that remembers (as ``send.started``) whether the response began."""
    async def tracked(message: dict) -> None:
        tracked.started = True
        await send(message)
    tracked.started = False
    return tracked


async def _crashing(generate, send: Send) -> None:
    """Run ``generate(send)``; a fired fault (``POST /sim/faults``) drops the
    connection, as a crashing engine does: mid-body when the response
    began, else after a head promising a body that never comes (a server
    would otherwise answer the exception with a 500 of its own)."""
    tracked = _tracked(send)
    try:
        await generate(tracked)
    except* SimFault:  # raised inside the protocol's task group
        if not tracked.started:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"1")]})
        raise
