"""The codec API: what a wire format plugs into the shared /generate handler.

A codec is a sans-IO object, in the spirit of h11: it turns bytes into
normalized values and normalized values into bytes, with no sockets, awaits or
clocks. The handler owns every await, timeout, retry, abort and trace record,
and derives all of them from the normalized :class:`Event` stream that every
codec must produce anyway. Codecs register through the entry point group
``asgi_generate.codecs`` (see :mod:`asgi_generate.sdk._registry`); an entry point
names a :class:`Codec` subclass or a zero-argument factory returning one.

Per request the handler calls, in order::

    request  = codec.decode(body, headers)          # or RequestError
    exchange = codec.exchange(request, request_id)
    for each attempt on a worker:
        wreq  = exchange.worker_request(attempt)    # bytes for the worker
        event = exchange.feed(attempt, payload)     # per worker SSE payload
        data  = exchange.client_event(event)        # SSE mode: bytes to send
        event = exchange.end_of_stream(attempt)     # stream ended unfinished
    status, body = exchange.unary_body()             # unary mode, at the end
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import orjson

from ._compact import dumps_compact  # re-exported: codecs import it from here
from ._token_ids import PackedIds

if TYPE_CHECKING:
    from ._text import PromptTokenizer


@dataclass(frozen=True, slots=True)
class Route:
    """An HTTP method and path a codec serves, e.g. ``Route("POST", "/generate")``."""

    method: str
    path: str


#: Items one request may carry by default (``--max-request-items``): vLLM's
#: own ceiling on ``n`` (``VLLM_MAX_N_SEQUENCES``, ``vllm/envs.py``, checked
#: by ``_verify_num_sequences`` in ``vllm/sampling_params.py``, 0.33.0). Its
#: tokens-only route refuses sooner, past the scheduler's ``max_num_seqs``
#: (``serve_tokens``, ``vllm/entrypoints/scale_out/token_in_token_out/
#: serving.py``), which the frontend cannot see; SGLang 0.5.23 bounds
#: neither ``n`` nor a batch's prompts (``GenerateReqInput.
#: normalize_batch_and_arguments``, ``managers/io_struct.py``; its
#: ``_handle_batch_request`` only warns past 128 prompts with ``n`` > 1).
MAX_REQUEST_ITEMS = 16384

#: The :class:`RequestError` kind of a P/D decode leg that cannot start: its
#: prefill leg answered no KV hand-over (vLLM ``kv_transfer_params``);
#: ``--pd-fallback`` then sends it as its pair's ``local_prefill``.
NO_KV_TRANSFER = "no_kv_transfer"


class RequestError(Exception):
    """A request the frontend refuses, rendered in the format's error shape.

    Args:
        status: HTTP status (400, 404, 405, 413, 415, 503, ...).
        message: what was wrong, for a human.
        kind: a short machine name (``invalid_json``, ``invalid_request``,
            ``too_large``, ``unsupported_media_type``, ``method_not_allowed``,
            ``unavailable``, ``shutdown``, ``engine``, ``internal``,
            ``bad_worker_answer`` (:class:`WorkerAnswerError`),
            :data:`NO_KV_TRANSFER`); codecs
            may pick their error shape from it.
        in_band: the format reports this error inside a stream the client
            asked for: HTTP 200, ``text/event-stream``, the format's in-band
            error event, then its terminal marker (SGLang raises its value
            errors inside the streaming generator, after the 200).
    """

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request", *, in_band: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.in_band = in_band


class WorkerAnswerError(RequestError):
    """A worker answered 200 with a body that is not its protocol's answer:
    not JSON, not the protocol's object, or a field the codec reads of the
    wrong type or shape. Codecs raise it from :meth:`Exchange.feed`
    (:mod:`asgi_generate.sdk.answer` has the checks).

    The handler answers it like any error of the worker: 502 in the
    format's error shape (in-band once a stream's 200 went out), the
    request's record with this message, and the worker's connection
    retired, never reused (the leg runner closes a connection whose answer
    ended in an exception).

    Args:
        what: what was wrong, naming the field, e.g. ``output_ids is a
            string, expected a list of integers``; the message is
            ``worker answer: <what>``.
    """

    def __init__(self, what: str) -> None:
        super().__init__(502, f"worker answer: {what}", "bad_worker_answer")


def dump_body(obj: Any) -> bytes:
    """Serialize a worker request body with orjson (see :func:`dumps_compact`).

    orjson reads JSON nested up to 1024 levels but writes at most 254, so a
    client's deeply nested pass-through field is refused here, as bad input.

    Raises:
        RequestError: 400, the body nests too deeply to forward.
    """
    try:
        return dumps_compact(obj)
    except orjson.JSONEncodeError as exc:
        raise RequestError(400, f"the request cannot be forwarded: {exc}") from None


def engine_error_page(
    status: int, body: bytes, error_body: Callable[["RequestError"], bytes]
) -> tuple[int, bytes]:
    """A worker's non-200 answer for a JSON worker protocol (SGLang, vLLM):
    the engine's own JSON error body passes through; anything else (a bare
    server error page) is rendered with ``error_body``, the format's shape.

    Returns:
        ``(status, body)`` for the client.
    """
    try:
        orjson.loads(body)
        return status, body
    except orjson.JSONDecodeError:
        text = body[:200].decode("utf-8", "replace")
        return status, error_body(RequestError(status, f"worker answered {status}: {text}", "engine"))


@dataclass(slots=True)
class BatchItem:
    """One item of a request that carries several (an SGLang batch entry, a
    parallel sample, a vLLM choice), in the client's answer order.

    Attributes:
        public_id: the id the client knows the item by (SGLang ``rid_i`` or
            ``rid[i]``), ``None`` where the engine would mint one.
        input_ids: the item's prompt token ids, ``None`` when not token-only.
        replay_excluded: why its input cannot be replayed, else ``None``.
        group: items with the same group share a prompt; ``--split-batches``
            keeps a group on one worker (its prefix is cached there, and a
            deterministic engine draws its samples in order).
    """

    public_id: str | None
    input_ids: list[int] | None
    replay_excluded: str | None = None
    group: int = 0


@dataclass(slots=True)
class GenerateRequest:
    """The normalized request: what the handler may know about a request.

    Attributes:
        stream: the client asked for SSE.
        public_id: the client's own request id (``rid``, ``request_id``,
            ``X-Request-Id``), echoed back to it; ``None`` if it gave none.
        input_ids: prompt token ids when the input is token-only, else
            ``None``: a list, or the packed ``array('I')`` once a codec that
            packed them built its first worker request (no list of ints
            held while the request streams).
        input_ids_packed: ``input_ids`` packed as u32 and as JSON text
            (:func:`asgi_generate.sdk.pack_token_ids`) when the codec
            packed them while checking them, else ``None``.
        prompt_text: the prompt when it is one text, else ``None`` (what
            cache-aware routing matches when there are no token ids).
        max_new_tokens: the output cap in tokens, ``None`` if uncapped.
        model: the model named by the request, if any.
        replay_excluded: why the input cannot be replayed from token ids
            (``"text"``, ``"multimodal"``, ``"embeddings"``), else ``None``.
        native: codec-private parsed payload; the handler never reads it.
        items: the items of a request that carries several (a batch, or
            ``n`` > 1), in answer order; ``None`` for one prompt, one answer.
            The exchange's events then carry ``entries``.
        cache_salt: the request's prefix-cache namespace (vLLM and SGLang
            ``cache_salt``): the engine finds no block a request of another
            salt stored, so KV-aware routing chains its block hashes from it.
    """

    stream: bool
    public_id: str | None = None
    input_ids: Sequence[int] | None = None
    input_ids_packed: PackedIds | None = None
    max_new_tokens: int | None = None
    model: str | None = None
    replay_excluded: str | None = None
    native: Any = None
    items: list[BatchItem] | None = None
    prompt_text: str | None = None
    cache_salt: str | None = None


@dataclass(slots=True, eq=False)
class Pair:
    """What joins the two legs of one prefill/decode (P/D) attempt, shared
    by both legs' :class:`Attempt`. The handler's P/D handshake (one per
    worker protocol, :mod:`asgi_generate.request.handshakes`) makes it; the
    codec builds both legs' worker bodies from it.

    Attributes:
        fields: top-level fields both legs' worker bodies carry as given,
            set before either is built (SGLang: ``bootstrap_host``,
            ``bootstrap_port`` and ``bootstrap_room``, the prefill worker's
            host and bootstrap port and a room minted per pair); empty when
            the legs join otherwise.
        from_prefill: the codec's own: what it keeps of this pair's prefill
            answer for the decode leg's body (vLLM: the
            ``kv_transfer_params`` it answered) and for the client's answer
            (what only the prefill leg computed), which only this pair's
            decode leg joins; the handler never reads it.
        local_prefill: the decode leg is sent without anything from the
            prefill leg's answer (it gave none, and ``--pd-fallback`` let
            the decode worker prefill alone).
    """

    fields: dict[str, Any] = field(default_factory=dict)
    from_prefill: Any = None
    local_prefill: bool = False


@dataclass(slots=True)
class Attempt:
    """One engine leg of a request on one worker, as its codec sees it.

    The handler keeps its own bookkeeping of the leg (whether it may still
    run, how it ended, its tokens, its abort's answer) in a record of its
    own that extends this one; a codec reads only what is here.

    Attributes:
        engine_id: the id minted for the engine, unique per attempt, fixed
            width (so no minted id is a prefix of another: SGLang aborts by
            prefix).
        role: ``aggregated``, ``prefill``, ``decode``, ``resumed`` (a
            migrated continuation of a stream another worker dropped) or
            ``replayed`` (a unary request run again from scratch after its
            worker died mid-answer).
        worker_id: the worker's id in the router.
        worker_info: the worker's server info (e.g. SGLang ``/get_server_info``).
        pair: for a ``prefill`` or ``decode`` leg, its P/D pair's
            :class:`Pair` (both legs share it), else ``None``.
        resumes: for a migrated leg (``resumed``, or a P/D leg of a
            migration), the output token ids already sent to the client,
            which the leg's prompt carries after the original one.
        entries: batch legs: the items (indices into
            ``GenerateRequest.items``) this leg carries, in the order the
            worker body lists them; else ``None``.
        entry_ids: batch legs whose items the engine runs under ids of their
            own (SGLang entries): item index -> the id minted for it, what
            aborts it; else ``None``.
        backoff_ms: milliseconds the request waited before this leg (the
            migration backoff).
        fields: top-level fields the handler asks this leg's worker body to
            carry where the client's body has none of its own (the engines'
            ``priority``, from admission's class); a codec whose engine has
            no such field leaves them out.
    """

    engine_id: str
    role: str = "aggregated"
    worker_id: str = ""
    worker_info: Mapping[str, Any] = field(default_factory=dict)
    pair: "Pair | None" = None
    resumes: list[int] | None = None
    entries: list[int] | None = None
    entry_ids: dict[int, str] | None = None
    backoff_ms: int = 0
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts one leg's engine reported for it, each ``None`` when
    not reported: ``prompt_tokens`` (its prompt, a resumed leg's re-fed
    output included), ``completion_tokens``, ``cached_tokens`` (prompt
    tokens its prefix cache, or a P/D KV transfer, served)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(slots=True)
class WorkerRequest:
    """What to POST to a worker: path, body and extra headers.

    ``stream`` says how the worker answers: SSE events, each fed to
    :meth:`Exchange.feed` as it comes (the default, which lets the handler
    time the first token and count tokens as they go), or one unary body fed
    whole, for what an engine only puts in unary answers.
    """

    path: bytes
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    stream: bool = True


@dataclass(slots=True)
class EngineError:
    """An error the engine reported, with the HTTP status it implies."""

    status: int
    message: str


@dataclass(slots=True)
class Event:
    """One normalized worker event.

    Attributes:
        token_ids: output tokens new in this event (a delta, never cumulative).
        finish_reason: ``None`` while running, else the engine's reason as a
            string (``stop``, ``length``, ``abort``, ...).
        error: set when the engine reported an error instead of output.
        prompt_tokens, completion_tokens, cached_tokens: usage the engine
            reported, when it did.
        matched: with ``stop``, the stop token id or string that matched,
            when the engine says (SGLang ``matched``, vLLM ``stop_reason``).
        entries: for a request with ``items``: ``(item index, that item's
            event)`` for each item this event is about (``token_ids`` is
            then all of theirs, and ``finish_reason`` is set only once every
            item finished).
        cut: the codec finished the answer before the engine did (a stop
            string straddling a migration seam): the leg still runs and is
            aborted.
        leg_usage: what this leg's engine reported, when the event's
            counts are not that (the codec joined a P/D pair's legs, or made
            a resumed leg's counts the uninterrupted answer's); ``None``:
            the event's own counts are the leg's.
        weight_version: the weight version the engine reported for this
            event's ``token_ids`` (SGLang ``meta_info.weight_version``,
            ``tokenizer_manager.py``); ``None``: not reported.
        weight_spans: the weight versions the engine reported for the
            leg's whole output, ``(version, start, end)`` over the leg's own
            output token indices, ``end`` exclusive (vLLM's
            ``weight_versions`` on a finished choice, ``WeightVersionSpan``
            in ``vllm/outputs.py``); ``None``: not in this event.
        held: set by the handler, never a codec: the handler withdrew this
            event's finish (``finish_reason`` is now ``None``), the engine's
            abort of a stream held across a fleet pause that goes on on a
            resumed leg; :meth:`Exchange.client_event` renders it as a
            running chunk, showing no finish.
    """

    token_ids: list[int]
    finish_reason: str | None = None
    error: EngineError | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    matched: int | str | None = None
    entries: list[tuple[int, "Event"]] | None = None
    cut: bool = False
    leg_usage: Usage | None = None
    weight_version: str | None = None
    weight_spans: list[tuple[str, int, int]] | None = None
    held: bool = False

    def reported(self) -> Usage | None:
        """The counts this leg's engine reported: :attr:`leg_usage`, else
        the event's own; ``None`` when it reported none."""
        if self.leg_usage is not None:
            return self.leg_usage
        if self.prompt_tokens is None and self.completion_tokens is None and self.cached_tokens is None:
            return None
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


