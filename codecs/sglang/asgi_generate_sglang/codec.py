"""The SGLang-native ``POST|PUT /generate`` codec.

Wire format: SGLang ``http_server.py`` / ``io_struct.GenerateReqInput`` as
summarised in reference/engine-protocols.md section 1. Requests are checked
field by field for the fields the frontend relies on; every other field, top
level or inside ``sampling_params``, passes to the engine untouched. Answers
are the engine's own objects with ``meta_info.id`` restored to the client's
``rid``: cumulative SSE chunks, or deltas when the worker runs with
``--incremental-streaming-output``.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Mapping

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
    dump_body,
    engine_error_page,
)

# Set by the frontend for P/D; a client setting them could stall a decode
# engine waiting on a bootstrap room nobody fills.
FRONTEND_OWNED = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")
MULTIMODAL = ("image_data", "video_data", "audio_data")
_BOOL, _INT, _NUM, _STR = "boolean", "integer", "number", "string"
TOP_LEVEL_TYPES = {
    "stream": _BOOL,
    "rid": _STR,
    "return_logprob": _BOOL,
    "logprob_start_len": _INT,
    "top_logprobs_num": _INT,
    "return_text_in_logprobs": _BOOL,
    "return_routed_experts": _BOOL,
    "routed_experts_start_len": _INT,
    "priority": _INT,
}
SAMPLING_TYPES = {
    "max_new_tokens": _INT,
    "min_new_tokens": _INT,
    "n": _INT,
    "temperature": _NUM,
    "top_p": _NUM,
    "top_k": _INT,
    "min_p": _NUM,
    "frequency_penalty": _NUM,
    "presence_penalty": _NUM,
    "repetition_penalty": _NUM,
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "no_stop_trim": _BOOL,
}
# meta_info lists that arrive as deltas in incremental mode.
_LOGPROB_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)


def _is(value: Any, kind: str) -> bool:
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


def _check_types(obj: dict, types: dict[str, str], where: str) -> None:
    for key, kind in types.items():
        value = obj.get(key)
        if value is not None and not _is(value, kind):
            raise RequestError(
                400,
                f"{where}{key}: Input should be a valid {kind}, got {type(value).__name__} "
                f"{orjson.dumps(value).decode()[:64]}",
                "invalid_json",
            )


def _int_list(value: Any) -> bool:
    return type(value) is list and all(type(t) is int for t in value)


class SGLangCodec(Codec):
    """SGLang ``/generate`` over SGLang workers (``POST`` and ``PUT``)."""

    name = "sglang"
    routes = (Route("POST", "/generate"), Route("PUT", "/generate"))
    worker_protocol = "sglang"

    def decode(self, body: bytes, headers: Mapping[bytes, bytes]) -> GenerateRequest:
        """Check an SGLang request; see the module docstring.

        Raises:
            RequestError: 400 with SGLang's schema-error shape for bad JSON or
                wrong types, or its ``{"error": {...}}`` shape for bad values.
        """
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise RequestError(400, f"JSON decode error: {exc}", "invalid_json") from None
        if type(obj) is not dict:
            raise RequestError(
                400,
                "Input should be a valid dictionary or object to extract fields from",
                "invalid_json",
            )
        _check_types(obj, TOP_LEVEL_TYPES, "")
        sp = obj.get("sampling_params")
        if sp is None:
            sp = {}
        elif type(sp) is list:
            raise RequestError(400, "Batch requests (a list of sampling_params) are not supported.")
        elif type(sp) is not dict:
            raise RequestError(400, "sampling_params: Input should be a valid dictionary", "invalid_json")
        _check_types(sp, SAMPLING_TYPES, "sampling_params.")
        stop_ids = sp.get("stop_token_ids")
        if stop_ids is not None and not _int_list(stop_ids):
            raise RequestError(400, "sampling_params.stop_token_ids: Input should be a valid list of integers", "invalid_json")
        stop = sp.get("stop")
        if stop is not None and not (
            type(stop) is str or (type(stop) is list and all(type(s) is str for s in stop))
        ):
            raise RequestError(400, "sampling_params.stop: Input should be a string or a list of strings", "invalid_json")
        if sp.get("n", 1) not in (1, None):
            raise RequestError(400, "n > 1 is not supported by asgi-generate yet; send n separate requests.")
        max_new = sp.get("max_new_tokens", 128)
        if max_new is not None and max_new < 0:
            raise RequestError(400, "max_new_tokens must be at least 0.")
        if (obj.get("top_logprobs_num") or 0) < 0:
            raise RequestError(400, "top_logprobs_num must be at least 0.")
        for key in FRONTEND_OWNED:
            if obj.get(key) is not None:
                raise RequestError(400, f"{key} is set by the frontend for prefill/decode routing; do not send it.")

        text, input_ids = obj.get("text"), obj.get("input_ids")
        given = [k for k in ("text", "input_ids", "input_embeds") if obj.get(k) is not None]
        if len(given) != 1:
            raise RequestError(400, "Either text, input_ids or input_embeds should be provided.")
        excluded = None
        if input_ids is not None:
            if type(input_ids) is not list:
                raise RequestError(400, "input_ids: Input should be a valid list", "invalid_json")
            if input_ids and type(input_ids[0]) is list:
                raise RequestError(400, "Batch requests (a list of input_ids lists) are not supported.")
            if not _int_list(input_ids):
                raise RequestError(400, "input_ids: Input should be a valid list of integers", "invalid_json")
            if not input_ids:
                raise RequestError(400, "input_ids is empty: at least one token id is required.")
            if min(input_ids) < 0:
                raise RequestError(400, f"input_ids: token id {min(input_ids)} is negative.")
            ids = input_ids
        elif text is not None:
            if type(text) is list:
                raise RequestError(400, "Batch requests (a list of texts) are not supported.")
            if type(text) is not str:
                raise RequestError(400, "text: Input should be a valid string", "invalid_json")
            ids, excluded = None, "text"
        else:
            ids, excluded = None, "embeddings"
        if any(obj.get(k) is not None for k in MULTIMODAL):
            ids, excluded = None, "multimodal"
        if obj.get("rid") is not None and type(obj.get("rid")) is not str:
            raise RequestError(400, "rid: Input should be a valid string", "invalid_json")
        return GenerateRequest(
            stream=bool(obj.get("stream", False)),
            public_id=obj.get("rid"),
            input_ids=ids,
            max_new_tokens=max_new,
            model=None,
            replay_excluded=excluded,
            native=obj,
        )

    def exchange(self, request: GenerateRequest, request_id: str) -> "SGLangExchange":
        """Per-request state; the client sees ``rid``, or ``request_id`` if it sent none."""
        public = request.public_id
        return SGLangExchange(request, public if public is not None else request_id)

    def error_body(self, error: RequestError) -> bytes:
        """SGLang's error shapes: FastAPI-style for schema errors and statuses
        other than 400, ``{"error": {"message"}}`` for bad values."""
        if error.status == 400 and error.kind != "invalid_json":
            return orjson.dumps({"error": {"message": error.message}})
        kind = HTTPStatus(error.status).phrase if error.status < 500 else str(error.status)
        return orjson.dumps(
            {"object": "error", "message": error.message, "type": kind, "param": None, "code": error.status}
        )

    def in_band_error(self, error: RequestError) -> bytes:
        """``{"error": {"message", "type", "code"}}``, as newer SGLang streams it."""
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        return orjson.dumps({"error": {"message": error.message, "type": kind, "code": error.status}})


class SGLangExchange(Exchange):
    """One SGLang request's state across worker attempts."""

    __slots__ = (
        "request", "public_id", "seen", "last", "merged", "incremental", "payload", "engine_tag",
        "public_tag",
    )

    def __init__(self, request: GenerateRequest, public_id: str) -> None:
        self.request = request
        self.public_id = public_id
        self.seen = 0
        self.last: dict | None = None
        self.merged: dict | None = None
        self.incremental = False
        self.payload = b""
        self.engine_tag = b""
        self.public_tag = orjson.dumps(public_id)

    def worker_request(self, attempt: Attempt) -> WorkerRequest:
        """The client's body with ``rid`` minted. A unary client gets a unary
        engine leg: the engine's one answer, passed through."""
        body = dict(self.request.native)
        body["rid"] = attempt.engine_id
        stream = self.request.stream
        self.incremental = stream and bool(attempt.worker_info.get("incremental_streaming_output"))
        self.engine_tag = orjson.dumps(attempt.engine_id)
        return WorkerRequest(b"/generate", dump_body(body), stream=stream)

    def feed(self, attempt: Attempt, payload: bytes) -> Event:
        """One SGLang chunk (or the unary answer): the new output ids, the
        finish type and matched stop, usage."""
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise RequestError(502, "worker sent a chunk that is not JSON", "engine") from None
        if type(chunk) is not dict:
            raise RequestError(502, "worker sent a chunk that is not an object", "engine")
        self.payload = payload
        meta = chunk.get("meta_info")
        if type(meta) is not dict:
            err = chunk.get("error")
            message = err.get("message", "") if type(err) is dict else str(err)
            code = err.get("code", 400) if type(err) is dict else 400
            self.last = chunk
            return Event([], error=EngineError(code if type(code) is int else 400, message))
        meta["id"] = self.public_id
        ids = chunk.get("output_ids") or []
        if self.incremental:
            new = ids
            self._merge(chunk)
        else:
            new = ids[self.seen :]
        self.seen += len(new)
        self.last = chunk
        finish = meta.get("finish_reason")
        is_dict = type(finish) is dict
        return Event(
            new,
            finish.get("type") if is_dict else None,
            matched=finish.get("matched") if is_dict else None,
            prompt_tokens=meta.get("prompt_tokens"),
            completion_tokens=meta.get("completion_tokens"),
            cached_tokens=meta.get("cached_tokens"),
        )

    def _merge(self, chunk: dict) -> None:
        merged = self.merged
        if merged is None:
            self.merged = {
                **chunk,
                "output_ids": list(chunk.get("output_ids") or []),
                "meta_info": {
                    k: list(v) if k in _LOGPROB_KEYS and type(v) is list else v
                    for k, v in chunk["meta_info"].items()
                },
            }
            return
        merged["text"] = merged.get("text", "") + chunk.get("text", "")
        merged["output_ids"].extend(chunk.get("output_ids") or [])
        meta = merged["meta_info"]
        for key, value in chunk["meta_info"].items():
            if key in _LOGPROB_KEYS and type(value) is list and type(meta.get(key)) is list:
                meta[key].extend(value)
            else:
                meta[key] = value

    def client_event(self, event: Event) -> bytes | None:
        """The worker's chunk, ``meta_info.id`` restored."""
        return self._restored()

    def _restored(self) -> bytes:
        # The minted engine id is a unique 32-hex string, so swapping it in
        # the worker's own bytes restores the client's id without
        # re-serialising: the client gets the engine's bytes.
        if self.engine_tag in self.payload:
            return self.payload.replace(self.engine_tag, self.public_tag, 1)
        return orjson.dumps(self.last)

    def unary_body(self) -> tuple[int, bytes]:
        """The final object; an engine error or a non-200 abort becomes SGLang's
        error status and shape."""
        final = self.merged if self.incremental and self.merged is not None else self.last
        if final is None:
            raise RequestError(502, "worker ended the response without output", "engine")
        if "meta_info" not in final:
            err = final.get("error")
            code = err.get("code", 400) if type(err) is dict else 400
            return (code if type(code) is int else 400), orjson.dumps({"error": err})
        finish = final["meta_info"].get("finish_reason")
        if type(finish) is dict and finish.get("type") == "abort":
            status = finish.get("status_code") or 200
            if type(status) is int and status >= 400:
                message = finish.get("message", "")
                if status == 400:
                    return 400, orjson.dumps({"error": {"message": message}})
                return status, orjson.dumps(
                    {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
                )
        if final is self.last and self.payload:
            return 200, self._restored()
        return 200, orjson.dumps(final)

    def worker_error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """SGLang workers answer in this format's shapes: pass through; a
        body that is not JSON (a bare server error page) gets SGLang's shape."""
        return engine_error_page(status, body, SGLangCodec().error_body)
