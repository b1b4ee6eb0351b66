"""The SGLang-native ``POST|PUT /generate`` codec: a request's exchange
with SGLang workers and the client's answer.

Wire format: SGLang ``python/sglang/srt/entrypoints/http_server.py``
(``generate_request``) and ``managers/io_struct.py`` (``GenerateReqInput``).
A request is read and checked, and refused in SGLang's shapes, by
:mod:`asgi_generate_sglang.request`; batches (a list ``text``, a list of
lists ``input_ids``) and ``n`` > 1 are :mod:`asgi_generate_sglang.batch`'s.

Answers are the engine's own objects with ``meta_info.id`` restored to the
client's ``rid``: cumulative SSE chunks, or deltas when the worker runs with
``--incremental-streaming-output``.

Prefill/decode (P/D): both legs get the client's body with the fields of
their pair (``Attempt.pair.fields``: the frontend's ``bootstrap_host``/
``bootstrap_port``/``bootstrap_room``; SGLang's
``disaggregation/mini_lb.py`` sends the same body to both). The client gets
the decode leg's answer joined with what only the prefill leg computed, as
the aggregated engine would have answered, and only by that pair's decode
leg (the prefill's answer is kept in ``Attempt.pair``: a request retried,
replayed or migrated after its decode leg failed never joins a failed
pair's). With ``return_logprob`` the prefill leg's ``input_token_logprobs``,
``input_top_logprobs`` and ``input_token_ids_logprobs`` go before the decode
leg's own (empty) ones, as ``mini_lb`` joins them: in the unary object, in
every cumulative chunk, in the first incremental one. ``cached_tokens`` (and
``cached_tokens_details``) are the prefill leg's in every chunk, the leg
that computed the prompt (SGLang's decode reports the prefill's hit it
received with the KV, plus its own radix cache's reuse beyond it,
``ScheduleBatchDisaggregationDecodeMixin.prepare_for_prebuilt``); the final
event also carries the decode leg's own counts for the record. With
``return_routed_experts`` the final answer's rows are joined by token
position (:mod:`asgi_generate_sglang.experts`): the prompt positions' from
the prefill leg, the output positions' from the decode leg, whatever of the
prompt the decode answered; a count that fits neither leg, bad base64 or a
mismatched ``routed_experts_dtype`` fails the request, never a partial or
padded blob. Rows are never added to an aborted answer.

Migration: a streamed request whose worker died mid-answer continues on
another worker as a ``resumed`` attempt (:meth:`SGLangExchange.worker_request`):
``input_ids`` are the prompt followed by every output id sent so far,
``max_new_tokens`` and ``min_new_tokens`` are reduced by their count (the
latter saturating at 0), and ``logprob_start_len`` is the last input position
(SGLang's own default for ``-1``, ``managers/tokenizer_manager.py``), so the
engine computes no logprobs for the re-fed output. The client's answer goes
on as one: cumulative chunks keep accumulating ``text``, ``output_ids`` and
the output logprob lists across the seam, incremental chunks continue with
deltas; ``prompt_tokens`` stays the original prompt's, ``completion_tokens``
counts all output (and a ``length`` finish names the client's cap), the input
logprob lists are the first attempt's.
The resumed leg keeps the client's ``routed_experts_start_len``: the first
leg's rows never reached the client (SGLang sends them in the final chunk
only), and the resumed prompt holds every position the uninterrupted request
had, so its rows are exactly the uninterrupted rows.

With the frontend's tokenizer (``Codec.tokenizer``, ``--tokenizer``) a
``text`` prompt resumes as its token ids (tokenized as SGLang does, see
:class:`asgi_generate.sdk.PromptTokenizer`), and stop strings are checked
across the seam (:mod:`asgi_generate_sglang.seam`): the engine only looks in
its own output, so a stop string begun before the seam is the frontend's to
find; the answer then ends there as the engine would have ended it, and the
leg is aborted. The ``text`` of a resumed stream is then decoded over the
whole output (exact even when a character's bytes straddle the seam).
Not resumable (:meth:`SGLangExchange.resume_refusal`): embedding or
multimodal prompts, text prompts and stop strings without a tokenizer,
``stop_regex``, stop strings with routed experts (an answer the frontend ends
has no expert rows), constrained decoding (``json_schema``, ``regex``,
``ebnf``, ``structural_tag``: the grammar state is the engine's) and
penalties (they count the output tokens, which a re-issue turns into
prompt). A unary request never resumes: its leg shows no tokens before its
end, so it is replayed from scratch (:mod:`asgi_generate.request.generation`).
"""