#: ``Event.finish_reason`` of a batch leg's end when every item it carried
#: finished while other legs of the request still run: nothing more to
#: deliver, and the request is not finished (see :mod:`asgi_generate.request.batches`).
LEG_DONE = "leg_done"


class Exchange:
    """Codec state for one request: builds worker bodies, reads worker
    events, renders the client's answer. Subclass per codec.

    In P/D the handler feeds the prefill leg's answer (whole: the unary
    body, or each SSE payload) with its ``prefill`` attempt; the codec keeps
    what the client's answer needs from it, and the events it returns are
    never delivered. Only the decode leg's events reach the client.
    """

    def worker_request(self, attempt: Attempt) -> WorkerRequest:
        """The worker request for ``attempt``. A ``resumed`` attempt's body
        carries the prompt followed by ``attempt.resumes``, the budget
        reduced by their count (minimums saturating at 0), and asks for no
        prompt logprobs of the re-fed output; the events it is then fed
        continue the client's answer as if no worker had failed."""
        raise NotImplementedError

    def resume_refusal(self) -> str | None:
        """Why this request cannot continue on another worker mid-answer
        (``None``: it can, see :meth:`worker_request`). The default: the
        format does not resume."""
        return "the format does not resume a stream"

    def feed(self, attempt: Attempt, payload: bytes) -> Event:
        """Parse one worker SSE ``data`` payload (never ``[DONE]``), or the
        whole body of a non-streaming worker answer.

        Raises:
            WorkerAnswerError: the payload is not what the worker protocol
                allows.
            RequestError: 502, the answer cannot be joined with the rest of
                the request (kind ``engine``).
        """
        raise NotImplementedError

    def end_of_stream(self, attempt: Attempt) -> Event | None:
        """The worker's stream ended before any event finished the request:
        the finishing event the codec can still make (e.g. from a held finish
        reason), or ``None`` when the answer is truly cut short."""
        return None

    def client_event(self, event: Event) -> bytes | tuple[bytes, ...] | None:
        """SSE mode: the ``data`` payload to send the client for ``event``
        (the one last fed, as the handler leaves it: an :attr:`Event.held`
        event shows no finish), a tuple of payloads sent as that many SSE
        events in order, or ``None`` to send nothing."""
        raise NotImplementedError

    def unary_body(self) -> tuple[int, bytes]:
        """Unary mode, after the last event: status and body."""
        raise NotImplementedError

    def worker_error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """A worker answered ``status`` (not 200) with ``body`` before
        streaming: the status and body for the client."""
        raise NotImplementedError


