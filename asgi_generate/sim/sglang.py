"""SGLang's native ``/generate`` protocol, as the simulator speaks it.

Follows reference/engine-protocols.md section 1 (SGLang ``http_server.py``,
``io_struct.py``, ``tokenizer_manager.py``): the unary object, cumulative SSE
chunks (or deltas with ``--incremental-streaming-output``) ending
``data: [DONE]``, ``meta_info`` with ``finish_reason`` objects, logprob
triples ``[logprob, token_id, text|null]``, routed experts as base64 int32,
and SGLang's error shapes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
import orjson

from ..framing import SSE_HEADERS, Receive, Send, send_unary, sse_event
from .engine import DuplicateRequestId, Job, SimEngine
from .tokenizer import SimTokenizer

DONE = b"data: [DONE]\n\n"
DEFAULT_MAX_NEW_TOKENS = 128
CONTEXT_LENGTH = 32768


class SGLangError(Exception):
    """An error SGLang answers before generating: ``status`` and JSON body."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body)
        self.status = status
        self.body = body


def schema_error(message: str) -> SGLangError:
    """A request that does not match SGLang's schema (400, FastAPI shape)."""
    return SGLangError(
        400,
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
    )


def value_error(message: str) -> SGLangError:
    """A ValueError raised while normalising the request (400)."""
    return SGLangError(400, {"error": {"message": message}})


