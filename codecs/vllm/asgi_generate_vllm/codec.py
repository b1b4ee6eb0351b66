"""The vLLM-native ``POST /inference/v1/generate`` codec: tokens in, tokens out.

Wire format: vLLM ``vllm/entrypoints/serve/disagg/`` (``protocol.py``,
``serving.py``, ``api_router.py``; later ``vllm/entrypoints/scale_out/
token_in_token_out/``). Requests are checked only where the frontend relies on
them, as vLLM checks them (:mod:`asgi_generate_vllm.request`); a refusal
lists every error vLLM would (:mod:`asgi_generate_vllm.validation`). Every
field passes to the engine as the client sent it (lax values converted),
except, on streaming legs, ``stream_options``, so values only the engine
judges get the answer of the vLLM version behind the worker; when that
engine refuses the body, its refusal reaches the client with the echo of
the client's own body (:func:`asgi_generate_vllm.request.restore_echo`).
``kv_transfer_params`` is the frontend's to set (P/D): a client's non-null
value is refused with 400 on every mode, since it could name another
request's KV blocks.

Versions. What differs between vLLM versions
(:mod:`asgi_generate.sdk._versions`) is read from the attempt's worker
info (the version the worker reported at registration), never guessed:
``stop_reason`` becomes the event's ``matched`` only from a worker whose
version sends it. Logprob entries (``"token_id:N"`` labels, or integer
``token_id`` and ``rank``) pass through as the worker wrote them, so each
answer has the schema of the version that produced it. A request runs on any
healthy vLLM worker; a retry happens only before anything reached the client,
so an answer never mixes two versions. A fleet of mixed versions therefore
gives each request the answer of the version that served it.

Choices. ``sampling_params.n > 1`` passes to the engine (every vLLM version
serving this route accepts it, up to its ``max_num_seqs``): a unary answer
passes through whole and counts the tokens of all its choices; a stream
passes each chunk (one choice each) through, counts every choice's tokens,
and finishes when the usage chunk arrives, or, without one, when every
choice has finished.

Engine ids. The worker gets the attempt's minted id as the ``X-Request-Id``
header, which vLLM takes over the body's ``request_id`` (left as the client
sent it), so the engine runs it as ``generate-tokens-<minted id>`` (what
``POST /abort_requests`` names). The client sees
``generate-tokens-<its id>`` (its ``X-Request-Id`` header, else its body
``request_id``, else the frontend's request id standing in for vLLM's
random uuid) in stream chunks and, from vLLM 0.25 (which answers with the
engine id there too), in unary answers; before 0.25 a unary answer carries
a fresh random uuid, passed through.

Prefill/decode (P/D, sequential legs as vLLM's P/D proxies run them): the
prefill leg is one token that always reaches its length cap (EOS ignored,
no stop criterion), so every KV connector hands it off; the decode leg keeps
the client's criteria. The prefill leg's answer never reaches the client;
the decode leg's does, joined with what only the prefill leg computed (kept
in its pair: only that pair's decode leg, having received the KV, joins it).
``prompt_logprobs`` come from the leg that computed the prompt: the prefill
leg's where the decode leg answers none; where both answer them they must
be equal, else the request fails (502), never picking one.
``usage.prompt_tokens_details`` is the prefill leg's (a consumer before
vLLM 0.32 counts the whole prompt it loaded as cached); the final event
also carries the decode leg's own counts for the record. Each choice's
``routed_experts`` (base64 ``.npy``, :mod:`asgi_generate_vllm.experts`) are
the prefill leg's rows (the prompt positions) followed by the decode leg's
output positions' on the token axis in the final answer or chunk, so the
client gets the aggregated bytes; for exactly one output token the prefill
leg's rows are the answer's (the decode leg ran no model step); an aborted
answer gets none, and bad rows, or a count that fits neither leg, fail the
request, never a partial blob.

Unary requests (``stream`` false or absent) run a unary worker leg
(``WorkerRequest.stream`` false): the client's body with only the id
replaced. vLLM's ``GenerateResponse`` is the client's answer, only its engine
id shown as the client's, so what vLLM puts only in unary answers arrives as
vLLM sent it
(``prompt_logprobs``, a prefill leg's ``kv_transfer_params``,
``routed_experts``, ``model``, ``created``); the codec reads it once for the
handler's event (all token ids, finish reason, usage).

Streaming requests ask the worker for usage. vLLM ends a stream with the
usage chunk *after* the chunk that carries ``finish_reason`` (before 0.32 it
drops a finish-only chunk, so an aborted stream may carry no finish reason),
so the request ends at the usage chunk: a
``finish_reason`` is held until then, and the usage chunk reaches the client
only if it asked. A build that sends no usage chunk ends the stream after the
finishing chunk; :meth:`VLLMExchange.end_of_stream` then finishes with the
held reason.

Aborts. The chunk that finishes a one-choice stream with ``abort`` (0.32's
finish-only chunk, or the aborted output with the tokens not sent yet) is
withheld whole until the stream's end event (the usage chunk, or
:meth:`VLLMExchange.end_of_stream`), which carries its tokens: only then
does the handler know whether the abort ends the answer or is a fleet
pause's, the stream held and resumed. :meth:`VLLMExchange.client_event`
renders what the event says: the abort as vLLM sent it, then the usage
chunk if asked; or, held, the chunk as a running one (its tokens, no
finish) or nothing, so the client's answer shows no abort
(``DESIGN.md`` invariant 4). ``n`` > 1 never resumes: its chunks pass at once.

Migration: a stream whose worker died mid-answer continues on another worker
as a ``resumed`` attempt: ``token_ids`` are the prompt followed by every
output token sent so far, ``max_tokens`` and ``min_tokens`` are reduced by
their count (the latter saturating at 0), and ``prompt_logprobs`` is dropped
(a stream never carries them). Its chunks continue the choice's
``token_ids`` and logprobs; every ``usage`` is rewritten as the
uninterrupted request's (``prompt_tokens`` the original prompt,
``completion_tokens`` all output; ``total_tokens`` is unchanged;
``prompt_tokens_details`` the first leg's when a continuous-usage chunk
showed it, else its ``cached_tokens`` capped at the original prompt: what
a resumed engine found cached past it is re-fed output). A P/D pair resumes
the same way, both legs carrying the longer prompt. Not resumable
(:meth:`VLLMExchange.resume_refusal`): ``n`` > 1, multimodal prompts,
structured outputs (``structured_outputs``, older ``guided_decoding``: the
grammar state is the engine's) and penalties (vLLM's count output tokens,
``sampling_params.py``). Stop strings need no rule: a tokens-only server
refuses them. A unary request never resumes (its leg shows no tokens before
its end): it is replayed from scratch, so ``prompt_logprobs`` and ``usage``
are the replayed leg's own, the uninterrupted values.
"""