from __future__ import annotations

from typing import Mapping

import orjson

from asgi_generate.sdk import (
    Attempt,
    Codec,
    EngineError,
    Event,
    Exchange,
    GenerateRequest,
    PromptTokenizer,
    RequestError,
    Route,
    StopWatch,
    Usage,
    WorkerRequest,
    dump_body,
    dumps_compact,
    engine_error_page,
)
from asgi_generate.sdk.answer import answer_object, int_list

from .join import PREFILL_LOGPROBS, join_experts, join_prefill
from .seam import OUTPUT_LOGPROBS, across_seam
from .answer import check_meta, chunk_meta
from .tail import Layout, layout, read_tail

from .batch import SGLangBatchExchange, decode_batch, is_batch
from .request import (
    CONSTRAINED, PENALTIES, SchemaError, check_frontend_owned, check_prompt_length, decode_one, error_body,
    in_band_error, parse, refuser,
)

class SGLangCodec(Codec):
    """SGLang ``/generate`` over SGLang workers (``POST`` and ``PUT``)."""

    name = "sglang"
    routes = (Route("POST", "/generate"), Route("PUT", "/generate"))
    worker_protocol = "sglang"

    def decode(self, body: bytes, headers: Mapping[bytes, bytes]) -> GenerateRequest:
        """Check an SGLang request (:mod:`asgi_generate_sglang.request`; a
        batch, :mod:`asgi_generate_sglang.batch`).

        Raises:
            RequestError: 400 with SGLang's schema-error shape for bad JSON or
                wrong types (:class:`~asgi_generate_sglang.request.SchemaError`),
                or its ``{"error": {...}}`` shape for bad values, in-band when
                the request streams.
        """
        obj, in_band = parse(body)
        if not is_batch(obj):
            return decode_one(obj, in_band)
        check_frontend_owned(obj, in_band)
        items = decode_batch(obj, refuser(in_band), SchemaError, self.max_items)
        rid = obj.get("rid")
        return GenerateRequest(
            stream=in_band, public_id=rid if type(rid) is str else None, input_ids=None,
            replay_excluded=items[0].replay_excluded, native=obj, items=items,
        )

    def exchange(self, request: GenerateRequest, request_id: str) -> "SGLangExchange | SGLangBatchExchange":
        """Per-request state; the client sees ``rid``, or ``request_id`` if it sent none."""
        if request.items is not None:
            return SGLangBatchExchange(request)
        public = request.public_id
        return SGLangExchange(request, public if public is not None else request_id, self.tokenizer)

    def error_body(self, error: RequestError) -> bytes:
        """SGLang's unary error shapes (:func:`asgi_generate_sglang.request.error_body`)."""
        return error_body(error)

    def in_band_error(self, error: RequestError) -> bytes:
        """SGLang's in-band error shapes (:func:`asgi_generate_sglang.request.in_band_error`)."""
        return in_band_error(error)