def _field(obj: dict, key: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise schema_error(f"{key}: expected {names}, got {type(value).__name__}")
    return value


class SGLangProtocol:
    """Answers SGLang ``/generate`` and ``/abort_request`` for a sim engine.

    Args:
        engine: the shared simulator engine.
        tokenizer: the bundled tokenizer, for ``text`` in and out.
        incremental: stream deltas instead of cumulative chunks.
        model_name: reported in server and model info.
    """

    def __init__(
        self,
        engine: SimEngine,
        tokenizer: SimTokenizer,
        incremental: bool = False,
        model_name: str = "sim",
        disconnect_abort_s: float = 2.0,
    ) -> None:
        self.engine = engine
        self.tok = tokenizer
        self.incremental = incremental
        self.model_name = model_name
        self.disconnect_abort_s = disconnect_abort_s

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
        the answer.

        Raises:
            SGLangError: SGLang's status and body for the bad input.
        """
        text = obj.get("text")
        input_ids = obj.get("input_ids")
        if (text is None) == (input_ids is None):
            raise value_error("Either text or input_ids should be provided.")
        if isinstance(text, list) or (
            isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)
        ):
            raise value_error("The simulator does not serve batch requests.")
        if text is not None:
            if not isinstance(text, str):
                raise schema_error("text: expected str")
            input_ids = self.tok.encode(text)
        elif not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            raise schema_error("input_ids: expected a list of integers")
        if not input_ids:
            raise value_error("The input_ids must not be empty.")
        if any(t < 0 or t >= self.tok.vocab_size for t in input_ids):
            raise value_error(f"Token id out of range [0, {self.tok.vocab_size}).")
        sp = _field(obj, "sampling_params", (dict,), {})
        if isinstance(obj.get("sampling_params"), list):
            raise value_error("The simulator does not serve batch requests.")
        max_new = _field(sp, "max_new_tokens", (int,), None)
        if "max_new_tokens" not in sp:
            max_new = DEFAULT_MAX_NEW_TOKENS
        if max_new is None:
            max_new = CONTEXT_LENGTH - len(input_ids)
        if max_new < 0:
            raise value_error("max_new_tokens must be at least 0.")
        if len(input_ids) + max_new > CONTEXT_LENGTH:
            raise value_error(
                f"Requested token count exceeds the model's maximum context length "
                f"of {CONTEXT_LENGTH} tokens. You requested a total of "
                f"{len(input_ids) + max_new} tokens: {len(input_ids)} tokens from the "
                f"input messages and {max_new} tokens for the completion."
            )
        if _field(sp, "n", (int,), 1) != 1:
            raise value_error("The simulator does not serve n > 1.")
        stop = _field(sp, "stop", (str, list), [])
        stops = tuple([stop] if isinstance(stop, str) else stop)
        stop_ids = _field(sp, "stop_token_ids", (list,), [])
        rid = _field(obj, "rid", (str,), None) or uuid.uuid4().hex
        start_len = _field(obj, "logprob_start_len", (int,), -1)
        if start_len < -1:
            raise value_error(f"logprob_start_len ({start_len}) must be -1 or at least 0.")
        return_logprob = bool(_field(obj, "return_logprob", (bool,), False))
        if not return_logprob or start_len == -1:
            start_len = len(input_ids) - 1
        if start_len >= len(input_ids):
            raise value_error(
                f"logprob_start_len ({start_len}) is higher than the number of input "
                f"tokens ({len(input_ids)}). Request with a lower logprob_start_len."
            )
        opts = {
            "stream": bool(_field(obj, "stream", (bool,), False)),
            "return_logprob": return_logprob,
            "logprob_start_len": start_len,
            "top_logprobs_num": _field(obj, "top_logprobs_num", (int,), 0),
            "text_in_logprobs": bool(_field(obj, "return_text_in_logprobs", (bool,), False)),
            "routed_experts": bool(_field(obj, "return_routed_experts", (bool,), False)),
            "routed_experts_start_len": _field(obj, "routed_experts_start_len", (int,), 0),
            "stops": stops,
            "no_stop_trim": bool(_field(sp, "no_stop_trim", (bool,), False)),
            "skip_special": bool(_field(sp, "skip_special_tokens", (bool,), True)),
        }
        job = Job(
            rid=rid,
            input_ids=input_ids,
            max_new_tokens=max_new,
            stop_token_ids=frozenset(stop_ids),
            ignore_eos=bool(_field(sp, "ignore_eos", (bool,), False)),
        )
        return job, opts

    # -- answer building -------------------------------------------------

    def _triple(self, lp: float | None, tok: int, with_text: bool) -> list:
        return [lp, tok, self.tok.piece(tok) if with_text else None]

    def _input_logprobs(self, job: Job, opts: dict) -> tuple[list, list | None]:
        model = self.engine.model
        ids = job.input_ids
        start = opts["logprob_start_len"]
        k = opts["top_logprobs_num"]
        wt = opts["text_in_logprobs"]
        state = model.fold(ids[:start])
        toks, tops = [], [] if k > 0 else None
        for p in range(start, len(ids)):
            if p == 0:
                toks.append(self._triple(None, ids[0], wt))
                if tops is not None:
                    tops.append(None)
            else:
                toks.append(self._triple(model.logprob(state, ids[p]), ids[p], wt))
                if tops is not None:
                    cands = model.step(state).candidates[:k]
                    tops.append([self._triple(lp, t, wt) for t, lp in cands])
            state = model.advance(state, ids[p])
        return toks, tops

    def _experts(self, job: Job, out_ids: list[int], start_len: int) -> str:
        from .model import experts_base64

        model = self.engine.model
        seq = job.input_ids + out_ids
        state = model.initial_state()
        rows = []
        for p in range(len(seq) - 1):
            state = model.advance(state, seq[p])
            if p >= start_len:
                rows.append(model.expert_row(state))
        return experts_base64(rows)

    @staticmethod
    def finish_reason(finish: tuple[str, object] | None, aborted: bool) -> dict | None:
        """SGLang's ``finish_reason`` object for a finish tuple."""
        if aborted:
            return {
                "type": "abort",
                "message": "Abort before prefill" if finish is None else "Abort in waiting queue",
                "status_code": 200,
                "err_type": None,
            }
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
        try:
            obj = self.load(body)
            job, opts = self.parse(obj)
            self.engine.submit(job)
        except (SGLangError, DuplicateRequestId) as exc:
            if isinstance(exc, DuplicateRequestId):
                exc = value_error(f"Duplicate request ID: {exc}")
            if "error" in exc.body and obj.get("stream") is True:
                # SGLang validates inside the streaming generator: the 200 is
                # already out, so value errors travel in-band.
                await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                data = sse_event(orjson.dumps(exc.body)) + DONE
                await send({"type": "http.response.body", "body": data, "more_body": False})
            else:
                await send_unary(send, exc.status, orjson.dumps(exc.body))
            return
        done = [False]
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, job, done)
                await self._run(job, opts, send, done)
                tg.cancel_scope.cancel()
        finally:
            self.engine.finish(job)

    async def _watch_disconnect(self, receive: Receive, job: Job, done: list[bool]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if done[0]:  # hypercorn also reports the end of a finished exchange
            return
        self.engine.disconnects += 1
        # SGLang aborts a vanished client's request after a short delay.
        await anyio.sleep(self.disconnect_abort_s)
        job.aborted = True
        job.abort_event.set()

    async def _run(self, job: Job, opts: dict, send: Send, done: list[bool]) -> None:
        t0 = time.monotonic()
        stream = opts["stream"]
        rl = opts["return_logprob"]
        k = opts["top_logprobs_num"]
        wt = opts["text_in_logprobs"]
        stops = opts["stops"]
        incremental = self.incremental
        out_ids: list[int] = []
        out_lps: list[list] = []
        out_tops: list[list] = []
        in_lps, in_tops = self._input_logprobs(job, opts) if rl else ([], None)
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
                "finish_reason": self.finish_reason(finish, job.aborted) if done else None,
                "prompt_tokens": len(job.input_ids),
                "weight_version": "default",
                "completion_tokens": len(out_ids),
                "cached_tokens": 0,
            }
            if rl:
                first = not incremental or sent_lps == 0
                meta["input_token_logprobs"] = in_lps if first else []
                meta["output_token_logprobs"] = out_lps[sent_lps if incremental else 0 :]
                if k > 0:
                    meta["input_top_logprobs"] = in_tops if first else []
                    meta["output_top_logprobs"] = out_tops[sent_lps if incremental else 0 :]
            if done:
                if opts["routed_experts"]:
                    meta["routed_experts"] = self._experts(
                        job, out_ids, opts["routed_experts_start_len"]
                    )
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

        async for token in self.engine.tokens(job):
            out_ids.append(token.token_id)
            finish = token.finish
            if rl:
                out_lps.append(self._triple(token.step.candidates[0][1], token.token_id, wt))
                if k > 0:
                    out_tops.append(
                        [self._triple(lp, t, wt) for t, lp in token.step.candidates[:k]]
                    )
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
            if stream and (finish is None):
                await send(
                    {"type": "http.response.body", "body": sse_event(orjson.dumps(chunk(False))), "more_body": True}
                )
            if finish is not None:
                break
        if finish is None and not job.aborted:
            finish = ("length", job.max_new_tokens)  # max_new_tokens == 0
        if not (finish is not None and finish[0] == "stop" and isinstance(finish[1], str)):
            text = self._text(out_ids, finish, opts)  # exact, once
        final = orjson.dumps(chunk(True))
        done[0] = True
        if stream:
            await send({"type": "http.response.body", "body": sse_event(final) + DONE, "more_body": False})
        else:
            await send_unary(send, 200, final)

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
            "disaggregation_mode": "null",
            "enable_return_routed_experts": True,
            "context_length": CONTEXT_LENGTH,
            "version": "0.0.0-sim",
        }

    def model_info(self, model_path: str) -> dict:
        """The ``/get_model_info`` body."""
        return {
            "model_path": model_path,
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
        }
