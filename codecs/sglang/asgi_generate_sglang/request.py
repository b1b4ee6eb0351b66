"""A native SGLang ``POST|PUT /generate`` request: how the frontend reads
and checks it, and the shapes SGLang refuses one in.

Wire format: SGLang ``python/sglang/srt/entrypoints/http_server.py``
(``generate_request``) and ``managers/io_struct.py`` (``GenerateReqInput``).
The frontend checks only the fields it relies on itself: the input
(``text``/``input_ids``, read for accounting and replay), ``stream``,
``rid``, ``sampling_params``, ``max_new_tokens`` (recorded), ``n`` and the
bootstrap fields it owns for prefill/decode. Every other field, top level
or inside ``sampling_params``, passes to the engine untouched for the
engine to judge, so a newer engine's fields and defaults work without a
frontend release. A batch (a list ``text``, a list of lists
``input_ids``) is checked by :mod:`asgi_generate_sglang.batch`.

Refusals are answered as SGLang answers them: a field of the wrong type is
FastAPI's 400 schema error (before any stream starts); a bad value is a
``ValueError`` message, which SGLang answers 400 ``{"error": {"message"}}``
for a unary request and, for ``"stream": true``, inside the stream after its
200 (``data: {"error": {"message"}}`` then ``data: [DONE]``). Where SGLang has
the check, the message is SGLang's own (``io_struct.GenerateReqInput.
_validate_inputs``/``_determine_batch_size``, ``sampling_params.SamplingParams.
verify``).
"""

from __future__ import annotations

import math
from http import HTTPStatus
from typing import Any

import orjson

from asgi_generate.sdk import GenerateRequest, RequestError, pack_token_ids

# Set by the frontend for P/D; a client setting them could stall a decode
# engine waiting on a bootstrap room nobody fills, or read another
# request's KV.
FRONTEND_OWNED = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")
MULTIMODAL = ("image_data", "video_data", "audio_data")
CONSTRAINED = ("json_schema", "regex", "ebnf", "structural_tag")
#: Sampling parameters whose default makes them inert, and that otherwise
#: depend on the output so far (SGLang's penalizers count output tokens).
PENALTIES = (("frequency_penalty", 0), ("presence_penalty", 0), ("repetition_penalty", 1))


class SchemaError(RequestError):
    """A field of the wrong type: SGLang's FastAPI 400 schema shape, never
    in-band (FastAPI checks the body before the handler runs)."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, "invalid_request")


def _int(value: Any) -> bool:
    return type(value) is int


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {orjson.dumps(value).decode()[:64]}"


def parse(body: bytes) -> tuple[dict, bool]:
    """A request body's object and whether it streams (``"stream": true``:
    a bad value is then refused in-band).

    Raises:
        RequestError: 400 ``invalid_json`` for bad JSON; :class:`SchemaError`
            for a body that is not an object or a ``stream`` not a boolean.
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"JSON decode error: {exc}", "invalid_json") from None
    if type(obj) is not dict:
        raise SchemaError("Input should be a valid dictionary or object to extract fields from")
    stream = obj.get("stream")
    if stream is not None and type(stream) is not bool:
        raise SchemaError(f"stream: Input should be a valid boolean, got {_shown(stream)}")
    return obj, stream is True


def refuser(in_band: bool):
    """Makes SGLang's ``ValueError`` answer (400 ``{"error": {"message"}}``,
    in-band when ``in_band``) for a message."""

    def refuse(message: str) -> RequestError:
        return RequestError(400, message, in_band=in_band)

    return refuse


def check_frontend_owned(obj: dict, in_band: bool) -> None:
    """Refuse a body that sets a bootstrap field (:data:`FRONTEND_OWNED`).

    Raises:
        RequestError: 400, in-band when ``in_band``.
    """
    for key in FRONTEND_OWNED:
        if obj.get(key) is not None:
            raise refuser(in_band)(f"{key} is set by the frontend for prefill/decode routing; do not send it.")


