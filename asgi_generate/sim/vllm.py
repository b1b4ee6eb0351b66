"""vLLM's native tokens-in/tokens-out protocol, as the simulator speaks it.

Follows vLLM ``ServingTokens`` and its models
(``vllm/entrypoints/scale_out/token_in_token_out/{protocol,serving,
api_router}.py``, read from the released wheels) for a server run with
``--tokens-only``, as the vLLM version it plays answers (``sim
--engine-version``, 0.25.0 and later; the behaviours that differ are listed
in :mod:`asgi_generate.sim.versions`):

- ``POST /inference/v1/generate``: the engine id is ``generate-tokens-`` plus
  the ``X-Request-Id`` header, else the body ``request_id``, else a random
  uuid. Unary answers are ``GenerateResponse`` objects (``model_dump``, nulls
  included, ``request_id`` the engine id); SSE answers are delta chunks
  carrying the engine id, one step of one choice each (one token; several,
  as vLLM sends under load, with ``sim --stream-interval N``), then the usage
  chunk if ``stream_options.include_usage`` (``exclude_none``; never with
  ``usage_chunk`` off, ``sim --no-usage-chunk``, like a build that sends
  none), then ``[DONE]``. An aborted request's finish-only chunk is dropped
  by versions before 0.32 (they skip outputs without tokens) and sent by
  later ones. Prompt logprobs appear only in unary answers. The field layout
  is the played version's (0.32 added ``stop_reason``, ``sampling_mask``,
  ``weight_versions``, ``output_mode`` and the prompt fields).
- ``n`` choices (``sampling_params.n``, at most the server's ``max_num_seqs``,
  256): choice ``i`` is the model's parallel sample ``i`` (choice 0 is the
  ``n`` = 1 answer, the others differ: :meth:`Model.sampled`), all drawn in
  lockstep under the one request id (vLLM's ``ParentRequest``: aborting the
  id aborts every child); a stream sends, per engine step, one chunk per
  choice that has tokens due, in index order; usage counts every choice's
  tokens (continuous usage: the chunk's own choice's).
- Logprobs, before 0.32: ``"token_id:N"`` labels with ``bytes`` null;
  from 0.32: ``GenerateLogProb`` entries (integer ``token_id``, ``logprob``,
  ``rank``). ``top_logprobs`` is the sampled token, then the top-k without
  it (the greedy token is always in the top-k, so ``max(k, 1)`` entries in
  every version); prompt logprobs map each prompt token,
  then the top-k, to ``{logprob, rank, decoded_token}`` (``decoded_token``
  null: tokens-only mode does not detokenize). Newer versions add each
  choice's ``stop_reason``: the matched stop token id, null for EOS or a cap.
- Refusals in vLLM's order: the request schema (``GenerateRequest``;
  unknown fields are ignored, numbers and booleans read as pydantic's lax
  mode reads them; every error listed, a malformed ``sampling_params``
  first the failed ``is-instance`` branch of ``PydanticMsgspecMixin``'s
  union), rendered as the played version's ``validation_exception_handler``
  does (from 0.30 a cleaned dotted ``loc``, a bounded ``input``, at most
  ten errors, before pydantic's tuple and the whole input);
  ``SamplingParams._verify_args`` (``vllm/sampling_params.py``, run inside
  pydantic's validation once every field is well typed: its
  ``VLLMValidationError`` is no ``ValueError``, so it ends validation and is
  a ``BadRequestError`` naming its parameter), then
  ``serve_tokens``
  (unknown model, ``n`` above ``max_num_seqs``, stop strings on a tokens-only
  server: 0.31 and later refuse them, older ones accept and never apply
  them), then the input checks (logprob counts, ``logprobs=-1`` read as
  the vocabulary size; ``structured_outputs``, which a tokens-only server
  refuses whatever it holds, :mod:`asgi_generate.sim.grammars`; the
  vocabulary; the prompt against ``max_model_len``). ``max_tokens`` beyond the context stops
  generation at the context end, or is refused from 0.34 (vLLM main after
  0.33.0; its message here is the simulator's own); the int32 overflow that
  kills a 0.33 engine on a huge value is not simulated.
- ``POST /abort_requests`` ``{"request_ids": [...]}``: exact (prefixed) ids,
  200 with an empty body; missing ids or bad JSON are 400.
- ``GET /version``: ``{"version": V}`` (vLLM ``show_version``).
- A client disconnect aborts its request at once (vLLM's
  ``with_cancellation``).

Errors are vLLM's nested ``{"error": {"message", "type", "param", "code"}}``:
schema errors in the shape of vLLM's ``RequestValidationError`` handler, bad
values as ``BadRequestError``, an unknown model as 404 ``NotFoundError``.

Generation is the shared deterministic :class:`~asgi_generate.sim.model.Model`,
greedy, so a prefix gives the same tokens here as in SGLang mode. Sampling
knobs other than ``n``, ``max_tokens``, ``stop_token_ids``, ``ignore_eos``,
``logprobs`` and ``prompt_logprobs`` are checked and then ignored;
multimodal ``features`` are checked and the answer depends on the token ids
alone.

Routed experts (vLLM ``--enable-return-routed-experts``, here ``sim
--enable-return-routed-experts``): a finished choice's ``routed_experts`` is
the base64 ``.npy`` array of the rows of every position the engine forwarded
(``[num_tokens - 1, num_layers, top_k]``), in the unary answer or the
stream's finishing chunk; null without the flag, on other chunks and for an
aborted request.

P/D (``--kv-role``, :mod:`asgi_generate.sim.kvconnector`): a producer
answers ``kv_transfer_params`` for a prefill finished as its connector hands
off (a length cap; a stop too with ``NixlConnector``), with its prefix-cache
hit from 0.31; a consumer that read the prompt's KV from its producer
computed no prompt position, so it answers ``prompt_logprobs`` null, reports
the producer's hit as ``cached_tokens`` (before 0.31: the whole prompt it
loaded) and, as 0.27 reads routed experts from the slots of the request's KV
blocks (``RoutedExpertsManager.get``), rows for every position with zeros
for the prompt's (with ``decode_expert_rows="own"``: rows only for the
output positions it forwarded, none for one token). A consumer prefills the
prompt itself, and answers like an aggregated engine, when its blocks are
gone, when asked for ``prompt_logprobs`` (0.31 and later) and, from 0.33,
when it returns routed experts (the auxiliary-output connector takes no
remote KV whose rows it lacks; see :mod:`asgi_generate.sim.versions`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import anyio
import orjson

from .framing import SSE_HEADERS, Receive, Send, send_unary, sse_event
from .engine import DuplicateRequestId, Job, SimEngine, Token
from .grammars import VLLM_REFUSAL
from .kvconnector import KVConsumer, KVProducer
from .model import experts_npy_base64
from .versions import VLLM_DEFAULT_VERSION, VLLMPlayed, vllm_played
from .vllm_checks import REQUEST, Invalid, VLLMError, check_features, error, invalid, render_invalid, stop_strings, validate

DONE = b"data: [DONE]\n\n"
ENGINE_PREFIX = "generate-tokens-"
#: ``--max-model-len`` here by default (vLLM's own: the model config's).
MAX_MODEL_LEN = 32768
#: vLLM's default ``--max-logprobs`` (-1: the vocabulary size).
MAX_LOGPROBS = 20
#: vLLM's default ``--max-num-seqs``: the most choices one request may ask.
MAX_NUM_SEQS = 256
LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class Options:
    """What shapes one answer besides the tokens.

    ``logprobs``/``prompt_logprobs`` are the requested k (``None`` = off);
    ``n`` the number of choices.
    """

    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None
    prompt_logprobs: int | None
    n: int = 1
    kv_transfer_params: dict | None = None


class VLLMProtocol:
    """Answers vLLM ``/inference/v1/generate`` and ``/abort_requests`` for a
    sim engine, as vLLM ``version`` does.

    Args:
        engine: the shared simulator engine.
        vocab_size: token ids at or above this are out of vocabulary.
        model_name: the served model name (``model`` in answers).
        usage_chunk: end a stream with the usage chunk when it asks for one;
            off, act as a vLLM build that never sends it (the stream ends
            after its finishing chunk).
        version: the vLLM version played (``GET /version``): any version
            string from 0.25.0 on (see
            :data:`~asgi_generate.sim.versions.VLLM_VERSIONS`).
        stream_interval: tokens per streamed chunk.
        kv: the P/D KV connector, if any.
        routed_experts: answer each finished choice's ``routed_experts``.
        prompt_tokens_details: vLLM's ``--enable-prompt-tokens-details``:
            the final usage carries ``prompt_tokens_details`` with the
            prefix-cache hit as ``cached_tokens``, 0 included (``ServingTokens``
            in ``vllm/entrypoints/scale_out/token_in_token_out/serving.py``);
            off, ``prompt_tokens_details`` is null.
        decode_expert_rows: a consumer's routed experts after it read the
            prompt's KV: ``sequence`` (every position, zeros for the
            prompt's) or ``own`` (the output positions only); ``own`` also
            keeps a 0.33 consumer loading the KV rather than prefilling.
        max_model_len: vLLM ``--max-model-len``: prompt plus output tokens.
        max_logprobs: vLLM ``--max-logprobs``: the largest ``logprobs`` and
            ``prompt_logprobs`` (-1: the vocabulary size).

    Raises:
        ValueError: ``version`` is not a version the simulator can play.
    """

    def __init__(
        self,
        engine: SimEngine,
        vocab_size: int,
        model_name: str = "sim",
        usage_chunk: bool = True,
        version: str = VLLM_DEFAULT_VERSION,
        stream_interval: int = 1,
        kv: KVProducer | KVConsumer | None = None,
        routed_experts: bool = False,
        prompt_tokens_details: bool = False,
        decode_expert_rows: str = "sequence",
        max_model_len: int = MAX_MODEL_LEN,
        max_logprobs: int = MAX_LOGPROBS,
    ) -> None:
        behaviour = vllm_played(version)
        self.engine = engine
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.usage_chunk = usage_chunk
        #: Tokens per streamed chunk: an engine step under load yields several.
        self.stream_interval = stream_interval
        self.behaviour: VLLMPlayed = behaviour
        #: P/D: the KV connector of a producer (prefill) or consumer (decode).
        self.kv = kv
        #: vLLM ``--enable-return-routed-experts``.
        self.routed_experts = routed_experts
        self.prompt_tokens_details = prompt_tokens_details
        self.decode_expert_rows = decode_expert_rows
        self.max_model_len = max_model_len
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs

    @property
    def version(self) -> str:
        """The vLLM version played."""
        return self.behaviour.version

    # -- request parsing -------------------------------------------------

    def parse(self, body: bytes, headers: Mapping[bytes, bytes]) -> tuple[Job, Options]:
        """Check a request and build its job; ``headers`` has lower-case names.

        Raises:
            VLLMError: vLLM's status and body for the bad input.
        """
        media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if media != b"application/json":
            raise error(
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                "Bad Request",
            )
        try:
            obj = self._validated(body)
        except Invalid as exc:
            raise render_invalid(exc.errors, self.behaviour.clean_validation_errors) from None
        ids = obj["token_ids"]
        sp = obj["sampling_params"]
        model = obj.get("model")
        if model is not None and model != self.model_name:
            raise error(f"The model `{model}` does not exist.", "NotFoundError", 404, "model")
        n = sp.get("n", 1)
        capacity = self.engine.capacity
        max_num_seqs = capacity.config.max_running if capacity is not None else None
        max_num_seqs = max_num_seqs or MAX_NUM_SEQS  # --max-num-seqs, else vLLM's default
        if n > max_num_seqs:
            raise error(f"sampling_params.n must be at most the server's max_num_seqs ({max_num_seqs}), got {n}.")
        if self.behaviour.refuses_stop_strings and stop_strings(sp):
            raise error(
                "stop strings are not supported on a --tokens-only server because detokenization is disabled. "
                "Check stop strings on the coordinator, or use stop_token_ids."
            )
        ks = {}
        for key, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            k = sp.get(key)
            if k == -1:  # SamplingParams._validate_logprobs: the whole vocabulary
                k = self.vocab_size
            if k is not None and k > self.max_logprobs:
                raise error(
                    f"Requested {what} logprobs of {k}, which is greater than max allowed: {self.max_logprobs}",
                    param=key,
                )
            ks[key] = k
        if sp.get("structured_outputs") is not None:  # SamplingParams._validate_structured_outputs
            raise error(VLLM_REFUSAL)
        if obj.get("features") is not None:
            check_features(obj["features"], len(ids))
        if max(ids) >= self.vocab_size:
            raise error(f"Token id {max(ids)} is out of vocabulary")
        limit = self.max_model_len
        if len(ids) > limit:  # input_processor._validate_prompt_len
            raise error(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                f"of {limit}. Make sure that `max_model_len` is no smaller than the number "
                "of text tokens."
            )
        if len(ids) == limit:
            raise error(
                f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {limit}. Make sure "
                "that `max_model_len` is no smaller than the number of text tokens (prompt + "
                "requested output tokens)."
            )
        # An omitted max_tokens means the rest of the context; more stops at
        # the context end, or is refused by versions that bound it.
        room = limit - len(ids)
        max_tokens = sp.get("max_tokens")
        if max_tokens is not None and max_tokens > room and self.behaviour.bounds_max_tokens:
            raise error(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {len(ids)} input tokens, for a total of "
                f"{len(ids) + max_tokens} tokens. Please reduce the length of the input prompt or the number of "
                f"requested output tokens. (parameter=input_tokens, value={len(ids)})",
                param="input_tokens",
            )
        header_id = headers.get(b"x-request-id")
        base = header_id.decode("latin-1") if header_id is not None else obj.get("request_id", uuid.uuid4().hex)
        so = obj.get("stream_options")
        include = so is not None and bool(so.get("include_usage", True))
        job = Job(
            rid=ENGINE_PREFIX + base,
            input_ids=ids,
            max_new_tokens=room if max_tokens is None else min(max_tokens, room),
            stop_token_ids=frozenset(sp.get("stop_token_ids") or ()),
            ignore_eos=sp.get("ignore_eos", False),
            namespace=(obj.get("cache_salt") or None,),
            priority=obj.get("priority", 0),
            seqs=n,
        )
        opts = Options(
            stream=bool(obj.get("stream")),
            include_usage=include,
            continuous_usage=include and bool(so.get("continuous_usage_stats")),
            logprobs=ks["logprobs"],
            prompt_logprobs=ks["prompt_logprobs"],
            n=n,
            kv_transfer_params=obj.get("kv_transfer_params"),
        )
        return job, opts

    @staticmethod
    def _validated(body: bytes) -> dict:
        """The body as pydantic validates ``GenerateRequest`` (FastAPI reads
        it with ``json.loads``).

        Raises:
            Invalid: pydantic's errors.
        """
        if not body:
            raise invalid("missing", (), "Field required", None)
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise invalid("json_invalid", (exc.pos,), "JSON decode error", {}, {"error": exc.msg}) from None
        return validate(obj, REQUEST)

    # -- answer building -------------------------------------------------

    def _entry(self, tok: int, lp: float, rank: int) -> dict:
        if self.behaviour.generate_schema:
            return {"token_id": tok, "logprob": max(lp, LOGPROB_FLOOR), "rank": rank}
        return {"token": f"token_id:{tok}", "logprob": max(lp, LOGPROB_FLOOR), "bytes": None}

    def _logprobs(self, token: Token, k: int) -> dict:
        """One ``logprobs.content`` entry (vLLM ``_create_tokens_logprobs``;
        newer versions ``GenerateLogProbsContent``)."""
        tok = token.token_id
        model, state = self.engine.model, token.step.state
        rank = model.rank(state, tok)
        ranked = [(tok, model.logprob(state, tok), rank)]
        ranked += [(t, v, i + 1) for i, (t, v) in enumerate(model.top(token.step, k)) if t != tok]
        return {**self._entry(*ranked[0]), "top_logprobs": [self._entry(*r) for r in ranked[: max(k, 1)]]}

    def _prompt_logprobs(self, ids: list[int], k: int) -> list[dict | None]:
        """``prompt_logprobs``: null, then per position the prompt token and
        the top-k (a top-k entry for the prompt token keeps its place)."""
        model = self.engine.model
        out: list[dict | None] = [None]
        state = model.fold(ids[:1])
        for tok in ids[1:]:
            entry = {
                str(tok): {
                    "logprob": max(model.logprob(state, tok), LOGPROB_FLOOR),
                    "rank": model.rank(state, tok),
                    "decoded_token": None,
                }
            }
            for i, (t, v) in enumerate(model.top(model.step(state), k)):
                entry[str(t)] = {"logprob": max(v, LOGPROB_FLOOR), "rank": i + 1, "decoded_token": None}
            out.append(entry)
            state = model.advance(state, tok)
        return out

    def _experts(self, seq: list[int], received: int) -> str | None:
        """``routed_experts`` of ``seq`` (prompt and output) but its last
        token, the first ``received`` of them (whose KV this consumer read)
        zeros, or, with ``decode_expert_rows="own"``, left out; ``None``
        when there are none."""
        start = received if self.decode_expert_rows == "own" else 0
        if len(seq) - 1 <= start:
            return None
        model = self.engine.model
        rows = model.expert_rows(seq, start, received)
        return experts_npy_base64(rows, model.num_layers, model.experts_topk, model.num_experts)

    def _declines_kv(self, opts: Options) -> bool:
        """Whether this consumer prefills the prompt itself although its
        producer's KV is there (see the module docstring)."""
        b = self.behaviour
        experts = b.expert_rows_by_block and self.routed_experts and self.decode_expert_rows == "sequence"
        return experts or (b.prompt_logprobs_prefill_locally and opts.prompt_logprobs is not None)

    def _choice(
        self, index: int, logprobs: Any, finish: str | None, stop_reason: int | None, ids: list[int],
        experts: str | None = None, versions: list[list] | None = None, generated: int = 0,
    ) -> dict:
        """One choice in the played version's field order (``model_dump``);
        a finished one's ``weight_versions`` are the spans of ``versions``
        (``[version, first token index]`` starts) over its ``generated``
        output tokens, as ``output_processor.py`` ``_weight_version_spans``
        makes them."""
        if not self.behaviour.generate_schema:
            return {"index": index, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids,
                    "routed_experts": experts}
        spans = None
        if finish is not None and versions is not None and self.behaviour.weight_version_spans:
            ends = [start for _, start in versions[1:]] + [generated]
            spans = [{"version": v, "start": start, "end": end} for (v, start), end in zip(versions, ends)]
        return {"index": index, "finish_reason": finish, "stop_reason": stop_reason, "token_ids": ids,
                "routed_experts": experts, "sampling_mask": None, "weight_versions": spans, "logprobs": logprobs}

    def _usage(self, prompt: int, completion: int) -> dict:
        """vLLM's ``UsageInfo`` for ``prompt`` input and ``completion`` output
        tokens, null fields included (``model_dump``), in the played
        version's fields."""
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        }
        if self.behaviour.completion_tokens_details:
            usage["completion_tokens_details"] = None
        return usage

    def _final_usage(self, job: Job, completion: int) -> dict:
        """The answer's usage: with ``prompt_tokens_details`` on, vLLM's
        ``PromptTokenUsageInfo`` with the prefix-cache hit as
        ``cached_tokens`` (0 included) and its other fields null."""
        usage = self._usage(len(job.input_ids), completion)
        if self.prompt_tokens_details:
            details: dict[str, Any] = {"cached_tokens": job.cached_tokens}
            if self.behaviour.created_cache_tokens:
                details["created_cache_tokens"] = None
            details["multimodal_tokens"] = None  # this route fills it for no modality
            usage["prompt_tokens_details"] = details
        return usage

    def _chunk(self, rid: str, choices: list[dict], usage: dict | None) -> dict:
        """A stream chunk (``GenerateStreamResponse``; newer versions leave
        out the prompt fields a token-bearing chunk lacks)."""
        if not self.behaviour.generate_schema:
            return {"request_id": rid, "choices": choices, "usage": usage}
        return {"request_id": rid, "usage": usage, "output_mode": "tokens", "choices": choices}

    # -- HTTP ------------------------------------------------------------

    async def generate(self, body: bytes, headers: Mapping[bytes, bytes], receive: Receive, send: Send) -> None:
        """Serve one ``POST /inference/v1/generate``."""
        try:
            job, opts = self.parse(body, headers)
            capacity = self.engine.capacity
            refusal = capacity.vllm_admission(1 if opts.stream else opts.n) if capacity is not None else None
            if refusal is not None:
                # AsyncLLM.check_admission from ServingTokens._preflight: before any byte.
                raise error(refusal, "Service Unavailable", 503)
            self.engine.submit(job)
        except VLLMError as exc:
            await send_unary(send, exc.status, orjson.dumps(exc.body))
            return
        except DuplicateRequestId as exc:
            await send_unary(send, 400, orjson.dumps(error(f"Request id {exc} already running.").body))
            return
        last = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, job, tg.cancel_scope)
                last = await self._run(job, opts, send)
                tg.cancel_scope.cancel()
        finally:
            self.engine.finish(job)
        # Sent once the watcher is gone: the server reports the end of every
        # answered request as a disconnect, which is not the client's doing.
        if last is not None:
            for message in last:
                await send(message)

    async def _watch_disconnect(self, receive: Receive, job: Job, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.engine.disconnected(job)
        scope.cancel()

    async def _run(self, job: Job, opts: Options, send: Send) -> list[dict]:
        """Generate, sending all but the answer's last messages, which it returns."""
        prompt = len(job.input_ids)
        n = opts.n
        out: list[list[int]] = [[] for _ in range(n)]
        content: list[list[dict]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        stop_reason: list[int | None] = [None] * n
        k = opts.logprobs
        pending: list[list[int]] = [[] for _ in range(n)]  # streamed tokens not yet sent
        if opts.stream:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        params = opts.kv_transfer_params
        # The first position this engine forwards: after a prompt whose KV
        # it read from a producer.
        start = 0
        if isinstance(self.kv, KVConsumer) and params and params.get("do_remote_prefill"):
            if await self.kv.load(params, job.input_ids, self._declines_kv(opts)):
                start = prompt
                job.kv_cached = prompt  # the prompt it loaded counts as cached
            relayed = params.get("remote_prefill_cached_tokens")
            if self.behaviour.relays_prefill_cache and type(relayed) is int:
                job.kv_cached = relayed  # whether it loaded the KV or not
        experts: list[str | None] = [None] * n
        if n > 1:
            self.engine.batch_requests += 1
            self.engine.batch_items += n
        eos = self.engine.model.eos_id
        # Per choice: [weight version, first output index] at each change
        # (output_processor.py track_weight_version).
        versions: list[list[list]] = [[] for _ in range(n)]
        async for step in self.engine.samples(job, tuple(range(n))):
            for i, token in step:
                version = self.engine.model.weight_version
                if not versions[i] or versions[i][-1][0] != version:
                    versions[i].append([version, len(out[i])])
                out[i].append(token.token_id)
                finish[i] = token.finish[0] if token.finish is not None else None
                # vLLM names a matched stop token; EOS (checked first) and caps have none.
                if finish[i] == "stop" and token.token_id in job.stop_token_ids and not (
                    token.token_id == eos and not job.ignore_eos
                ):
                    stop_reason[i] = token.token_id
                if k is not None:
                    content[i].append(self._logprobs(token, k))
                if finish[i] is not None and self.routed_experts:
                    experts[i] = self._experts(job.input_ids + out[i], start)
                if not opts.stream:
                    continue
                pending[i].append(token.token_id)
                if finish[i] is None and len(pending[i]) < self.stream_interval:
                    continue
                await self._stream_choice(send, job.rid, opts, i, pending[i], content[i], finish[i], stop_reason[i],
                                          prompt, len(out[i]), experts[i], versions[i])
                pending[i] = []
        if job.aborted:
            for i in range(n):
                if finish[i] is not None:
                    continue
                finish[i] = "abort"
                # The aborted output carries the tokens not sent yet; without any,
                # versions before 0.32 skip it and later ones send it anyway.
                if opts.stream and (pending[i] or self.behaviour.generate_schema):
                    await self._stream_choice(send, job.rid, opts, i, pending[i], content[i], "abort", None,
                                              prompt, len(out[i]), None, versions[i])
        completion = sum(len(o) for o in out)
        if opts.stream:
            tail = b""
            if opts.include_usage and self.usage_chunk:
                # The closing chunk leaves out null fields (vLLM's exclude_none).
                usage = _without_nulls(self._final_usage(job, completion))
                tail = sse_event(orjson.dumps(self._chunk(job.rid, [], usage)))
            return [{"type": "http.response.body", "body": tail + DONE, "more_body": False}]
        pk = opts.prompt_logprobs
        kv_out = None
        if isinstance(self.kv, KVProducer) and params and params.get("do_remote_decode") and not job.aborted:
            cached = job.cached_tokens if self.behaviour.relays_prefill_cache else None
            kv_out = self.kv.finished(job.rid, job.input_ids, finish[0] or "stop", cached)
        choices = [
            self._choice(i, {"content": content[i]} if k is not None else None, finish[i] or "stop", stop_reason[i],
                         out[i], experts[i], versions[i], len(out[i]))
            for i in range(n)
        ]
        usage = self._final_usage(job, completion)
        # A consumer that read the prompt's KV computed no prompt position.
        prompt_logprobs = self._prompt_logprobs(job.input_ids, pk) if pk is not None and start == 0 else None
        head = {"request_id": job.rid, "model": self.model_name, "created": int(time.time())}
        if self.behaviour.generate_schema:
            answer = {
                **head, "usage": usage, "prompt_logprobs": prompt_logprobs, "prompt_token_id_logprobs": None,
                "prompt_token_ids": None, "mm_placeholders": None, "metrics": None, "kv_transfer_params": kv_out,
                "ec_transfer_params": None, "output_mode": "tokens", "choices": choices,
            }
        else:
            answer = {
                **head, "choices": choices, "usage": usage, "prompt_logprobs": prompt_logprobs,
                "kv_transfer_params": kv_out, "ec_transfer_params": None,
            }
        body = orjson.dumps(answer)
        return [
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            },
            {"type": "http.response.body", "body": body, "more_body": False},
        ]

    async def _stream_choice(
        self, send: Send, rid: str, opts: Options, index: int, ids: list[int], content: list[dict],
        finish: str | None, stop_reason: int | None, prompt: int, generated: int, experts: str | None = None,
        versions: list[list] | None = None,
    ) -> None:
        """One chunk of choice ``index``: its tokens ``ids`` (the last of
        ``content``'s entries), with continuous usage counting that choice's
        ``generated`` tokens (vLLM's ``num_generated_tokens[i]``)."""
        logprobs = {"content": content[-len(ids):]} if opts.logprobs is not None and ids else None
        choice = self._choice(index, logprobs, finish, stop_reason, ids, experts, versions, generated)
        usage = self._usage(prompt, generated) if opts.continuous_usage else None
        await self._send_chunk(send, self._chunk(rid, [choice], usage))

    @staticmethod
    async def _send_chunk(send: Send, chunk: dict) -> None:
        await send({"type": "http.response.body", "body": sse_event(orjson.dumps(chunk)), "more_body": True})

    async def abort_requests(self, body: bytes, send: Send) -> None:
        """Serve ``POST /abort_requests``: abort the named (prefixed) ids."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            await send_unary(send, 400, orjson.dumps(error(f"JSON decode error: {exc}", "Bad Request").body))
            return
        ids = obj.get("request_ids") if isinstance(obj, dict) else None
        if ids is None:
            missing = error("Missing 'request_ids' in request body", "Bad Request")
            await send_unary(send, 400, orjson.dumps(missing.body))
            return
        # vLLM's engine client takes one id or a list of them.
        ids = [ids] if isinstance(ids, str) else ids if isinstance(ids, list) else []
        self.engine.abort_ids([r for r in ids if isinstance(r, str)])
        await send_unary(send, 200, b"")

    def models(self, model_path: str) -> dict:
        """The ``/v1/models`` body, with ``max_model_len``."""
        now = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": now,
                    "owned_by": "vllm",
                    "root": model_path,
                    "parent": None,
                    "max_model_len": self.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex}",
                            "object": "model_permission",
                            "created": now,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }


def _without_nulls(obj: dict) -> dict:
    """``obj`` without its null fields, nested objects' too (pydantic's
    ``exclude_none``)."""
    return {k: _without_nulls(v) if type(v) is dict else v for k, v in obj.items() if v is not None}