class Codec:
    """A wire format. Subclasses set the class attributes and methods.

    Attributes:
        name: the format's name (``sglang``, ``vllm``, ...), unique.
        routes: the (method, path) pairs it serves.
        worker_protocol: the engine it rides on: the name of an engine
            description in the ``asgi_generate.engines`` entry point group
            (:data:`asgi_generate.protocols.PROTOCOLS`: ``sglang``, ``vllm``,
            ...); the registry refuses a codec naming none installed.
        content_type: the unary response media type.
        sse_terminal: the bytes that end an SSE response.
    """

    name: str = ""
    routes: tuple[Route, ...] = ()
    worker_protocol: str = ""
    content_type: bytes = b"application/json"
    sse_terminal: bytes = b"data: [DONE]\n\n"
    #: The frontend's body cap in bytes, set by the app before serving; a
    #: codec that expands bodies (decompression) must not exceed it.
    max_body_bytes: int = 32 * 1024 * 1024
    #: The items one request may carry (``--max-request-items``), set by the
    #: app before serving: a codec whose requests carry several (a batch,
    #: ``n`` > 1) refuses more with its format's 400 before making them.
    max_items: int = MAX_REQUEST_ITEMS
    #: The model's tokenizer (``--tokenizer``), set by the app before
    #: serving, else ``None``: what a migration needs to resume a text
    #: prompt and to check stop strings across the seam.
    tokenizer: "PromptTokenizer | None" = None

    def decode(self, body: bytes, headers: Mapping[bytes, bytes]) -> GenerateRequest:
        """Parse and check a request body; ``headers`` has lower-case names.

        Raises:
            RequestError: the input is bad; nothing reaches an engine.
        """
        raise NotImplementedError

    def exchange(self, request: GenerateRequest, request_id: str) -> Exchange:
        """Per-request state; ``request_id`` is the frontend's internal id,
        shown to the client where the format shows a server-made id."""
        raise NotImplementedError

    def error_body(self, error: RequestError) -> bytes:
        """The unary body for ``error`` in the format's error shape."""
        raise NotImplementedError

    def in_band_error(self, error: RequestError) -> bytes:
        """The SSE ``data`` payload carrying ``error`` after the 200 was sent."""
        raise NotImplementedError