class SGLangExchange(Exchange):
    """One SGLang request's state across worker attempts."""

    __slots__ = (
        "request", "public_id", "seen", "_last", "incremental", "payload", "engine_tag", "public_tag",
        "decode_chunks", "base", "tokenizer", "prompt_ids", "watch", "tail",
    )

    def __init__(self, request: GenerateRequest, public_id: str, tokenizer: PromptTokenizer | None = None) -> None:
        self.request = request
        self.tokenizer = tokenizer
        #: A text prompt's token ids, made once, when it first resumes.
        self.prompt_ids: list[int] | None = None
        #: Stop strings over the whole output, once the stream resumed.
        self.watch: StopWatch | None = None
        #: Chunks the running decode leg sent (its first carries the
        #: prefill's prompt logprobs in incremental mode).
        self.decode_chunks = 0
        self.public_id = public_id
        self.seen = 0
        self._last: dict | None = None
        #: The last cumulative chunk's bytes and layout, while the running
        #: attempt's chunks are read from their new tail (:mod:`.tail`).
        self.tail: Layout | None = None
        self.incremental = False
        self.payload = b""
        self.engine_tag = b""
        self.public_tag = dumps_compact(public_id)
        #: A resumed attempt's starting point: the client's view at the
        #: seam (the last chunk sent, and the output count).
        self.base: tuple[dict, int] | None = None

    @property
    def last(self) -> dict | None:
        """The last chunk fed, parsed; once sent to the client, only what a
        resumed attempt continues from (:func:`_resume_base`). A chunk read
        from its tail is parsed whole only when this is read."""
        if self._last is None and self.tail is not None:
            self._last = _resume_base(orjson.loads(self.tail.data), self.incremental)
        return self._last

    @last.setter
    def last(self, chunk: dict | None) -> None:
        self._last = chunk

    def resume_refusal(self) -> str | None:
        """Why this request cannot resume mid-answer (see the module docstring)."""
        obj = self.request.native
        sp = obj.get("sampling_params") or {}
        excluded = self.request.replay_excluded
        if excluded == "text" and self.tokenizer is None:
            return "a text prompt needs --tokenizer to resume"
        if excluded not in (None, "text"):
            return f"a {excluded} prompt has no token ids to resume from"
        if any(sp.get(k) is not None for k in CONSTRAINED):
            return "constrained decoding cannot be resumed exactly"
        if sp.get("stop_regex"):
            return "a stop regex could straddle the seam"
        if sp.get("stop"):
            if self.tokenizer is None:
                return "a stop string could straddle the seam (no --tokenizer to check it)"
            if obj.get("return_routed_experts"):
                return "an answer ended at a stop string across the seam would have no routed experts"
        if any(sp.get(k, d) != d for k, d in PENALTIES):
            return "penalties count the output tokens a resumed attempt re-feeds as prompt"
        return None

    def worker_request(self, attempt: Attempt) -> WorkerRequest:
        """The client's body with ``rid`` minted (and a P/D leg's pair
        fields, or a resumed attempt's prompt and budget, see the module
        docstring). A unary client gets a unary engine leg: the engine's one
        answer, passed through.

        Raises:
            RequestError: the token prompt does not fit the worker's context
                length: SGLang's own 400, before any engine sees it.
        """
        info = attempt.worker_info
        if not info.get("allow_auto_truncate"):
            check_prompt_length(self.request.input_ids, info.get("max_model_len"), self.request.stream)
        body = dict(self.request.native)
        if self.request.input_ids_packed is not None:  # already serialized by decode's check
            body["input_ids"] = orjson.Fragment(self.request.input_ids_packed.json)
        body["rid"] = attempt.engine_id
        if attempt.resumes:
            self._resume(body, attempt.resumes)
        if attempt.pair is not None:
            body.update(attempt.pair.fields)
        for name, value in attempt.fields.items():  # the engine's priority (GenerateReqInput.priority)
            body.setdefault(name, value)
        stream = self.request.stream
        if attempt.role != "prefill":  # a prefill's answer never reaches the client
            if self.tail is not None:  # the client's view so far, parsed before its bytes go
                self.last = self.last
                self.tail = None
            self.incremental = stream and bool(attempt.worker_info.get("incremental_streaming_output"))
            self.engine_tag = dumps_compact(attempt.engine_id)
            self.decode_chunks = 0
            if not attempt.resumes:  # the answer starts over (a failover, a unary replay)
                self.seen = 0
        wreq = WorkerRequest(b"/generate", dump_body(body), stream=stream)
        self._keep_packed_prompt()
        return wreq

    def _keep_packed_prompt(self) -> None:
        """Once a worker request was built (the request is decoded, checked
        and routed), keep a token prompt in its packed form only: its ids as
        ``array('I')`` in ``request.input_ids`` and its JSON text in the
        native body, rather than a list of Python ints (about 36 bytes per
        id against 4 + the text's, for as long as the request streams);
        later attempts and resumes read those."""
        request = self.request
        packed = request.input_ids_packed
        if packed is not None and type(request.input_ids) is list:
            request.input_ids = packed.u32
            request.native["input_ids"] = orjson.Fragment(packed.json)

    def _resume(self, body: dict, resumes: list[int]) -> None:
        k = len(resumes)
        prompt = self.request.input_ids
        if prompt is None:  # a text prompt (resume_refusal: only with a tokenizer)
            if self.prompt_ids is None:
                self.prompt_ids = self.tokenizer.encode(body["text"])
            prompt = self.prompt_ids
            del body["text"]
        body["input_ids"] = [*prompt, *resumes]  # the prompt may be packed (array('I'))
        sp = body["sampling_params"] = dict(body.get("sampling_params") or {})
        if self.tokenizer is not None:  # the text (and stop strings) across the seam
            stop = sp.get("stop") or ()
            self.watch = self.tokenizer.stop_watch(
                tuple([stop] if type(stop) is str else stop), resumes,
                sp.get("skip_special_tokens", True) is not False, sp.get("no_stop_trim") is not True,
            )
        max_new = sp.get("max_new_tokens", 128)
        if max_new is not None:
            sp["max_new_tokens"] = max(0, max_new - k)
        if type(sp.get("min_new_tokens")) is int:
            sp["min_new_tokens"] = max(0, sp["min_new_tokens"] - k)
        if body.get("return_logprob"):
            body["logprob_start_len"] = len(body["input_ids"]) - 1
        self.base = (self.last, self.seen)

    def _stitch(self, chunk: dict, meta: dict, ids: list) -> list:
        """Make a resumed attempt's chunk continue the client's answer;
        returns its output ids as the client sees them."""
        last, count = self.base
        base = last["meta_info"]
        for key in ("prompt_tokens", "cached_tokens"):
            if key in base:
                meta[key] = base[key]
        own = meta.get("completion_tokens")
        if type(own) is int:
            meta["completion_tokens"] = count + own
        finish = meta.get("finish_reason")
        if type(finish) is dict and finish.get("type") == "length" and type(finish.get("length")) is int:
            finish["length"] += count  # the cap the client asked for
        for key in PREFILL_LOGPROBS:
            if key in meta:
                meta[key] = [] if self.incremental else base.get(key)
        self.payload = b""  # re-serialised: not the engine's bytes any more
        if self.incremental:
            return ids
        for key in OUTPUT_LOGPROBS:
            if type(meta.get(key)) is list and type(base.get(key)) is list:
                meta[key] = base[key] + meta[key]
        text = chunk.get("text")
        if type(text) is str and type(last.get("text")) is str:
            chunk["text"] = last["text"] + text
        ids = chunk["output_ids"] = last["output_ids"] + ids
        return ids

    def feed(self, attempt: Attempt, payload: bytes) -> Event:
        """One SGLang chunk (or the unary answer): the new output ids, the
        finish type and matched stop, usage (the decode leg's own, beside
        the joined figures, on a P/D pair's or a resumed leg's last chunk).

        A running aggregated stream's cumulative chunk that extends the
        last one is read from its new tail only (:func:`.tail.read_tail`).

        Raises:
            WorkerAnswerError: the chunk is not an SGLang answer
                (:mod:`.answer`).
            RequestError: 502, a P/D pair's expert rows cannot be joined
                (:mod:`.experts`).
        """
        tail = self.tail
        if tail is not None and self.seen == tail.count and attempt.pair is None and not attempt.resumes:
            read = read_tail(payload, tail)
            if read is not None:
                new, meta = read
                int_list(new, "output_ids", self.seen)  # the new ids read_tail read
                check_meta(meta, "meta_info", self.seen, inputs=False)
                self.payload = payload
                self._last = None  # the chunk is parsed whole only if asked for (:attr:`last`)
                self.decode_chunks += 1
                self.seen += len(new)
                return _event(new, meta)
        chunk = answer_object(payload, "the chunk" if self.request.stream else "the body")
        prefill = attempt.role == "prefill"
        # A cumulative chunk repeats the leg's last one: its output logprobs
        # are checked from where that one's ended, its prompt's once.
        cumulative = not (prefill or self.incremental)
        start = self.seen - (self.base[1] if attempt.resumes else 0) if cumulative else 0
        meta = chunk_meta(chunk, "", start, inputs=not cumulative or self.decode_chunks == 0)
        if prefill:
            return self._prefill_event(attempt, chunk, meta)
        self.payload = payload
        if meta is None:
            self.last, self.tail = chunk, None
            return _error_event(chunk)
        meta["id"] = self.public_id
        finish = meta.get("finish_reason")
        is_dict = type(finish) is dict
        own = None
        pair = attempt.pair
        if pair is not None or attempt.resumes:  # the client's counts may not be the leg's
            if is_dict:
                own = Usage(meta.get("prompt_tokens"), meta.get("completion_tokens"), meta.get("cached_tokens"))
            # Only this pair's decode leg joins what the pair's prefill computed.
            pre = pair.from_prefill if pair is not None and attempt.role == "decode" else None
            if pre is not None:
                self._join_prefill(pre, meta)
                if is_dict:
                    self._join_experts(pre, meta)
        self.decode_chunks += 1
        ids = chunk.get("output_ids") or []
        if attempt.resumes:
            ids = self._stitch(chunk, meta, ids)
        new = ids if self.incremental else ids[self.seen :]
        cut = False
        if self.watch is not None and attempt.resumes:
            keep = across_seam(self.watch, chunk, meta, new, self.seen, self.incremental)
            if keep is not None:
                new, cut = new[:keep], True  # the finish it set in meta
        self.seen += len(new)
        self.last = chunk
        # Its successors are read from their tails when the client gets the
        # engine's chunks as they are.
        self.tail = layout(payload, chunk) if self.request.stream and pair is None and not attempt.resumes \
            and not self.incremental else None
        event = _event(new, meta, cut)
        if own is not None:
            event.leg_usage = own
        return event

    def _prefill_event(self, attempt: Attempt, chunk: dict, meta: dict | None) -> Event:
        """The prefill leg's answer (or one of its chunks, checked; ``meta``
        ``None`` for an error object): keep its meta in its pair for that
        pair's decode leg; its token is the decode leg's to send. The event
        carries the leg's usage."""
        if meta is None:
            return _error_event(chunk)
        finish = meta.get("finish_reason")
        kind = finish.get("type") if type(finish) is dict else None
        if kind == "abort":
            status = finish.get("status_code")
            return Event([], error=EngineError(
                status if type(status) is int and 400 <= status <= 599 else 500, finish.get("message") or ""
            ))
        if kind is not None and attempt.pair is not None:
            attempt.pair.from_prefill = meta
        return Event([], kind, prompt_tokens=meta.get("prompt_tokens"),
                     completion_tokens=meta.get("completion_tokens"), cached_tokens=meta.get("cached_tokens"))

    def _join_prefill(self, pre: dict, meta: dict) -> None:
        """Join the prefill leg's prompt logprobs and prefix-cache report
        (:func:`.join.join_prefill`)."""
        if join_prefill(pre, meta, self.decode_chunks == 0 or not self.incremental):
            self.payload = b""  # re-serialised: not the engine's bytes any more

    def _join_experts(self, pre: dict, meta: dict) -> None:
        """Final decode answer: the expert rows by token position
        (:func:`.join.join_experts`).

        Raises:
            RequestError: 502, rows that cannot be joined.
        """
        if join_experts(pre, meta, self.request.native.get("routed_experts_start_len")):
            self.payload = b""

    def client_event(self, event: Event) -> bytes | None:
        """The worker's chunk, ``meta_info.id`` restored; for an
        :attr:`~asgi_generate.sdk.Event.held` event (the engine's abort of a
        stream that goes on after a pause, with the tokens it carried: a
        ``--stream-interval`` above 1 sends them only then) as a running
        chunk, as SGLang sends one (``tokenizer_manager.py``: no
        ``finish_reason``, and none of ``e2e_latency`` or ``routed_experts``,
        which only a finished request's ``meta_info`` has)."""
        data = self._restored()
        if event.held:
            data = _running(data)
        # Sent: held while the stream waits for its next chunk is only what
        # a resumed attempt continues from: the chunk's bytes, when the next
        # is read from its tail, parsed when a resume asks (:attr:`last`).
        self.payload = b""
        self._last = None if self.tail is not None else _resume_base(self._last, self.incremental)
        return data

    def _restored(self) -> bytes:
        # The minted engine id is a unique 32-hex string, so swapping it in
        # the worker's own bytes restores the client's id without
        # re-serialising: the client gets the engine's bytes. As a JSON
        # string it can only be a value, never inside the text: a chunk
        # with a layout is searched from its meta_info on.
        payload, tag, tail = self.payload, self.engine_tag, self.tail
        at = payload.find(tag, tail.meta if tail is not None and tail.data is payload else 0)
        if at >= 0:
            return b"".join((payload[:at], self.public_tag, payload[at + len(tag) :]))
        chunk = self._last
        if chunk is None:  # read from its tail: parsed whole only now
            chunk = orjson.loads(payload)
            chunk["meta_info"]["id"] = self.public_id
        return orjson.dumps(chunk)

    def unary_body(self) -> tuple[int, bytes]:
        """The engine's one answer, ``meta_info.id`` restored. (An engine
        error or an abort with an error status never arrives here: SGLang
        answers a unary request's with its own HTTP error, see
        :meth:`worker_error`.)"""
        if self.last is None:
            raise RequestError(502, "worker ended the response without output", "engine")
        if "meta_info" not in self.last:  # an error object (checked, :func:`.answer.check_error`)
            err = self.last["error"]
            return err.get("code", 400), orjson.dumps({"error": err})
        return 200, self._restored()

    def worker_error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """SGLang workers answer in this format's shapes: pass through; a
        body that is not JSON (a bare server error page) gets SGLang's shape."""
        return engine_error_page(status, body, SGLangCodec().error_body)