def decode_one(obj: dict, in_band: bool) -> GenerateRequest:
    """The request of one prompt in ``obj`` (a :func:`parse`\\ d body that
    is not a batch), checked as the module docstring says.

    Raises:
        RequestError: :class:`SchemaError` for a wrong type; SGLang's
            ``ValueError`` answer for a bad value, in-band when ``in_band``.
    """
    refuse = refuser(in_band)
    rid = obj.get("rid")
    if rid is not None and type(rid) is not str:
        raise SchemaError(f"rid: Input should be a valid string, got {_shown(rid)}")

    sp = obj.get("sampling_params")
    if sp is None:
        sp = {}
    elif type(sp) is not dict:
        raise SchemaError(f"sampling_params: Input should be a valid dictionary, got {_shown(sp)}")
    max_new = sp.get("max_new_tokens", 128)
    # SGLang's sampling_params is a plain dict: a finite float such as
    # 1e18 reaches its context-length check as it is (the body keeps it).
    if type(max_new) is float and math.isfinite(max_new):
        max_new = math.ceil(max_new)
    elif max_new is not None and not _int(max_new):
        raise SchemaError(f"sampling_params.max_new_tokens: Input should be a valid integer, got {_shown(max_new)}")
    n = sp.get("n")
    if n is not None and not _int(n):
        raise SchemaError(f"sampling_params.n: Input should be a valid integer, got {_shown(n)}")

    # SGLang's precedence: text, then input_ids, then input_embeds.
    text, input_ids, embeds = obj.get("text"), obj.get("input_ids"), obj.get("input_embeds")
    if (text is None and input_ids is None and embeds is None) or (
        text is not None and input_ids is not None and embeds is not None
    ):
        raise refuse("Either text, input_ids or input_embeds should be provided.")
    ids, packed, excluded = None, None, None
    if text is not None:
        if type(text) is not str:
            raise SchemaError(f"text: Input should be a valid string, got {_shown(text)}")
        excluded = "text"
    elif input_ids is not None:
        if type(input_ids) is not list:
            raise SchemaError(f"input_ids: Input should be a valid list, got {_shown(input_ids)}")
        if not input_ids:
            raise refuse("input_ids cannot be empty.")
        packed = pack_token_ids(input_ids)
        if packed is None:
            if not all(type(t) is int for t in input_ids):
                raise SchemaError("input_ids: Input should be a valid list of integers")
            if min(input_ids) < 0:
                raise refuse(f"input_ids: token id {min(input_ids)} is negative.")
        ids = input_ids
    else:
        excluded = "embeddings"
    if any(obj.get(k) is not None for k in MULTIMODAL):
        ids, packed, excluded = None, None, "multimodal"
    if max_new is not None and max_new < 0:
        raise refuse(f"max_new_tokens must be at least 0, got {max_new}.")
    if type(n) is int and n < 1:
        raise refuse(f"n must be at least 1, got {n}.")
    check_frontend_owned(obj, in_band)
    return GenerateRequest(
        stream=in_band,
        public_id=rid,
        input_ids=ids,
        input_ids_packed=packed,
        max_new_tokens=max_new,
        model=None,
        replay_excluded=excluded,
        native=obj,
        prompt_text=text,
        cache_salt=salt if type(salt := obj.get("cache_salt")) is str and salt else None,
    )


def check_prompt_length(input_ids: list[int] | None, limit: int | None, stream: bool) -> None:
    """Refuse a token prompt of ``limit`` tokens or more, as SGLang's
    ``TokenizerManager._validate_one_request`` (``managers/tokenizer_manager.py``)
    does unless the server runs ``--allow-auto-truncate``; SGLang's
    ``http_server.generate_request`` answers its ``ValueError`` with 400
    ``{"error": {"message"}}``, or in-band after a 200 when ``stream``. Text
    prompts are left to the engine (the frontend does not tokenize).

    Raises:
        RequestError: 400 with SGLang's message (``in_band`` when ``stream``).
    """
    if limit is not None and input_ids is not None and len(input_ids) >= limit:
        raise RequestError(
            400,
            f"The input ({len(input_ids)} tokens) is longer than the model's context length ({limit} tokens).",
            in_band=stream,
        )


def error_body(error: RequestError) -> bytes:
    """A refusal's unary body in SGLang's shapes: FastAPI-style for schema
    errors and statuses other than 400, ``{"error": {"message"}}`` for bad
    values. A 5xx has its status code as ``type`` (``"502"``, ``"503"``):
    on ``/generate`` SGLang raises its non-400 aborts as ``HTTPException``
    (``TokenizerManager``, ``sglang/srt/managers/tokenizer_manager.py``),
    which ``http_server.py``'s ``HTTPException`` handler renders with
    ``type=str(exc.status_code)``; only its ``/v1/responses`` route and its
    validation handler (400, ``"Bad Request"``) use the status phrase."""
    if error.status == 400 and error.kind != "invalid_json" and not isinstance(error, SchemaError):
        return orjson.dumps({"error": {"message": error.message}})
    kind = HTTPStatus(error.status).phrase if error.status < 500 else str(error.status)
    return orjson.dumps(
        {"object": "error", "message": error.message, "type": kind, "param": None, "code": error.status}
    )


def in_band_error(error: RequestError) -> bytes:
    """A refusal inside a stream after its 200: a bad value (400) exactly as
    SGLang's ``generate_request`` streams its ``ValueError``,
    ``{"error": {"message"}}``; other statuses as ``{"error": {"message",
    "type", "code"}}``, a 5xx with the ``type`` of its unary form
    (:func:`error_body`): SGLang's ``HTTPException`` handler in
    ``http_server.py`` sets ``type`` to the status code, for the 500/503
    aborts ``TokenizerManager`` raises."""
    if error.status == 400:
        return orjson.dumps({"error": {"message": error.message}})
    kind = "invalid_request_error" if error.status < 500 else str(error.status)
    return orjson.dumps({"error": {"message": error.message, "type": kind, "code": error.status}})