from __future__ import annotations

from typing import Any, Mapping

import orjson

from asgi_generate.sdk import (
    NO_KV_TRANSFER,
    Attempt,
    Codec,
    EngineError,
    Event,
    Exchange,
    GenerateRequest,
    RequestError,
    Route,
    Usage,
    WorkerAnswerError,
    WorkerRequest,
    dump_body,
    engine_error_page,
    vllm_behaviour,
)
from asgi_generate.sdk.answer import MISSING, answer_object, wrong

from .answer import check_error, check_top
from .join import PREFILL_DROPS, PREFILL_KV, Prefilled, join_details, join_experts, join_unary
from .request import (
    CONSTRAINED, PENALTIES, VLLMRequest, check_prompt_length, decode_request, error_body, restore_echo,
)

PATH = "/inference/v1/generate"
#: What vLLM puts before a request id to make the engine id.
ENGINE_PREFIX = "generate-tokens-"
_JSON = (b"content-type", b"application/json")


class VLLMCodec(Codec):
    """vLLM ``POST /inference/v1/generate`` over vLLM workers."""

    name = "vllm"
    routes = (Route("POST", PATH),)
    worker_protocol = "vllm"

    def decode(self, body: bytes, headers: Mapping[bytes, bytes]) -> GenerateRequest:
        """A vLLM request, checked (:func:`asgi_generate_vllm.request.decode_request`).

        Raises:
            RequestError: 400 in vLLM's validation shape; 400 in its
                ``BadRequestError`` shape for ``n`` past :attr:`max_items`.
        """
        return decode_request(body, headers, self.max_items)

    def exchange(self, request: GenerateRequest, request_id: str) -> "VLLMExchange":
        """Per-request state; ``request_id`` stands in for vLLM's random uuid
        in stream chunks when the client named no id."""
        return VLLMExchange(request, request_id)

    def error_body(self, error: RequestError) -> bytes:
        """vLLM's error object (:func:`asgi_generate_vllm.request.error_body`)."""
        return error_body(error)

    def in_band_error(self, error: RequestError) -> bytes:
        """The same object as an SSE payload, as vLLM streams errors."""
        return self.error_body(error)


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _reported(usage: Any) -> Usage | None:
    """vLLM's ``usage`` object as the leg's reported :class:`Usage`."""
    if type(usage) is not dict:
        return None
    details = usage.get("prompt_tokens_details")
    return Usage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")),
                 _int(details.get("cached_tokens")) if type(details) is dict else None)


