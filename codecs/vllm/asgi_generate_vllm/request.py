"""A native vLLM ``POST /inference/v1/generate`` request: how the frontend
reads and checks it (against :mod:`asgi_generate_vllm.schema`), the checks a
worker's limits add, and vLLM's error shape.

Wire format: vLLM ``vllm/entrypoints/serve/disagg/protocol.py``
(``GenerateRequest``) and ``serving.py``; the error object is
``create_error_response``'s. ``kv_transfer_params`` is the frontend's to set
(P/D): a client's non-null value is refused with 400 on every mode, since it
could name another request's KV blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Mapping

import orjson

from asgi_generate.sdk import BatchItem, GenerateRequest, RequestError

from .schema import GENERATE_REQUEST, VLLMRequestError, bad_request, check, validation_error

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


@dataclass(slots=True)
class VLLMRequest:
    """The codec's parsed request (``GenerateRequest.native``).

    Attributes:
        body: the client's JSON object, as sent.
        public_id: ``X-Request-Id``, else the body ``request_id``, else ``None``.
        include_usage: the client asked for the closing usage chunk.
        continuous_usage: the client asked for usage on every chunk.
        n: the choices asked for (``sampling_params.n``, as sent).
        raw: the body's bytes as the client sent them, kept only when
            the check converted a value (else ``body`` is what was sent),
            for :func:`restore_echo`.
    """

    body: dict
    public_id: str | None
    include_usage: bool
    continuous_usage: bool
    n: int = 1
    raw: bytes | None = None


def decode_request(body: bytes, headers: Mapping[bytes, bytes], max_items: int) -> GenerateRequest:
    """Check what the frontend relies on in a vLLM ``GenerateRequest``
    body (see :mod:`asgi_generate_vllm.schema`); ``X-Request-Id``
    overrides ``request_id``. Values only the engine judges (``n``
    below 1 or past its ``max_num_seqs``, ``max_tokens`` below 1,
    logprob counts, multimodal ranges, ...) pass to it untouched,
    whatever vLLM version answers them.

    Raises:
        RequestError: 400 in vLLM's validation shape; 400 in its
            ``BadRequestError`` shape for ``n`` past ``max_items`` (``--max-request-items``).
    """
    media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    if media != b"application/json":  # vLLM's api_router accepts JSON only
        raise VLLMRequestError(
            400,
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            "unsupported_media_type",
            "Bad Request",
        )
    if not body:
        raise validation_error("missing", (), "Field required", None)
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise validation_error("json_invalid", (exc.pos,), "JSON decode error", {}, {"error": exc.msg}) from None
    converted: list = []
    try:
        check(obj, GENERATE_REQUEST, (), converted)
    except VLLMRequestError as exc:
        # The fast check stops at the first field it reads; vLLM lists
        # every error of the whole body (read again if check converted a
        # value in place).
        from .validation import refusal  # pydantic, imported on the first refusal only

        raise refusal(orjson.loads(body) if converted else obj) or exc from None
    if obj.get("kv_transfer_params") is not None:
        # The frontend's to set for P/D: a client naming another
        # request's KV blocks could read them (null, as vLLM's render
        # routes send it, is no value).
        raise bad_request(
            "kv_transfer_params is set by the frontend for prefill/decode routing; do not send it.",
            "kv_transfer_params",
        )
    sp = obj.get("sampling_params") or {}
    n = sp.get("n", 1)
    if n > max_items:  # before one item is made; smaller values of n are the engine's to judge
        raise bad_request(f"sampling_params.n must be at most {max_items} on this server "
                          f"(--max-request-items), got {n}.")
    max_tokens = sp.get("max_tokens")
    token_ids = obj["token_ids"]
    features = obj.get("features")
    header_id = headers.get(b"x-request-id")
    public_id = header_id.decode("latin-1") if header_id is not None else obj.get("request_id")
    # vLLM's should_include_usage: include_usage defaults to true once
    # stream_options is given; continuous usage needs include_usage.
    so = obj.get("stream_options")
    include = so is not None and bool(so.get("include_usage", True))
    native = VLLMRequest(
        body=obj,
        public_id=public_id,
        include_usage=include,
        continuous_usage=include and bool(so.get("continuous_usage_stats")),
        n=n,
        # What the client sent differs from what is forwarded only where a
        # value was converted: only then are its bytes kept.
        raw=body if converted else None,
    )
    input_ids = token_ids if features is None else None
    excluded = "multimodal" if features is not None else None
    return GenerateRequest(
        stream=bool(obj.get("stream")),
        public_id=public_id,
        input_ids=input_ids,
        max_new_tokens=max_tokens if max_tokens is not None and max_tokens > 0 else None,
        model=obj.get("model"),
        replay_excluded=excluded,
        native=native,
        cache_salt=obj.get("cache_salt") or None,
        # n > 1: one item per choice, for their records (the engine runs
        # them under the one request id, which aborts them all).
        items=[BatchItem(public_id, input_ids, excluded) for _ in range(n)] if type(n) is int and n > 1 else None,
    )


def error_body(error: RequestError) -> bytes:
    """vLLM's nested ``{"error": {"message", "type", "param", "code"}}``
    (unary, and as an SSE payload: vLLM streams errors the same way)."""
    status = error.status
    err_type = getattr(error, "err_type", None) or _ERROR_TYPES.get(status) or HTTPStatus(status).phrase
    param = getattr(error, "param", None)
    return orjson.dumps({"error": {"message": error.message, "type": err_type, "param": param, "code": status}})


# One error of vLLM's validation message (0.30 and later): its type, its
# cleaned loc, and an input echoed as a container's size.
_ERROR_LINE = re.compile(r"^  \{'type': '([^']*)', 'loc': '([^']*)', ")
_DICT_ECHO = re.compile(r"'input': '<dict of (\d+) items>'")
_VALIDATION = re.compile(r"\d+ validation errors?:\n")


def restore_echo(payload: bytes, sent: dict, client: dict | bytes) -> bytes:
    """A worker's validation refusal (vLLM's ``validation_exception_handler``
    400) of the body the frontend ``sent``, with every echo of that body
    shown as the echo of the ``client``'s own body (as parsed, or its JSON
    bytes): what vLLM answers the client's body itself.

    The frontend's additions (a streaming leg's ``stream_options``, a
    prefill leg's ``kv_transfer_params`` and sampling changes) and the lax
    values it forwards converted would otherwise show in the echo. Two
    containers are echoed whole: the body (the ``input`` of an error at
    ``body`` and of a missing top-level field) and ``sampling_params`` (its
    union's errors). From 0.30 vLLM echoes a container by its size
    (``<dict of N items>``); before, as its Python ``repr``. Anything else
    (another status, another error shape, no echo of an altered container)
    passes unchanged, byte for byte.
    """
    if b"validation error" not in payload:
        return payload
    try:
        obj = orjson.loads(payload)
        mine = orjson.loads(client) if isinstance(client, bytes) else client
    except orjson.JSONDecodeError:
        return payload
    err = obj.get("error") if type(obj) is dict else None
    message = err.get("message") if type(err) is dict else None
    if type(message) is not str or not _VALIDATION.match(message) or type(mine) is not dict:
        return payload
    pairs = [(sent, mine)]
    if type(sent.get("sampling_params")) is dict and type(mine.get("sampling_params")) is dict:
        pairs.append((sent["sampling_params"], mine["sampling_params"]))
    restored = message
    for was, own in pairs:  # before 0.30: the whole repr (the body's first: it holds the others)
        restored = restored.replace(repr(was), repr(own))
    lines = restored.split("\n")
    for i, line in enumerate(lines):
        head = _ERROR_LINE.match(line)
        if head is None:
            continue
        kind, loc = head.groups()
        if loc == "body" or (kind == "missing" and loc.count(".") == 1):
            was, own = pairs[0]
        elif loc == "body.sampling_params" and len(pairs) == 2:
            was, own = pairs[1]
        else:
            continue
        lines[i] = _DICT_ECHO.sub(
            lambda m: f"'input': '<dict of {len(own)} items>'" if int(m.group(1)) == len(was) else m.group(0), line)
    restored = "\n".join(lines)
    if restored == message:
        return payload
    err["message"] = restored
    return orjson.dumps(obj)


#: Sampling parameters that make a resumed attempt differ from the rest of
#: the uninterrupted run, with their inert defaults.
PENALTIES = (("frequency_penalty", 0), ("presence_penalty", 0), ("repetition_penalty", 1))
CONSTRAINED = ("structured_outputs", "guided_decoding")

def check_prompt_length(body: dict, limit: int | None) -> None:
    """Refuse a text-only prompt that does not fit a model of ``limit``
    tokens, as vLLM's ``InputProcessor._validate_prompt_len``
    (``vllm/v1/engine/input_processor.py``) does: longer than the limit, or
    exactly as long (no room for the one output token a generation needs).
    Multimodal prompts (``features``) are left to the engine, whose wording
    depends on the model.

    Raises:
        VLLMRequestError: 400 ``BadRequestError`` with vLLM's message.
    """
    if limit is None or body.get("features") is not None:
        return
    n = len(body["token_ids"])
    if n > limit:
        raise bad_request(
            f"The decoder prompt (length {n}) is longer than the maximum model length of {limit}. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens."
        )
    if n == limit:
        raise bad_request(
            f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) "
            f"is longer than the maximum model length of {limit}. Make sure that `max_model_len` is no "
            "smaller than the number of text tokens (prompt + requested output tokens)."
        )
