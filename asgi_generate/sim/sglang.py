"""SGLang's native ``/generate`` protocol, as the simulator speaks it.

Follows SGLang ``python/sglang/srt/entrypoints/http_server.py``
(``generate_request``: unary object, or SSE chunks ending ``data: [DONE]``;
a ``ValueError`` is 400 ``{"error": {"message"}}``, or in-band after the 200
of a stream), ``managers/io_struct.py`` (``GenerateReqInput`` normalisation
and its messages), ``managers/tokenizer_manager.py`` (``_validate_one_request``,
``_validate_token_ids_logprob``, ``_wait_one_response``: a scheduler abort
with status 400 is a ``ValueError``, with 500/503 an ``HTTPException``;
streams get the abort as their final chunk), ``sampling/sampling_params.py``
(``SamplingParams.__post_init__``/``verify``: unknown keys are a
``TypeError``, an unhandled 500) and the scheduler's output processing
(``stream_output``: with ``--stream-interval N`` a chunk goes out after
tokens 1, N+1, 2N+1, ... and at the finish; chunks are cumulative, or deltas
with ``--incremental-streaming-output``). ``meta_info`` carries
``finish_reason`` objects, logprob triples ``[logprob, token_id, text|null]``
(``token_ids_logprob`` fills ``input/output_token_ids_logprobs`` the same
way) and routed experts as base64 int32.

In P/D (``disaggregation``, see :mod:`asgi_generate.sim.disagg`) a prefill
server answers after its KV went to the decode server with
``finish_reason {"type": "length", "length": 0}``, the first token, the
prompt logprobs and the prompt's expert rows (``disaggregation/prefill.py``:
the request finishes with ``FINISH_LENGTH(length=0)`` once transferred, its
rows collected then); a decode server answers like an aggregated one from the
first token on, with empty ``input_*`` logprobs (it never saw the prompt's
logits), the prefill's ``cached_tokens`` (carried with the KV) and, as SGLang
0.5.23 does, the expert rows of ``[routed_experts_start_len, seqlen - 1)`` of
its own capture buffers (``BatchResultProcessor._maybe_collect_routed_experts``
in ``managers/scheduler_components/batch_result_processor.py``): the prompt
positions it never forwarded come out as zeros, then the output positions'
real rows. With ``decode_expert_rows="own"`` it answers only the rows of the
positions it computed, none when it computed none.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, AsyncIterator

import anyio
import orjson

from .framing import SSE_HEADERS, Receive, Send, send_unary, sse_event
from .disagg import DecodeKV, PrefillRooms, bootstrap_failed, transfer_failed
from .engine import DuplicateRequestId, Job, SimEngine, Token
from .grammars import sglang_grammar_refusal
from .sglang_batch import is_batch, serve_batch
from .sglang_checks import DEFAULT_MAX_NEW_TOKENS, SGLangError, field, schema_error, value_error, verify_sampling
from .tokenizer import SimTokenizer

DONE = b"data: [DONE]\n\n"
#: SGLang's ``--context-length`` here by default (SGLang's own default is the
#: model config's ``max_position_embeddings``).
CONTEXT_LENGTH = 32768
#: SGLang's ``--disaggregation-bootstrap-port`` default.
DEFAULT_BOOTSTRAP_PORT = 8998
ROOM_LIMIT = 1 << 63
#: The KV pool size ``/get_server_info`` reports (``max_total_num_tokens``).
MAX_TOTAL_NUM_TOKENS = 262144


class SGLangProtocol:
    """Answers SGLang ``/generate`` and ``/abort_request`` for a sim engine.

    Args:
        engine: the shared simulator engine.
        tokenizer: the bundled tokenizer, for ``text`` in and out.
        incremental: stream deltas instead of cumulative chunks.
        model_name: reported in server and model info.
        stream_interval: tokens per streamed chunk (SGLang ``--stream-interval``).
        disagg: the P/D role's KV hand-over: :class:`PrefillRooms` for a
            prefill server, :class:`DecodeKV` for a decode server, ``None``
            for an aggregated one.
        decode_expert_rows: a decode server's routed experts: ``sequence``
            (SGLang's: every position from ``routed_experts_start_len``,
            zeros where it received the KV) or ``own`` (the positions it
            computed only).
        context_length: SGLang ``--context-length``: prompt plus
            ``max_new_tokens`` at most this many tokens.

    Token ids are bounded by the engine model's vocabulary
    (``engine.model.vocab_size``).
    """

    def __init__(
        self,
        engine: SimEngine,
        tokenizer: SimTokenizer,
        incremental: bool = False,
        model_name: str = "sim",
        disconnect_abort_s: float = 2.0,
        stream_interval: int = 1,
        disagg: PrefillRooms | DecodeKV | None = None,
        decode_expert_rows: str = "sequence",
        context_length: int = CONTEXT_LENGTH,
    ) -> None:
        self.engine = engine
        self.context_length = context_length
        self.vocab_size = engine.model.vocab_size
        self.disagg = disagg
        self.decode_expert_rows = decode_expert_rows
        self.mode = (
            "prefill" if isinstance(disagg, PrefillRooms) else "decode" if isinstance(disagg, DecodeKV) else "null"
        )
        self.tok = tokenizer
        self.incremental = incremental
        self.model_name = model_name
        self.disconnect_abort_s = disconnect_abort_s
        self.stream_interval = stream_interval

    # -- request parsing -------------------------------------------------

    @staticmethod
    def load(body: bytes) -> dict:
        """The request object.

        Raises:
            SGLangError: not JSON, or not an object (FastAPI's 400).
        """
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise schema_error(f"JSON decode error: {exc}") from None
        if not isinstance(obj, dict):
            raise schema_error("Input should be a valid dictionary")
        return obj

    def parse(self, obj: dict) -> tuple[Job, dict]:
        """Turn a ``/generate`` object into a job and the options that shape
        the answer, refusing what SGLang refuses, in SGLang's order.

        Raises:
            SGLangError: SGLang's status and body for the bad input.
        """
        text = obj.get("text")
        input_ids = obj.get("input_ids")
        embeds = obj.get("input_embeds")
        if (text is None and input_ids is None and embeds is None) or (
            text is not None and input_ids is not None and embeds is not None
        ):
            raise value_error("Either text, input_ids or input_embeds should be provided.")
        if text is None and input_ids is None:
            raise value_error("The simulator does not serve input_embeds.")
        if isinstance(input_ids, list) and not input_ids and text is None:
            raise value_error("input_ids cannot be empty.")
        if text is not None:  # SGLang reads text first
            if not isinstance(text, str):
                raise schema_error("text: expected str")
            input_ids = self.tok.encode(text)
        elif not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            raise schema_error("input_ids: expected a list of integers")
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in input_ids):
            raise value_error(f"Token id out of range [0, {vocab}).")
        sp = field(obj, "sampling_params", (dict,), {})
        # A plain dict in SGLang: a float passes to the length check as it is.
        max_new = field(sp, "max_new_tokens", (int, float), None)
        if "max_new_tokens" not in sp:
            max_new = DEFAULT_MAX_NEW_TOKENS
        field(sp, "n", (int,), 1)  # a batch entry's; n > 1 is expanded by sglang_batch
        context = self.context_length
        if len(input_ids) >= context:
            raise value_error(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({context} tokens)."
            )
        if max_new is not None and len(input_ids) + max_new > context:
            raise value_error(
                f"Requested token count exceeds the model's maximum context length "
                f"of {context} tokens. You requested a total of "
                f"{len(input_ids) + max_new} tokens: {len(input_ids)} tokens from the "
                f"input messages and {max_new} tokens for the completion. Please reduce the number "
                f"of tokens in the input messages or the completion to fit within the limit."
            )
        ids_lp = obj.get("token_ids_logprob") or None
        if ids_lp is not None:
            if not isinstance(ids_lp, list) or not all(type(t) is int for t in ids_lp):
                raise value_error("token_ids_logprob must be a flat list of integers.")
            for t in ids_lp:
                if not 0 <= t < vocab:
                    raise value_error(
                        f"token_ids_logprob contains out-of-vocabulary token id {t}; "
                        f"valid range is [0, {vocab})."
                    )
        bias = verify_sampling(sp, vocab)
        if max_new is None:
            max_new = context - len(input_ids)
        max_new = math.ceil(max_new)  # a float: the scheduler stops at the first count reaching it
        stop = field(sp, "stop", (str, list), [])
        stops = tuple([stop] if isinstance(stop, str) else stop)
        stop_ids = field(sp, "stop_token_ids", (list,), [])
        rid = field(obj, "rid", (str,), None) or uuid.uuid4().hex
        start_len = field(obj, "logprob_start_len", (int,), -1)
        if start_len < -1:
            raise value_error(f"logprob_start_len ({start_len}) must be -1 or at least 0.")
        return_logprob = bool(field(obj, "return_logprob", (bool,), False))
        if not return_logprob or start_len == -1:
            start_len = len(input_ids) - 1
        if start_len >= len(input_ids):
            raise value_error(
                f"logprob_start_len ({start_len}) is higher than the number of input "
                f"tokens ({len(input_ids)}). Request with a lower logprob_start_len."
            )
        interval = field(sp, "stream_interval", (int,), None) or self.stream_interval
        pd = self._bootstrap(obj) if self.disagg is not None else None
        opts = {
            "stream": bool(field(obj, "stream", (bool,), False)),
            "return_logprob": return_logprob,
            "logprob_start_len": start_len,
            "top_logprobs_num": field(obj, "top_logprobs_num", (int,), 0),
            "token_ids_logprob": ids_lp,
            "text_in_logprobs": bool(field(obj, "return_text_in_logprobs", (bool,), False)),
            "routed_experts": bool(field(obj, "return_routed_experts", (bool,), False)),
            "routed_experts_start_len": field(obj, "routed_experts_start_len", (int,), 0),
            "stops": stops,
            "no_stop_trim": bool(field(sp, "no_stop_trim", (bool,), False)),
            "skip_special": bool(field(sp, "skip_special_tokens", (bool,), True)),
            "stream_interval": max(1, interval),
            "pd": pd,
        }
        job = Job(
            rid=rid,
            input_ids=input_ids,
            # A prefill server computes the first token only.
            max_new_tokens=1 if self.mode == "prefill" else max_new,
            stop_token_ids=frozenset(stop_ids),
            ignore_eos=bool(field(sp, "ignore_eos", (bool,), False)),
            logit_bias=bias,
            # GenerateReqInput._normalize_single_inputs: "" is None.
            namespace=(field(obj, "extra_key", (str,), None) or None, field(obj, "cache_salt", (str,), None) or None),
            priority=field(obj, "priority", (int,), None),
        )
        # The scheduler refuses these (Scheduler.handle_generate_request, then
        # its grammar manager): an abort with status 400 before any token.
        start = opts["routed_experts_start_len"]
        if opts["routed_experts"] and start < 0:
            job.refused = (400, f"recv_req.routed_experts_start_len={start} is lower than 0. "
                                "Please use a non-negative routed_experts_start_len.")
        elif opts["routed_experts"] and start > len(input_ids):
            job.refused = (400, f"recv_req.routed_experts_start_len={start} is higher than the number of input "
                                f"tokens len(req.origin_input_ids)={len(input_ids)}. Please use a smaller "
                                "routed_experts_start_len.")
        else:
            grammar = sglang_grammar_refusal(sp)
            if grammar is not None:
                job.refused = (400, grammar)
        return job, opts

    def _bootstrap(self, obj: dict) -> tuple[str, int, int]:
        """``(bootstrap_host, bootstrap_port, bootstrap_room)`` of a P/D
        request; a null port is the default one.

        Raises:
            SGLangError: 400, the room is missing or out of range.
        """
        room = obj.get("bootstrap_room")
        if type(room) is not int or not 0 <= room < ROOM_LIMIT:
            raise value_error(
                f"A {self.mode} server needs bootstrap_room, an integer in [0, 2^63), got {room!r}."
            )
        host = field(obj, "bootstrap_host", (str,), "127.0.0.1")
        port = field(obj, "bootstrap_port", (int,), DEFAULT_BOOTSTRAP_PORT)
        return host, port, room

    # -- answer building -------------------------------------------------

    def _triple(self, lp: float | None, tok: int, with_text: bool) -> list:
        return [lp, tok, self.tok.piece(tok) if with_text else None]

    def _position(self, state: int, opts: dict) -> tuple[list | None, list | None]:
        """Top-k and ``token_ids_logprob`` rows for the position after ``state``."""
        model, wt = self.engine.model, opts["text_in_logprobs"]
        k, ids = opts["top_logprobs_num"], opts["token_ids_logprob"]
        tops = [self._triple(lp, t, wt) for t, lp in model.step(state).candidates[:k]] if k > 0 else None
        picked = [self._triple(model.logprob(state, t), t, wt) for t in ids] if ids else None
        return tops, picked

    def _input_logprobs(self, job: Job, opts: dict) -> tuple[list, list | None, list | None]:
        model = self.engine.model
        ids = job.input_ids
        start = opts["logprob_start_len"]
        wt = opts["text_in_logprobs"]
        state = model.fold(ids[:start])
        toks: list = []
        tops: list | None = [] if opts["top_logprobs_num"] > 0 else None
        picked: list | None = [] if opts["token_ids_logprob"] else None
        for p in range(start, len(ids)):
            if p == 0:  # the first prompt token has no logprob
                toks.append(self._triple(None, ids[0], wt))
                row_tops = row_picked = None
            else:
                toks.append(self._triple(model.logprob(state, ids[p]), ids[p], wt))
                row_tops, row_picked = self._position(state, opts)
            if tops is not None:
                tops.append(row_tops)
            if picked is not None:
                picked.append(row_picked)
            state = model.advance(state, ids[p])
        return toks, tops, picked

    def _experts(self, job: Job, out_ids: list[int], start_len: int) -> str | None:
        """Base64 int32 rows of the positions from ``start_len`` on; a
        decode server's prompt rows are zeros (it received their KV), or,
        with ``decode_expert_rows="own"``, absent (``None`` when it has no
        row of its own)."""
        from .model import experts_base64

        seq = job.input_ids + out_ids
        received = len(job.input_ids) if self.mode == "decode" else 0
        if self.mode == "decode" and self.decode_expert_rows == "own":
            start_len = max(start_len, received)
            if len(seq) - 1 <= start_len:
                return None
        return experts_base64(self.engine.model.expert_rows(seq, start_len, received))

    @staticmethod
    def finish_reason(finish: tuple[str, object] | None, aborted: bool, queued: bool = False) -> dict | None:
        """SGLang's ``finish_reason`` object for a finish tuple; ``aborted``
        (over any finish but an abort of its own): an abort (``/abort_request``, ``/pause_generation``
        in ``abort`` mode, a vanished client) of a request that was
        ``queued`` in the waiting queue or running.

        SGLang 0.5.23 ``Scheduler.abort_request``
        (``srt/managers/scheduler.py``) pops a waiting request and sends an
        ``AbortReq`` without a finish reason, which
        ``TokenizerManager._handle_abort_req`` answers as ``{"type":
        "abort", "message": "Abort in waiting queue"}``; a running one gets
        ``to_finish = FINISH_ABORT()`` (``srt/managers/schedule_batch.py``:
        message ``"Aborted"``, status and error type null), sent as its
        ``to_json()``. A pause in ``abort`` mode is that same abort of every
        request (``TokenizerManager.pause_generation``:
        ``abort_request(abort_all=True)``).
        """
        if finish is not None and finish[0] == "abort":
            status, message = finish[1]
            return {
                "type": "abort",
                "message": message,
                "status_code": status,
                "err_type": "BadRequestError" if status == 400 else None,
            }
        if aborted:
            if queued:
                return {"type": "abort", "message": "Abort in waiting queue"}
            return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        if finish is None:
            return None
        kind, value = finish
        if kind == "stop":
            return {"type": "stop", "matched": value}
        return {"type": "length", "length": value}

    # -- HTTP ------------------------------------------------------------

    async def generate(self, body: bytes, receive: Receive, send: Send) -> None:
        """Serve one ``POST|PUT /generate``."""
        obj: dict = {}
        room = None
        try:
            obj = self.load(body)
            if is_batch(obj):
                await serve_batch(self, obj, receive, send)
                return
            job, opts = self.parse(obj)
            if isinstance(self.disagg, PrefillRooms):
                if self.engine.prefill_faults:
                    job.prefill_fault = self.engine.prefill_faults.pop(0)
                    if job.prefill_fault[0] == "before":
                        job.refused = (500, "simulated prefill failure before the KV hand-over (POST /sim/faults)")
                try:
                    room = self.disagg.claim(opts["pd"][2])
                except ValueError as exc:
                    raise value_error(str(exc)) from None
            try:
                self.engine.submit(job)
            except DuplicateRequestId:
                if room is not None:
                    self.disagg.release(opts["pd"][2], room)
                raise
        except (SGLangError, DuplicateRequestId) as exc:
            if isinstance(exc, DuplicateRequestId):
                exc = value_error(f"Duplicate request ID: {exc}")
            await self.refuse(exc, obj.get("stream") is True, send)
            return
        done = [False]
        opts["room"] = room
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, job, done)
                await self.run_job(job, opts, send, done)
                tg.cancel_scope.cancel()
        finally:
            self.engine.finish(job)
            if room is not None:
                self.disagg.release(opts["pd"][2], room)

    @staticmethod
    async def refuse(exc: SGLangError, stream: bool, send: Send) -> None:
        """Answer a request refused before generating, as SGLang does."""
        if exc.body is None:  # an unhandled exception inside SGLang
            if stream:  # its generator raises after the 200: the stream breaks
                await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                raise RuntimeError("simulated unhandled engine exception")
            await send_unary(send, 500, b"Internal Server Error", b"text/plain; charset=utf-8")
        elif "error" in exc.body and stream:
            # SGLang validates inside the streaming generator: the 200 is
            # already out, so value errors travel in-band.
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            data = sse_event(orjson.dumps(exc.body)) + DONE
            await send({"type": "http.response.body", "body": data, "more_body": False})
        else:
            await send_unary(send, exc.status, orjson.dumps(exc.body))

    async def _watch_disconnect(self, receive: Receive, job: Job, done: list[bool]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if done[0]:  # hypercorn also reports the end of a finished exchange
            return
        self.engine.disconnects += 1
        # SGLang aborts a vanished client's request after a short delay.
        await anyio.sleep(self.disconnect_abort_s)
        self.engine.abandon(job)

    async def run_job(self, job: Job, opts: dict, send: Send, done: list[bool]) -> None:
        t0 = time.monotonic()
        stream = opts["stream"]
        rl = opts["return_logprob"]
        k = opts["top_logprobs_num"]
        ids_lp = opts["token_ids_logprob"]
        wt = opts["text_in_logprobs"]
        stops = opts["stops"]
        interval = opts["stream_interval"]
        incremental = self.incremental
        out_ids: list[int] = []
        out_lps: list[list] = []
        out_tops: list[list | None] = []
        out_picked: list[list | None] = []
        if not rl:
            in_lps, in_tops, in_picked = [], None, None
        elif self.mode == "decode":  # the prompt's logits stayed on the prefill server
            in_lps, in_tops, in_picked = [], [] if k > 0 else None, [] if ids_lp else None
        else:
            in_lps, in_tops, in_picked = self._input_logprobs(job, opts)
        sent_ids = sent_lps = 0
        sent_text = ""
        text = ""
        # Running text only when chunks or stop strings need it before the end.
        step_text = self.tok.stream_decoder(opts["skip_special"]) if stream or stops else None
        longest_stop = max((len(s) for s in stops), default=0)
        finish: tuple[str, object] | None = None
        if stream:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

        def chunk(done: bool) -> dict:
            nonlocal sent_ids, sent_lps, sent_text
            meta: dict[str, Any] = {
                "id": job.rid,
                "finish_reason": self.finish_reason(finish, job.aborted, job.aborted_queued) if done else None,
                "prompt_tokens": len(job.input_ids),
                "weight_version": self.engine.model.weight_version,
                "completion_tokens": len(out_ids),
                "cached_tokens": job.cached_tokens,
            }
            if rl:
                first = not incremental or sent_lps == 0
                at = sent_lps if incremental else 0
                meta["input_token_logprobs"] = in_lps if first else []
                meta["output_token_logprobs"] = out_lps[at:]
                if k > 0:
                    meta["input_top_logprobs"] = in_tops if first else []
                    meta["output_top_logprobs"] = out_tops[at:]
                if ids_lp:
                    meta["input_token_ids_logprobs"] = in_picked if first else []
                    meta["output_token_ids_logprobs"] = out_picked[at:]
            # A request aborted in the waiting queue is answered by the tokenizer
            # manager alone (_handle_abort_req): no prompt or cache counts, no rows.
            queued_abort = done and job.aborted and job.aborted_queued and not (finish and finish[0] == "abort")
            if queued_abort:
                del meta["prompt_tokens"], meta["cached_tokens"]
            if done:
                if opts["routed_experts"] and job.refused is None and not queued_abort:
                    rows = self._experts(job, out_ids, opts["routed_experts_start_len"])
                    if rows is not None:
                        meta["routed_experts"] = rows
                meta["e2e_latency"] = round(time.monotonic() - t0, 6)
            if incremental:
                obj = {
                    "text": text[len(sent_text) :],
                    "output_ids": out_ids[sent_ids:],
                    "meta_info": meta,
                }
                sent_ids, sent_lps, sent_text = len(out_ids), len(out_lps), text
            else:
                obj = {"text": text, "output_ids": list(out_ids), "meta_info": meta}
            return obj

        if job.refused is not None:
            finish = ("abort", job.refused)
        elif isinstance(self.disagg, DecodeKV):
            finish = await self._receive_kv(job, opts["pd"])
        tokens = self.engine.tokens(job) if finish is None and not job.aborted else _nothing()
        async for token in tokens:
            out_ids.append(token.token_id)
            finish = token.finish
            if rl:
                out_lps.append(self._triple(token.step.candidates[0][1], token.token_id, wt))
                tops = [self._triple(lp, t, wt) for t, lp in token.step.candidates[:k]] if k > 0 else None
                out_tops.append(tops)
                if ids_lp:
                    out_picked.append([self._triple(self._logprob(token, t), t, wt) for t in ids_lp])
            if step_text is not None:
                piece = step_text(token.token_id)
                if not (finish is not None and finish[0] == "stop" and not opts["no_stop_trim"]):
                    text += piece
                if stops and finish is None:
                    # Only the tail can hold a stop string the last piece completed.
                    tail = max(0, len(text) - len(piece) - longest_stop)
                    for s in stops:
                        at = text.find(s, tail)
                        if at >= 0:
                            finish = ("stop", s)
                            if not opts["no_stop_trim"]:
                                text = text[:at]
                            break
            # SGLang's stream_output: after tokens 1, N+1, 2N+1, ... (every
            # token with N = 1), and always at the finish.
            due = len(out_ids) % interval == (1 if interval > 1 else 0)
            if stream and finish is None and due:
                await send(
                    {"type": "http.response.body", "body": sse_event(orjson.dumps(chunk(False))), "more_body": True}
                )
            if finish is not None:
                break
        if finish is None and job.refused is not None:  # evicted from a full queue while waiting
            finish = ("abort", job.refused)
        if finish is None and not job.aborted:
            finish = ("length", job.max_new_tokens)  # max_new_tokens == 0
        if opts["room"] is not None and not job.aborted and finish[0] != "abort":
            finish = await self._hand_over(job, opts, out_ids)
        if not (finish is not None and finish[0] == "stop" and isinstance(finish[1], str)):
            text = self._text(out_ids, finish, opts)  # exact, once
        done[0] = True
        if finish is not None and finish[0] == "abort" and not stream:
            # _wait_one_response: status 400 is a ValueError, 5xx an HTTPException.
            status, message = finish[1]
            if status == 400:
                await send_unary(send, 400, orjson.dumps({"error": {"message": message}}))
            else:
                await send_unary(send, status, orjson.dumps(
                    {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
                ))
            return
        final = orjson.dumps(chunk(True))
        if stream:
            await send({"type": "http.response.body", "body": sse_event(final) + DONE, "more_body": False})
        else:
            await send_unary(send, 200, final)

    async def _receive_kv(self, job: Job, pd: tuple[str, int, int]) -> tuple[str, object] | None:
        """Decode server: wait for the room's KV; the abort finish when it
        never comes (or is not this prompt's), else ``None`` with
        ``job.prefilled`` and the prefill's ``cached_tokens`` set (SGLang's
        decode reports the prefill's hit, plus its own radix cache's reuse
        beyond it, ``ScheduleBatchDisaggregationDecodeMixin.
        prepare_for_prebuilt``: the simulator's decode caches nothing)."""
        host, port, room = pd
        kv = await self.disagg.fetch(job, host, port, room)
        if kv is None:  # aborted while waiting
            return None
        if isinstance(kv, float):
            return ("abort", (500, transfer_failed(job.rid, room, kv)))
        input_ids, first, cached = kv
        if input_ids != job.input_ids:
            return ("abort", (500, f"KV of bootstrap_room {room} is not this request's prompt"))
        job.prefilled = first
        job.cached_tokens = cached
        return None

    async def _hand_over(self, job: Job, opts: dict, out_ids: list[int]) -> tuple[str, object]:
        """Prefill server: hand the KV over; ``length 0`` once the decode
        took it, the bootstrap abort when none came."""
        room = opts["pd"][2]
        waited = await self.disagg.hand_over(job, opts["room"], job.input_ids, out_ids[0])
        if waited is not None:
            return ("abort", (500, bootstrap_failed(job.rid, room, waited)))
        if job.prefill_fault is not None:  # armed: fails once its decode has the KV
            await anyio.sleep(job.prefill_fault[1])
            return ("abort", (500, "simulated prefill failure after the KV hand-over (POST /sim/faults)"))
        return ("length", 0)

    def _logprob(self, token: Token, token_id: int) -> float:
        """``token_id``'s logprob at the step ``token`` was drawn from (as
        ranked, so a ``logit_bias`` shows)."""
        for t, lp in token.step.candidates:
            if t == token_id:
                return lp
        return self.engine.model.logprob(token.step.state, token_id)

    def _text(self, out_ids: list[int], finish: tuple | None, opts: dict) -> str:
        ids = out_ids
        if finish is not None and finish[0] == "stop" and not opts["no_stop_trim"]:
            ids = out_ids[:-1]
        return self.tok.decode(ids, skip_special=opts["skip_special"])

    async def abort_request(self, body: bytes, send: Send) -> None:
        """Serve ``POST /abort_request``: ``{"rid": ...}`` or ``{"abort_all": true}``."""
        try:
            obj = orjson.loads(body or b"{}")
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            await send_unary(send, 400, orjson.dumps(schema_error("Input should be a valid dictionary").body))
            return
        self.engine.abort(obj.get("rid") if isinstance(obj.get("rid"), str) else None, bool(obj.get("abort_all")))
        await send_unary(send, 200, b"")

    def server_info(self, model_path: str) -> dict:
        """The ``/get_server_info`` body (the fields routers and clients read)."""
        return {
            "model_path": model_path,
            "tokenizer_path": model_path,
            "served_model_name": self.model_name,
            "incremental_streaming_output": self.incremental,
            "skip_tokenizer_init": False,
            "disaggregation_mode": self.mode,
            "disaggregation_bootstrap_port": (
                self.disagg.port if isinstance(self.disagg, PrefillRooms) else DEFAULT_BOOTSTRAP_PORT
            ),
            "enable_return_routed_experts": True,
            "context_length": self.context_length,
            "version": "0.0.0-sim",
            "max_total_num_tokens": self._pool(),
            "stream_interval": self.stream_interval,
        }

    def _pool(self) -> int:
        """The KV pool in tokens: ``--max-total-tokens`` with the capacity
        model, else :data:`MAX_TOTAL_NUM_TOKENS`."""
        cap = self.engine.capacity
        return cap.config.kv_tokens if cap is not None and cap.config.kv_tokens is not None else MAX_TOTAL_NUM_TOKENS

    def model_info(self, model_path: str) -> dict:
        """The ``/get_model_info`` body."""
        return {
            "model_path": model_path,
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.model.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
        }


async def _nothing() -> AsyncIterator[Token]:
    """No tokens: a request the scheduler refuses ends before its first."""
    return
    yield  # pragma: no cover - makes this an async generator