def _spans(choice: dict) -> list[tuple[str, int, int]] | None:
    """A finished choice's ``weight_versions`` (vLLM 0.33
    ``GenerateStreamChoiceBase``/``GenerateChoiceBase``: ``[{"version",
    "start", "end"}]`` over the choice's output token indices, from
    ``v1/engine/output_processor.py`` ``_weight_version_spans``) as
    ``(version, start, end)``; ``None`` when absent or null.

    Raises:
        WorkerAnswerError: not a list of such spans.
    """
    spans = choice.get("weight_versions")
    if spans is None:
        return None
    if type(spans) is not list:
        raise wrong("choices[0].weight_versions", spans, "a list of spans or null")
    out = []
    for i, s in enumerate(spans):
        if type(s) is not dict or type(s.get("version")) is not str or type(s.get("start")) is not int \
                or type(s.get("end")) is not int:
            raise wrong(f"choices[0].weight_versions[{i}]", s, "an object with a string version and integer "
                        "start and end")
        out.append((s["version"], s["start"], s["end"]))
    return out


def _usage_event(token_ids: list[int], finish: str, usage: Any, matched: int | str | None) -> Event:
    """The finishing event, with vLLM's ``usage`` (``prompt_tokens``,
    ``completion_tokens``, ``prompt_tokens_details.cached_tokens``; counts of
    tokens) where it carries them."""
    if type(usage) is not dict:
        return Event(token_ids, finish, matched=matched)
    details = usage.get("prompt_tokens_details")
    return Event(
        token_ids,
        finish,
        prompt_tokens=_int(usage.get("prompt_tokens")),
        completion_tokens=_int(usage.get("completion_tokens")),
        cached_tokens=_int(details.get("cached_tokens")) if type(details) is dict else None,
        matched=matched,
    )


def _stop_reason(attempt: Attempt, choice: dict) -> int | str | None:
    """A choice's ``stop_reason`` (the matched stop token id or string), read
    only from a worker whose reported vLLM version sends one."""
    behaviour = vllm_behaviour(attempt.worker_info.get("version"))
    if behaviour is None or not behaviour.stop_reason:
        return None
    reason = choice.get("stop_reason")
    return reason if type(reason) in (int, str) else None