#: What :meth:`SGLangExchange._stitch` reads of the last chunk sent, besides
#: (cumulative chunks only) its ``text``, ``output_ids`` and the logprob lists.
_BASE_META = ("prompt_tokens", "cached_tokens")


def _running(data: bytes) -> bytes:
    """A finishing chunk's bytes as a running chunk's (:meth:`SGLangExchange.client_event`)."""
    chunk = orjson.loads(data)
    meta = chunk["meta_info"]
    meta["finish_reason"] = None
    meta.pop("e2e_latency", None)
    meta.pop("routed_experts", None)
    return orjson.dumps(chunk)


def _resume_base(chunk: dict, incremental: bool) -> dict:
    """``chunk`` (the last one the client was sent) cut to what a resumed
    attempt continues from (:meth:`SGLangExchange._stitch`): incremental
    chunks need only its prompt and cached token counts; cumulative ones
    also its text, output ids and logprob lists (the answer so far). An
    error chunk (no ``meta_info``) ends the stream and is kept as it is."""
    meta = chunk.get("meta_info")
    if type(meta) is not dict:
        return chunk
    if incremental:
        return {"meta_info": {k: meta[k] for k in _BASE_META if k in meta}}
    base = {k: chunk[k] for k in ("text", "output_ids") if k in chunk}
    base["meta_info"] = {k: meta[k] for k in (*_BASE_META, *PREFILL_LOGPROBS, *OUTPUT_LOGPROBS) if k in meta}
    return base


def _event(new: list, meta: dict, cut: bool = False) -> Event:
    """The event of a chunk whose new output ids are ``new``, with the
    weight version the engine reported for them (``meta_info.weight_version``,
    ``tokenizer_manager.py``: the version when the chunk was made)."""
    finish = meta.get("finish_reason")
    is_dict = type(finish) is dict
    version = meta.get("weight_version")
    return Event(
        new,
        finish.get("type") if is_dict else None,
        matched=finish.get("matched") if is_dict else None,
        prompt_tokens=meta.get("prompt_tokens"),
        completion_tokens=meta.get("completion_tokens"),
        cached_tokens=meta.get("cached_tokens"),
        cut=cut,
        weight_version=version if type(version) is str else None,
    )


def _error_event(chunk: dict) -> Event:
    """An SGLang ``{"error": ...}`` object (checked,
    :func:`.answer.check_error`) as an engine error event."""
    err = chunk["error"]
    return Event([], error=EngineError(err.get("code", 400), err["message"]))
