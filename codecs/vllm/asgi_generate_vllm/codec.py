"""The vLLM-native ``POST /inference/v1/generate`` codec: tokens in, tokens out.

Wire format: vLLM ``vllm/entrypoints/serve/disagg/`` (``protocol.py``,
``serving.py``, ``api_router.py``), summarised in
reference/engine-protocols.md section 2. Requests are checked as vLLM checks
them (:mod:`asgi_generate_vllm.schema`); every field passes to the engine
untouched except ``request_id``, ``stream`` and ``stream_options``.

Engine ids. The worker gets the attempt's minted id as both the
``X-Request-Id`` header and the body ``request_id``, so the engine runs it as
``generate-tokens-<minted id>`` (what ``POST /abort_requests`` names). The
client sees ``generate-tokens-<its id>`` in stream chunks (its
``X-Request-Id`` header, else its body ``request_id``, else the frontend's
request id standing in for vLLM's random uuid), and in a unary answer a
server-made id, as vLLM gives a fresh uuid there.

Every worker leg streams, with usage on. vLLM ends a stream with the usage
chunk *after* the chunk that carries ``finish_reason`` (and drops finish-only
chunks), so the request ends at the usage chunk: a ``finish_reason`` is held
until then, and the usage chunk reaches the client only if it asked. A unary
answer is rebuilt from the deltas into vLLM's ``GenerateResponse``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Mapping

import orjson

from asgi_generate.codec import (
    Attempt,
    Codec,
    EngineError,
    Event,
    Exchange,
    GenerateRequest,
    RequestError,
    Route,
    WorkerRequest,
)

from .schema import GENERATE_REQUEST, bad_request, check, check_features, validation_error

PATH = "/inference/v1/generate"
#: What vLLM puts before a request id to make the engine id.
ENGINE_PREFIX = "generate-tokens-"
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
_UNARY_LEG = (
    "asgi-generate streams every engine leg, and vLLM sends {what} only in non-streaming "
    "answers; send this request with \"stream\": true (vLLM then omits {what} too) until "
    "unary engine legs land."
)


@dataclass(slots=True)
class VLLMRequest:
    """The codec's parsed request (``GenerateRequest.native``).

    Attributes:
        body: the client's JSON object, as sent.
        public_id: ``X-Request-Id``, else the body ``request_id``, else ``None``.
        include_usage: the client asked for the closing usage chunk.
        continuous_usage: the client asked for usage on every chunk.
        logprobs: ``sampling_params.logprobs`` was set (0 included).
    """

    body: dict
    public_id: str | None
    include_usage: bool
    continuous_usage: bool
    logprobs: bool


class VLLMCodec(Codec):
    """vLLM ``POST /inference/v1/generate`` over vLLM workers."""

    name = "vllm"
    routes = (Route("POST", PATH),)
    worker_protocol = "vllm"

    def decode(self, body: bytes, headers: Mapping[bytes, bytes]) -> GenerateRequest:
        """Check a vLLM ``GenerateRequest`` body; ``X-Request-Id`` overrides
        ``request_id``. ``n`` must be 1, and a unary request may not ask for
        what vLLM sends only in unary answers (``prompt_logprobs``,
        ``kv_transfer_params`` of a prefill leg).

        Raises:
            RequestError: 400 in vLLM's validation shape (schema) or
                ``BadRequestError`` shape (values).
        """
        if not body:
            raise validation_error("missing", (), "Field required", None)
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise validation_error("json_invalid", (exc.pos,), "JSON decode error", {}, {"error": exc.msg}) from None
        check(obj, GENERATE_REQUEST)
        sp = obj["sampling_params"]
        n = sp.get("n", 1)
        if n < 1:
            raise bad_request(f"n must be at least 1, got {n}.")
        if n > 1:
            raise bad_request("n > 1 is not supported by asgi-generate yet; send n separate requests.", "n")
        max_tokens = sp.get("max_tokens")
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        for key in ("logprobs", "prompt_logprobs"):
            k = sp.get(key)
            if k is not None and k < -1:
                raise bad_request(f"{key} must be non-negative or -1, got {k}.", key)
        token_ids = obj["token_ids"]
        features = obj.get("features")
        if features is not None:
            check_features(features, len(token_ids))
        stream = bool(obj.get("stream"))
        if not stream:
            if sp.get("prompt_logprobs") is not None:
                raise bad_request(_UNARY_LEG.format(what="prompt_logprobs"), "prompt_logprobs")
            kv = obj.get("kv_transfer_params")
            if kv is not None and kv.get("do_remote_decode") is True:
                raise bad_request(_UNARY_LEG.format(what="kv_transfer_params"), "kv_transfer_params")
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
            logprobs=sp.get("logprobs") is not None,
        )
        return GenerateRequest(
            stream=stream,
            public_id=public_id,
            input_ids=token_ids if features is None else None,
            max_new_tokens=max_tokens,
            model=obj.get("model"),
            replay_excluded="multimodal" if features is not None else None,
            native=native,
        )

    def exchange(self, request: GenerateRequest, request_id: str) -> "VLLMExchange":
        """Per-request state; ``request_id`` stands in for vLLM's random uuids."""
        return VLLMExchange(request, request_id)

    def error_body(self, error: RequestError) -> bytes:
        """vLLM's nested ``{"error": {"message", "type", "param", "code"}}``."""
        status = error.status
        err_type = getattr(error, "err_type", None) or _ERROR_TYPES.get(status) or HTTPStatus(status).phrase
        param = getattr(error, "param", None)
        return orjson.dumps({"error": {"message": error.message, "type": err_type, "param": param, "code": status}})

    def in_band_error(self, error: RequestError) -> bytes:
        """The same object as an SSE payload, as vLLM streams errors."""
        return self.error_body(error)