class VLLMExchange(Exchange):
    """One vLLM request's state across worker attempts.

    Args:
        request: the decoded request.
        request_id: the frontend's id, the stream chunks' id when the client
            gave none.
    """

    __slots__ = (
        "native", "stream", "stream_id", "finish", "matched", "finished", "out", "status", "input_ids",
        "resumed", "choice_tokens", "details", "sent", "spans", "leg_starts", "aborting", "closing",
    )

    def __init__(self, request: GenerateRequest, request_id: str) -> None:
        self.native: VLLMRequest = request.native
        self.stream = request.stream
        public = self.native.public_id
        self.stream_id = ENGINE_PREFIX + (public if public is not None else request_id)
        #: A stream's finish reason (of choice 0) and its stop_reason, held
        #: until the usage chunk.
        self.finish: str | None = None
        self.matched: int | str | None = None
        #: Indices of the stream's choices that finished.
        self.finished: set[int] = set()
        #: What the last fed payload gives the client: an SSE payload (or
        #: ``None`` for nothing), or the whole unary body, sent with ``status``.
        self.out: bytes | None = None
        self.status = 200
        #: A stream's tokens so far per choice index (the decode leg's).
        self.choice_tokens: dict[Any, int] = {}
        self.input_ids = request.input_ids
        #: Output tokens re-fed to the running (resumed) attempt as prompt.
        self.resumed = 0
        #: The first leg's ``prompt_tokens_details``, when a usage chunk showed it.
        self.details: Any = None
        #: The body of the last worker request built (the leg that answers next).
        self.sent: dict | None = None
        #: A stream's weight version spans so far over the client's answer
        #: (:meth:`_answer_spans`).
        self.spans: list[tuple[str, int, int]] = []
        #: Where each client leg of a stream began in the answer, with its
        #: worker's weight version then (``worker_info``): the versions of
        #: tokens whose leg ended without reporting them.
        self.leg_starts: list[tuple[int, str | None]] = []
        #: A stream's chunk that finished its choice with ``abort``, withheld
        #: until the stream's end (:meth:`feed`), then the one its end
        #: event releases for :meth:`client_event` to render.
        self.aborting: dict | None = None
        self.closing: dict | None = None

    def resume_refusal(self) -> str | None:
        """Why this request cannot resume mid-answer (see the module docstring)."""
        sp = self.native.body.get("sampling_params") or {}
        if self.input_ids is None:
            return "a multimodal prompt cannot be resumed"
        if self.native.n != 1:
            return "n > 1 choices cannot be resumed"
        if any(sp.get(k) is not None for k in CONSTRAINED):
            return "constrained decoding cannot be resumed exactly"
        if any(sp.get(k, d) != d for k, d in PENALTIES):
            return "penalties count the output tokens a resumed attempt re-feeds as prompt"
        return None

    def worker_request(self, attempt: Attempt) -> WorkerRequest:
        """The client's body, the minted id as ``X-Request-Id``. A unary
        request's leg is unary and otherwise unchanged; a streaming leg asks
        for the closing usage chunk (and for continuous usage only if the
        client did).

        P/D (vLLM's proxies, sequential legs, the same id on both): the
        prefill leg is unary with ``max_tokens`` 1 (``sampling_params`` has
        no ``max_completion_tokens`` on this route), EOS ignored, none of
        :data:`PREFILL_DROPS`, no ``stream_options``, and
        :data:`PREFILL_KV`; the decode leg is the client's request plus the
        prefill answer's ``kv_transfer_params`` (kept in the pair's
        :class:`Prefilled`), verbatim, or, for a pair marked
        ``local_prefill``, the client's request alone.

        Raises:
            RequestError: the prompt does not fit the worker's
                ``max_model_len`` (vLLM's own 400, before any engine sees
                it); 502 of kind :data:`NO_KV_TRANSFER`, a decode leg whose
                prefill leg answered no ``kv_transfer_params`` (a worker
                whose KV connector hands nothing off).
        """
        check_prompt_length(self.native.body, attempt.worker_info.get("max_model_len"))
        # The minted id travels as X-Request-Id alone: vLLM takes the
        # header over the body's request_id (OpenAIServing._base_request_id,
        # vllm/entrypoints/serve/engine/serving.py), so the body stays the
        # client's and an engine refusal echoes nothing the frontend made.
        self.sent = body = dict(self.native.body)
        for name, value in attempt.fields.items():  # the engine's priority (GenerateRequest.priority)
            body.setdefault(name, value)
        self.aborting = self.closing = None  # a held leg's abort is not the next leg's
        headers = [_JSON, (b"x-request-id", attempt.engine_id.encode())]
        if attempt.resumes:  # a migration: both legs of a pair carry the longer prompt
            self._resume(body, attempt.resumes)
        if attempt.role == "prefill":
            sp = dict(body.get("sampling_params") or {})
            for key in PREFILL_DROPS:
                sp.pop(key, None)
            sp.update(max_tokens=1, ignore_eos=True)
            body.update(sampling_params=sp, kv_transfer_params=PREFILL_KV, stream=False)
            body.pop("stream_options", None)
            return WorkerRequest(PATH.encode(), dump_body(body), headers, stream=False)
        if attempt.role == "decode":
            self.choice_tokens.clear()
            pair = attempt.pair
            if not pair.local_prefill:
                kv = pair.from_prefill.kv if pair.from_prefill is not None else None
                if type(kv) is not dict:
                    raise RequestError(502, "the prefill worker answered no kv_transfer_params", NO_KV_TRANSFER)
                body["kv_transfer_params"] = kv
        self.resumed = len(attempt.resumes or ())
        self.leg_starts = [x for x in self.leg_starts if x[0] < self.resumed]
        self.leg_starts.append((self.resumed, attempt.worker_info.get("weight_version")))
        if not self.stream:
            return WorkerRequest(PATH.encode(), dump_body(body), headers, stream=False)
        body["stream_options"] = {
            **(body.get("stream_options") or {}),
            "include_usage": True,
            "continuous_usage_stats": self.native.continuous_usage,
        }
        return WorkerRequest(PATH.encode(), dump_body(body), headers)

    def _resume(self, body: dict, resumes: list[int]) -> None:
        k = len(resumes)
        body["token_ids"] = self.input_ids + resumes
        sp = body["sampling_params"] = dict(body.get("sampling_params") or {})
        if type(sp.get("max_tokens")) is int:
            sp["max_tokens"] = max(0, sp["max_tokens"] - k)
        if type(sp.get("min_tokens")) is int:
            sp["min_tokens"] = max(0, sp["min_tokens"] - k)
        sp.pop("prompt_logprobs", None)
        self.finish, self.matched = None, None
        self.finished.clear()

    def _uninterrupted(self, usage: Any) -> None:
        """A resumed attempt's ``usage`` as the uninterrupted request's."""
        if type(usage) is dict and type(usage.get("prompt_tokens")) is int:
            usage["prompt_tokens"] -= self.resumed
            if type(usage.get("completion_tokens")) is int:
                usage["completion_tokens"] += self.resumed
            details = usage.get("prompt_tokens_details")
            if self.details is not None:
                usage["prompt_tokens_details"] = self.details
            elif type(details) is dict and type(details.get("cached_tokens")) is int:
                details["cached_tokens"] = min(details["cached_tokens"], usage["prompt_tokens"])

    def feed(self, attempt: Attempt, payload: bytes) -> Event:
        """A streaming leg: one vLLM stream chunk, giving its new token ids
        (of whichever choice it carries); the held finish reason and usage
        once the closing usage chunk arrives. A unary leg: vLLM's whole
        ``GenerateResponse`` (its engine id, when it shows one, replaced by
        the client's), giving the token ids of all its choices (so
        ``n`` choices count as the sum of their tokens), the first choice's
        finish reason, and usage. A worker whose version sends
        ``stop_reason`` gives it as the event's ``matched``. Either way
        ``{"error": ...}`` gives an engine error whose status is
        ``error.code`` (500 unless that is a 4xx or 5xx integer).

        Raises:
            WorkerAnswerError: the payload is not what vLLM sends
                (:mod:`.answer`).
            RequestError: 502, a P/D pair's answers cannot be joined.
        """
        obj = answer_object(payload, "the chunk" if self.stream and attempt.role != "prefill" else "the body")
        if obj.get("error") is not None:
            err = check_error(obj)
            code = err.get("code")
            status = code if type(code) is int and 400 <= code <= 599 else 500
            if attempt.role != "prefill":  # the client's answer
                self.status, self.out = status, payload
            return Event([], error=EngineError(status, err["message"]))
        choices = check_top(obj, self.native.n)
        if attempt.role == "prefill":  # kept for the decode leg, never the client's
            if not choices:
                raise WorkerAnswerError("choices is empty, expected the prefill's choice")
            usage = obj.get("usage")
            attempt.pair.from_prefill = Prefilled(
                obj.get("kv_transfer_params"), obj.get("prompt_logprobs"),
                {c["index"]: c.get("routed_experts") for c in choices},
                usage.get("prompt_tokens_details") if type(usage) is dict else None,
            )
            return _usage_event([], choices[0].get("finish_reason") or "stop", usage, None)
        pre = self._prefilled(attempt)
        if not self.stream:
            if not choices:
                raise WorkerAnswerError("choices is empty, expected at least one choice")
            ids = [t for choice in choices for t in choice["token_ids"]]
            finish = choices[0].get("finish_reason", MISSING)
            if type(finish) is not str:  # a finished answer's choice has its reason
                raise wrong("choices[0].finish_reason", finish, "a string")
            own = _reported(obj.get("usage")) if pre is not None else None
            joined = pre is not None and join_unary(pre, obj, choices, self._prompt_tokens())
            if obj.get("request_id") == ENGINE_PREFIX + attempt.engine_id:
                obj["request_id"] = self.stream_id
                joined = True
            self.out = orjson.dumps(obj) if joined else payload
            event = _usage_event(ids, finish, obj.get("usage"), _stop_reason(attempt, choices[0]))
            event.leg_usage = own
            if self.native.n == 1:
                event.weight_spans = _spans(choices[0])
            if self.native.n != 1:
                event.entries = [
                    (c["index"], Event(c["token_ids"], c.get("finish_reason") or "stop",
                                       matched=_stop_reason(attempt, c)))
                    for c in choices
                ]
            return event
        obj["request_id"] = self.stream_id
        usage = obj.get("usage")
        own = None
        if not choices and type(usage) is dict:  # the closing usage chunk
            if pre is not None or self.resumed:
                own = _reported(usage)
            if pre is not None:
                join_details(usage, pre.details, exclude_none=True)
        if self.resumed:
            self._uninterrupted(usage)
        elif type(usage) is dict and self.details is None:
            self.details = usage.get("prompt_tokens_details")
        if not choices:  # the closing usage chunk
            if type(usage) is not dict:
                raise wrong("usage", obj.get("usage", MISSING), "an object in a chunk without choices")
            self.out = orjson.dumps(obj) if self.native.include_usage else None
            # vLLM before 0.32 drops the finish-only chunk of an aborted request.
            event = _usage_event(self._release(), self.finish or "abort", usage, self.matched)
            event.leg_usage = own
            return event
        ids = []
        entries = []
        for choice in choices:
            got = choice["token_ids"]
            ids += got
            index = choice["index"]
            if attempt.role == "decode":
                self.choice_tokens[index] = self.choice_tokens.get(index, 0) + len(got)
            finish = choice.get("finish_reason")
            if finish is not None:
                if pre is not None:
                    rows = choice.get("routed_experts")
                    joined = join_experts(pre, index, rows, self.choice_tokens[index], finish, self._prompt_tokens())
                    if joined is not rows:  # a build without the field keeps its layout
                        choice["routed_experts"] = joined
                self.finished.add(index)
                if index == 0:
                    self.finish, self.matched = finish, _stop_reason(attempt, choice)
            if self.native.n != 1:
                entries.append((index, Event(got, finish, matched=_stop_reason(attempt, choice) if finish else None)))
        if self.native.n != 1:
            self.out = orjson.dumps(obj)
            return Event(ids, entries=entries)
        finish = choices[0].get("finish_reason")
        if finish is None:
            self.out = orjson.dumps(obj)
            return Event(ids)
        spans = _spans(choices[0])
        if spans is not None:
            self._answer_spans(choices[0], spans)
        if finish == "abort":  # its tokens and bytes go with the stream's end event
            self.aborting, self.out = obj, None
            ids = []
        else:
            self.out = orjson.dumps(obj)
        event = Event(ids)
        event.weight_spans = spans
        return event

    def _release(self) -> list[int]:
        """The stream ends: the withheld aborting chunk (if any) goes to
        :meth:`client_event` with the end event, which carries its tokens."""
        held = self.aborting
        if held is None:
            return []
        self.aborting, self.closing = None, held
        return held["choices"][0]["token_ids"]

    def _answer_spans(self, choice: dict, spans: list[tuple[str, int, int]]) -> None:
        """A finished stream choice's ``weight_versions`` over the client's
        whole answer: a resumed leg's spans (over its own output) moved past
        the ``resumed`` tokens it was re-fed, after the spans the earlier
        legs' finishing chunks gave for those; tokens of a leg that ended
        without one (a lost worker's) at its worker's version when it was
        sent (unknown: the engine's spans are left as they are)."""
        r = self.resumed
        whole = [x for x in self.spans if x[2] <= r]
        covered = whole[-1][2] if whole else 0
        starts = self.leg_starts
        for i, (at, version) in enumerate(starts):
            end = min(starts[i + 1][0] if i + 1 < len(starts) else r, r)
            if end <= covered:
                continue
            if version is None:
                return
            self._extend(whole, version, max(at, covered), end)
            covered = end
        for version, start, end in spans:
            self._extend(whole, version, start + r, end + r)
        self.spans = whole
        if r:
            choice["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in whole]

    @staticmethod
    def _extend(spans: list[tuple[str, int, int]], version: str, start: int, end: int) -> None:
        """Add ``[start, end)`` at ``version`` to contiguous ``spans``."""
        if spans and spans[-1][0] == version and spans[-1][2] == start:
            spans[-1] = (version, spans[-1][1], end)
        else:
            spans.append((version, start, end))

    @staticmethod
    def _prefilled(attempt: Attempt) -> Prefilled | None:
        """What ``attempt``'s pair's prefill leg answered, when ``attempt``
        is that pair's decode leg and received its KV: only it joins what
        its prefill computed (a retried, replayed or migrated attempt never
        joins a failed pair's)."""
        pair = attempt.pair
        if attempt.role != "decode" or pair is None or pair.local_prefill:
            return None
        return pair.from_prefill

    def _prompt_tokens(self) -> int | None:
        """The prompt's length a P/D join counts rows by (re-fed output of a
        resumed pair included), ``None`` without the request's token ids."""
        return len(self.input_ids) + self.resumed if self.input_ids is not None else None

    def end_of_stream(self, attempt: Attempt) -> Event | None:
        """A stream that ended after the finishing chunks of all its choices
        without the usage chunk (a vLLM build that sends none): finish with
        the held reason, sending the client nothing more. ``None`` when a
        choice never finished (the answer was cut short)."""
        if self.finish is None or len(self.finished) < self.native.n:
            return None
        self.out = None
        return Event(self._release(), self.finish, matched=self.matched)

    def client_event(self, event: Event) -> bytes | tuple[bytes, ...] | None:
        """The worker's chunk with the client's id, or nothing for a usage
        chunk the client did not ask for (or a stream's end).

        A stream's end event after a withheld aborting chunk (see the
        module docstring) renders that chunk as the event says: with its
        ``finish_reason`` ``abort`` as vLLM sent it, then the usage chunk
        when asked (two payloads); or, when the handler withdrew the finish
        (:attr:`Event.held`: the stream goes on after a pause), as a running
        chunk (``finish_reason``, ``stop_reason``, ``weight_versions`` and
        ``routed_experts`` null, as vLLM sends them mid-stream) when it
        carries tokens, else nothing, and never the usage chunk."""
        held = self.closing
        if held is None:
            return self.out
        self.closing = None
        if event.held:
            choice = held["choices"][0]
            if not choice["token_ids"]:
                return None
            for key in ("finish_reason", "stop_reason", "weight_versions", "routed_experts"):
                if key in choice:
                    choice[key] = None
            return orjson.dumps(held)
        chunk = orjson.dumps(held)
        return chunk if self.out is None else (chunk, self.out)

    def unary_body(self) -> tuple[int, bytes]:
        """The worker's answer: vLLM's ``GenerateResponse`` (with the
        client's id for the engine's) with status 200, or its
        ``{"error": ...}`` with the error's status (see :meth:`feed`)."""
        return self.status, self.out

    def worker_error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """vLLM workers answer in this format's shapes: pass through (a
        validation refusal with the echo of the client's own body,
        :func:`asgi_generate_vllm.request.restore_echo`); a body that is not
        JSON (a bare server error page) gets vLLM's shape."""
        if self.sent is not None:
            native = self.native
            body = restore_echo(body, self.sent, native.raw if native.raw is not None else native.body)
        return engine_error_page(status, body, VLLMCodec().error_body)
