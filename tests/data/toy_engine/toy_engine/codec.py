"""The toy generate format.

Client: ``POST /toy/generate`` ``{"tokens": [int], "max": int, "stream":
bool}``; unary answer ``{"tokens": [int], "finish": str}``, streamed answer
one ``{"t": [int], "done": str | null}`` event per token, then ``[DONE]``.
Worker: ``POST /toy_generate`` ``{"id", "tokens", "max", "stream"}``; a
prefill leg adds ``"prefill": true`` and is answered ``{"handle": str}``, a
decode leg carries that ``handle``.
"""

from __future__ import annotations

from typing import Mapping

import orjson

from asgi_generate.sdk import (Attempt, Codec, EngineError, Event, Exchange, GenerateRequest, RequestError, Route,
                               WorkerRequest)

JSON = [(b"content-type", b"application/json")]


class ToyExchange(Exchange):
    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.finish: str | None = None

    def worker_request(self, attempt: Attempt) -> WorkerRequest:
        body = {"id": attempt.engine_id, "tokens": list(self.request.input_ids or ()),
                "max": self.request.max_new_tokens, "stream": self.request.stream}
        if attempt.role == "prefill":
            return WorkerRequest(b"/toy_generate", orjson.dumps({**body, "max": 1, "stream": False, "prefill": True}),
                                 JSON, stream=False)
        if attempt.role == "decode":
            body["handle"] = attempt.pair.from_prefill
        return WorkerRequest(b"/toy_generate", orjson.dumps(body), JSON, stream=self.request.stream)

    def feed(self, attempt: Attempt, payload: bytes) -> Event:
        obj = orjson.loads(payload)
        if "error" in obj:
            return Event([], error=EngineError(502, str(obj["error"])))
        if attempt.role == "prefill":
            attempt.pair.from_prefill = obj["handle"]
            return Event([], finish_reason="length")
        self.tokens += obj["t"]
        self.finish = obj["done"]
        return Event(list(obj["t"]), finish_reason=obj["done"])

    def client_event(self, event: Event) -> bytes | None:
        return orjson.dumps({"t": event.token_ids, "done": event.finish_reason})

    def unary_body(self) -> tuple[int, bytes]:
        return 200, orjson.dumps({"tokens": self.tokens, "finish": self.finish})

    def worker_error(self, status: int, body: bytes) -> tuple[int, bytes]:
        return status, body


class ToyCodec(Codec):
    """The toy format, on the toy engine."""

    name = "toy"
    routes = (Route("POST", "/toy/generate"),)
    worker_protocol = "toy"

    def decode(self, body: bytes, headers: Mapping[bytes, bytes]) -> GenerateRequest:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise RequestError(400, "the body is not JSON", "invalid_json") from None
        tokens, most = obj.get("tokens"), obj.get("max")
        if not isinstance(tokens, list) or not tokens or type(most) is not int or most < 1:
            raise RequestError(400, "expected tokens (a non-empty list) and max (an integer >= 1)", "invalid_request")
        return GenerateRequest(stream=obj.get("stream") is True, input_ids=tokens, max_new_tokens=most)

    def exchange(self, request: GenerateRequest, request_id: str) -> Exchange:
        return ToyExchange(request)

    def error_body(self, error: RequestError) -> bytes:
        return orjson.dumps({"error": error.message})

    def in_band_error(self, error: RequestError) -> bytes:
        return orjson.dumps({"error": error.message})