def _bad_chunk(why: str) -> RequestError:
    return RequestError(502, f"worker sent a chunk that {why}", "engine")


class VLLMExchange(Exchange):
    """One vLLM request's state across worker attempts.

    Args:
        request: the decoded request.
        request_id: the frontend's id: the stream id when the client gave
            none, and the unary answer's ``request_id``.
    """

    __slots__ = (
        "req", "native", "stream_id", "server_id", "created",
        "token_ids", "content", "finish", "usage", "error", "out",
    )

    def __init__(self, request: GenerateRequest, request_id: str) -> None:
        self.req = request
        self.native: VLLMRequest = request.native
        public = self.native.public_id
        self.stream_id = ENGINE_PREFIX + (public if public is not None else request_id)
        self.server_id = request_id
        # The one clock read: vLLM stamps unary answers with the time it
        # accepted the request, and the codec API carries no request time.
        self.created = int(time.time())
        self.token_ids: list[int] = []
        self.content: list[dict] = []
        self.finish: str | None = None
        self.usage: dict | None = None
        self.error: dict | None = None
        self.out: bytes | None = None

    def worker_request(self, attempt: Attempt) -> WorkerRequest:
        """The client's body with the minted id, ``stream`` on and usage on
        (continuous usage only if the client asked for it)."""
        body = dict(self.native.body)
        body["request_id"] = attempt.engine_id
        body["stream"] = True
        body["stream_options"] = {
            **(body.get("stream_options") or {}),
            "include_usage": True,
            "continuous_usage_stats": self.native.continuous_usage,
        }
        headers = [(b"content-type", b"application/json"), (b"x-request-id", attempt.engine_id.encode())]
        return WorkerRequest(PATH.encode(), orjson.dumps(body), headers)

    def feed(self, attempt: Attempt, payload: bytes) -> Event:
        """One vLLM stream chunk: new token ids; the held finish reason and
        usage once the closing usage chunk arrives; or an engine error.

        Raises:
            RequestError: 502, the chunk is not a vLLM stream chunk.
        """
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise _bad_chunk("is not JSON") from None
        if type(chunk) is not dict:
            raise _bad_chunk("is not an object")
        err = chunk.get("error")
        if err is not None:
            self.error = err if type(err) is dict else {"message": str(err)}
            self.out = payload
            code = self.error.get("code")
            return Event([], error=EngineError(code if type(code) is int else 500, str(self.error.get("message", ""))))
        choices = chunk.get("choices")
        if type(choices) is not list:
            raise _bad_chunk("has no choices list")
        chunk["request_id"] = self.stream_id
        if not choices:  # the closing usage chunk
            usage = chunk.get("usage")
            if type(usage) is not dict:
                raise _bad_chunk("has neither choices nor usage")
            self.usage = usage
            self.out = orjson.dumps(chunk) if self.native.include_usage else None
            details = usage.get("prompt_tokens_details")
            return Event(
                [],
                # vLLM drops the finish-only chunk of an aborted request.
                self.finish or "abort",
                prompt_tokens=usage.get("prompt_tokens"),
                completion_tokens=usage.get("completion_tokens"),
                cached_tokens=details.get("cached_tokens") if type(details) is dict else None,
            )
        choice = choices[0]
        ids = choice.get("token_ids") if type(choice) is dict else None
        if type(ids) is not list or not all(type(t) is int for t in ids):
            raise _bad_chunk("has no token_ids list")
        self.token_ids.extend(ids)
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        logprobs = choice.get("logprobs")
        if type(logprobs) is dict and type(logprobs.get("content")) is list:
            self.content.extend(logprobs["content"])
        self.out = orjson.dumps(chunk)
        return Event(ids)

    def client_event(self, event: Event) -> bytes | None:
        """The worker's chunk with the client's id, or nothing for a usage
        chunk the client did not ask for."""
        return self.out

    def unary_body(self) -> tuple[int, bytes]:
        """vLLM's ``GenerateResponse`` rebuilt from the deltas (``routed_experts``,
        ``prompt_logprobs`` and the transfer params null, as streams carry
        none), or the engine error with its status."""
        if self.error is not None:
            code = self.error.get("code")
            return (code if type(code) is int else 500), orjson.dumps({"error": self.error})
        usage = self.usage  # set: only the usage chunk ends a stream without error
        return 200, orjson.dumps(
            {
                "request_id": self.server_id,
                "model": self.req.model,
                "created": self.created,
                "choices": [
                    {
                        "index": 0,
                        "logprobs": {"content": self.content} if self.native.logprobs else None,
                        "finish_reason": self.finish or "abort",
                        "token_ids": self.token_ids,
                        "routed_experts": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "total_tokens": usage.get("total_tokens"),
                    "completion_tokens": usage.get("completion_tokens"),
                    "prompt_tokens_details": usage.get("prompt_tokens_details"),
                },
                "prompt_logprobs": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
            }
        )

    def worker_error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """vLLM workers already answer in this format's shapes: pass through."""
        return status, body
