"""vLLM's native tokens-in/tokens-out protocol, as the simulator speaks it.

Follows vLLM ``ServingTokens`` and its models
(``vllm/entrypoints/scale_out/token_in_token_out/{protocol,serving,
api_router}.py``, read from the released wheels) for a server run with
``--tokens-only``, as the vLLM version it plays answers (``sim
--engine-version``, 0.25.0 and later; the behaviours that differ are listed
in :mod:`asgi_generate.workers.versions`):

- ``POST /inference/v1/generate``: the engine id is ``generate-tokens-`` plus
  the ``X-Request-Id`` header, else the body ``request_id``, else a random
  uuid. Unary answers are ``GenerateResponse`` objects (``model_dump``, nulls
  included, ``request_id`` the engine id); SSE answers are delta chunks
  carrying the engine id, one step of one choice each (one token; several,
  as vLLM sends under load, with ``sim --stream-interval N``), then the usage
  chunk if ``stream_options.include_usage`` (``exclude_none``; never with
  ``usage_chunk`` off, ``sim --no-usage-chunk``, like a build that sends
  none), then ``[DONE]``. An aborted request's finish-only chunk is dropped
  by versions before 0.32 (they skip outputs without tokens) and sent by
  later ones. Prompt logprobs appear only in unary answers. The field layout
  is the played version's (0.32 added ``stop_reason``, ``sampling_mask``,
  ``weight_versions``, ``output_mode`` and the prompt fields).
- ``n`` choices (``sampling_params.n``, at most the server's ``max_num_seqs``,
  256): the model is greedy, so every choice carries the same tokens; usage
  counts all of them.
- Logprobs, before 0.32: ``"token_id:N"`` labels with ``bytes`` null;
  from 0.32: ``GenerateLogProb`` entries (integer ``token_id``, ``logprob``,
  ``rank``). ``top_logprobs`` is the sampled token, then the top-k without
  it (the greedy token is always in the top-k, so ``max(k, 1)`` entries in
  every version); prompt logprobs map each prompt token,
  then the top-k, to ``{logprob, rank, decoded_token}`` (``decoded_token``
  null: tokens-only mode does not detokenize). Newer versions add each
  choice's ``stop_reason``: the matched stop token id, null for EOS or a cap.
- Refusals in vLLM's order: the request schema (``GenerateRequest``;
  unknown fields are ignored, numbers and booleans read as pydantic's lax
  mode reads them), ``SamplingParams._verify_args``
  (``vllm/sampling_params.py``; built inside pydantic's validation by
  ``PydanticMsgspecMixin``, so its refusals are validation errors after the
  failed ``is-instance`` branch, ``param`` the field a
  ``VLLMValidationError`` names), rendered as the played version's
  ``validation_exception_handler`` does (from 0.30 a cleaned dotted ``loc``
  and a bounded ``input``, before pydantic's tuple and the whole input), then
  ``serve_tokens``
  (unknown model, ``n`` above ``max_num_seqs``, stop strings on a tokens-only
  server: 0.31 and later refuse them, older ones accept and never apply
  them), then the input checks (logprob counts, vocabulary, the prompt
  against ``max_model_len``). ``max_tokens`` beyond the context stops
  generation at the context end, or is refused from 0.34 (vLLM main after
  0.33.0; its message here is the simulator's own); the int32 overflow that
  kills a 0.33 engine on a huge value is not simulated.
- ``POST /abort_requests`` ``{"request_ids": [...]}``: exact (prefixed) ids,
  200 with an empty body; missing ids or bad JSON are 400.
- ``GET /version``: ``{"version": V}`` (vLLM ``show_version``).
- A client disconnect aborts its request at once (vLLM's
  ``with_cancellation``).

Errors are vLLM's nested ``{"error": {"message", "type", "param", "code"}}``:
schema errors in the shape of vLLM's ``RequestValidationError`` handler, bad
values as ``BadRequestError``, an unknown model as 404 ``NotFoundError``.

Generation is the shared deterministic :class:`~asgi_generate.sim.model.Model`,
greedy, so a prefix gives the same tokens here as in SGLang mode. Sampling
knobs other than ``n``, ``max_tokens``, ``stop_token_ids``, ``ignore_eos``,
``logprobs`` and ``prompt_logprobs`` are checked and then ignored;
multimodal ``features`` are checked and the answer depends on the token ids
alone; ``routed_experts`` and ``kv_transfer_params`` are always null (no
flags for them are simulated).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import anyio
import orjson

from ..framing import SSE_HEADERS, Receive, Send, send_unary, sse_event
from ..pydantic_lax import LaxError, lax_scalar
from ..workers.versions import VLLM_DEFAULT_VERSION, VLLM_OLDEST_PLAYED, VLLMBehaviour, parse_version, vllm_behaviour
from .engine import DuplicateRequestId, Job, SimEngine, Token
from .kvconnector import KVConsumer, KVProducer
from .model import NUM_CANDIDATES

DONE = b"data: [DONE]\n\n"
ENGINE_PREFIX = "generate-tokens-"
MAX_MODEL_LEN = 32768
#: vLLM's default ``--max-logprobs``; the model ranks exactly this many.
MAX_LOGPROBS = NUM_CANDIDATES
#: vLLM's default ``--max-num-seqs``: the most choices one request may ask.
MAX_NUM_SEQS = 256
LOGPROB_FLOOR = -9999.0


class VLLMError(Exception):
    """An error vLLM answers before generating: ``status`` and JSON body."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body)
        self.status = status
        self.body = body


def error(message: str, err_type: str = "BadRequestError", status: int = 400, param: str | None = None) -> VLLMError:
    """vLLM's ``create_error_response`` shape."""
    return VLLMError(status, {"error": {"message": message, "type": err_type, "param": param, "code": status}})


def _summarize(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


#: The ``loc`` segment pydantic adds inside ``SamplingParams`` (built by
#: ``PydanticMsgspecMixin`` as a function-after over a typed dict).
_SP_MARKER = "function-after[_validate_msgspec(), typed-dict]"
_INTERNAL = re.compile(r"[\[\]{}()]")
#: Segments of pydantic's schema kinds that vLLM drops from a ``loc``.
_MARKERS = frozenset((
    "function-wrap function-after function-before function-plain json-or-python lax-or-strict chain default "
    "nullable tagged-union union call arguments is-instance is-subclass callable str int float bool bytes "
    "bytearray list tuple dict set frozenset complex none nonetype"
).split())


class Invalid(Exception):
    """Pydantic's errors for a request body: dicts with ``type``, ``loc``
    (a tuple under ``body``), ``msg``, ``input`` and maybe ``ctx``."""

    def __init__(self, errors: list[dict]) -> None:
        super().__init__(errors)
        self.errors = errors


def invalid(kind: str, loc: tuple, msg: str, value: Any, ctx: dict | None = None) -> Invalid:
    """One pydantic error at ``loc`` (a path under ``body``)."""
    err: dict[str, Any] = {"type": kind, "loc": ("body", *loc), "msg": msg, "input": value}
    if ctx is not None:
        err["ctx"] = ctx
    return Invalid([err])


def _clean_loc(loc: tuple) -> str:
    """vLLM's ``clean_loc_for_param``: the dotted path without pydantic's
    internal segments."""
    parts = [str(p) for p in loc if not _INTERNAL.search(str(p)) and str(p).lower() not in _MARKERS]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def render_invalid(errors: list[dict], cleaned: bool) -> VLLMError:
    """vLLM's ``validation_exception_handler``: 400, ``param`` the parameter
    a ``VLLMValidationError`` names, else the first error's cleaned ``loc``;
    from 0.30 each error shows its cleaned ``loc`` and a bounded ``input``,
    before it pydantic's own (``loc`` tuple, whole ``input``)."""
    param = next((e["ctx"]["error"].parameter for e in errors
                  if isinstance(e.get("ctx", {}).get("error"), VLLMValidationError)), None)
    if param is None:
        param = _clean_loc(errors[0]["loc"])
    shown = []
    for e in errors:
        if cleaned:
            e = {**e, "loc": _clean_loc(e["loc"]), "input": _summarize(e["input"])}
        shown.append(str(e))
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {t}\n" for t in shown)
    return error(message.rstrip(), "Bad Request", 400, param)


# Schema nodes as in asgi_generate_vllm.schema (the frontend's copy of the
# same vLLM models): ("int",), ("float",), ("str",), ("bool",), ("any",),
# ("stop",), ("nullable", n), ("list", n), ("dict", n),
# ("model", {field: n}, required).
def _lax(kind: str, value: Any, loc: tuple) -> Any:
    """A JSON scalar as pydantic's lax mode reads it for ``kind``."""
    try:
        return lax_scalar(kind, value)
    except LaxError as exc:
        raise invalid(exc.kind, loc, exc.msg, value) from None


INT, FLOAT, STR, BOOL, ANY = ("int",), ("float",), ("str",), ("bool",), ("any",)
_PLACEHOLDER = ("model", {"offset": INT, "length": INT}, ("offset", "length"))
_FEATURES = (
    "model",
    {
        "mm_hashes": ("dict", ("list", STR)),
        "mm_placeholders": ("dict", ("list", _PLACEHOLDER)),
        "kwargs_data": ("nullable", ("dict", ("list", ("nullable", STR)))),
    },
    ("mm_hashes", "mm_placeholders"),
)
# The SamplingParams fields the simulator reads or checks (vllm/sampling_params.py).
_SAMPLING = (
    "model",
    {
        "n": INT,
        "presence_penalty": FLOAT,
        "frequency_penalty": FLOAT,
        "repetition_penalty": FLOAT,
        "temperature": FLOAT,
        "top_p": FLOAT,
        "top_k": INT,
        "min_p": FLOAT,
        "seed": ("nullable", INT),
        "stop": ("nullable", ("stop",)),
        "stop_token_ids": ("nullable", ("list", INT)),
        "ignore_eos": BOOL,
        "max_tokens": ("nullable", INT),
        "min_tokens": INT,
        "logprobs": ("nullable", INT),
        "prompt_logprobs": ("nullable", INT),
        "detokenize": BOOL,
    },
    (),
)
_REQUEST = (
    "model",
    {
        "request_id": STR,
        "token_ids": ("token_ids",),
        "features": ("nullable", _FEATURES),
        "sampling_params": ("sampling",),
        "model": ("nullable", STR),
        "stream": ("nullable", BOOL),
        "stream_options": (
            "nullable",
            ("model", {"include_usage": ("nullable", BOOL), "continuous_usage_stats": ("nullable", BOOL)}, ()),
        ),
        "cache_salt": ("nullable", STR),
        "priority": INT,
        "kv_transfer_params": ("nullable", ("dict", ANY)),
        "ec_transfer_params": ("nullable", ("dict", ANY)),
    },
    ("token_ids", "sampling_params"),
)


def _validate(value: Any, node: tuple, loc: tuple = ()) -> Any:
    """``value`` as pydantic validates it against ``node`` (lax numbers and
    booleans, unknown fields dropped); ``loc`` is its path under ``body``.

    Raises:
        Invalid: the first error, in field order (``stop``'s union: one error
            per branch).
    """
    kind = node[0]
    if kind == "any" or (kind == "nullable" and value is None):
        return value
    if kind == "nullable":
        return _validate(value, node[1], loc)
    if kind == "sampling":
        return _validate_sampling(value)
    if kind == "token_ids":  # list[int] = Field(min_length=1), none negative
        ids = _validate(value, ("list", INT), loc)
        if not ids:
            raise invalid("too_short", loc, "List should have at least 1 item after validation, not 0", value,
                          {"field_type": "List", "min_length": 1, "actual_length": 0})
        if min(ids) < 0:
            why = "token_ids must not contain negative values"
            raise invalid("value_error", loc, f"Value error, {why}", value, {"error": ValueError(why)})
        return ids
    if kind == "stop":  # str | list[str]
        if type(value) is str:
            return value
        try:
            return _validate(value, ("list", STR), (*loc, "list[str]"))
        except Invalid as exc:
            branch = invalid("string_type", (*loc, "str"), "Input should be a valid string", value)
            raise Invalid(branch.errors + exc.errors) from None
    if kind in ("int", "float", "str", "bool"):
        return _lax(kind, value, loc)
    if kind == "list":
        if type(value) is not list:
            raise invalid("list_type", loc, "Input should be a valid list", value)
        return [_validate(v, node[1], (*loc, i)) for i, v in enumerate(value)]
    if kind == "dict":
        if type(value) is not dict:
            raise invalid("dict_type", loc, "Input should be a valid dictionary", value)
        return {key: _validate(v, node[1], (*loc, key)) for key, v in value.items()}
    if type(value) is not dict:
        raise invalid(
            "model_attributes_type", loc, "Input should be a valid dictionary or object to extract fields from", value
        )
    out = {}
    for key, sub in node[1].items():
        if key in value:
            out[key] = _validate(value[key], sub, (*loc, key))
        elif key in node[2]:
            raise invalid("missing", (*loc, key), "Field required", value)
    return out


def _validate_sampling(value: Any) -> dict:
    """``sampling_params``: the typed dict, then ``SamplingParams``' own
    checks (``_verify_args``, run as pydantic builds it). Every error comes
    after the failed ``is-instance`` branch of the union
    ``PydanticMsgspecMixin`` builds."""
    loc = ("sampling_params", _SP_MARKER)
    try:
        if type(value) is not dict:
            raise invalid("dict_type", loc, "Input should be a valid dictionary", value)
        sp = _validate(value, _SAMPLING, loc)
        try:
            _verify_args(sp)
        except ValueError as exc:
            raise invalid("value_error", loc, f"Value error, {exc}", value, {"error": exc}) from None
        return sp
    except Invalid as exc:
        first = {"type": "is_instance_of", "loc": ("body", "sampling_params", "is-instance[SamplingParams]"),
                 "msg": "Input should be an instance of SamplingParams", "input": value,
                 "ctx": {"class": "SamplingParams"}}
        raise Invalid([first, *exc.errors]) from None


class VLLMValidationError(ValueError):
    """vLLM's ``VLLMValidationError`` (``vllm/exceptions.py``): a
    ``ValueError`` naming the parameter and value it refused."""

    def __init__(self, message: str, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        extras = [f"{k}={v}" for k, v in (("parameter", self.parameter), ("value", self.value)) if v is not None]
        return f"{super().__str__()} ({', '.join(extras)})" if extras else super().__str__()


def _verify_args(sp: dict) -> None:
    def f(key: str, default: float) -> float:
        return float(sp.get(key, default))

    n = sp.get("n", 1)
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}.")
    for key in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= f(key, 0.0) <= 2.0:
            raise ValueError(f"{key} must be in [-2, 2], got {f(key, 0.0)}.")
    if f("repetition_penalty", 1.0) <= 0.0:
        raise ValueError(f"repetition_penalty must be greater than zero, got {f('repetition_penalty', 1.0)}.")
    t = f("temperature", 1.0)
    if t < 0.0:
        raise VLLMValidationError(f"temperature must be non-negative, got {t}.", "temperature", t)
    if t > 2.0:
        raise VLLMValidationError(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    if not 0.0 < f("top_p", 1.0) <= 1.0:
        raise VLLMValidationError(f"top_p must be in (0, 1], got {f('top_p', 1.0)}.", "top_p", f("top_p", 1.0))
    if sp.get("top_k", 0) < -1:
        raise ValueError(f"top_k must be 0 (disable), or at least 1, got {sp['top_k']}.")
    if not 0.0 <= f("min_p", 0.0) <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {f('min_p', 0.0)}.")
    max_tokens = sp.get("max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise VLLMValidationError(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    min_tokens = sp.get("min_tokens", 0)
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:
        raise ValueError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    for key in ("logprobs", "prompt_logprobs"):
        k = sp.get(key)
        if k is not None and k != -1 and k < 0:
            raise VLLMValidationError(f"{key} must be non-negative or -1, got {k}.", key, k)
    stop = _stop_strings(sp)
    if any(not s for s in stop):
        raise ValueError("stop cannot contain an empty string.")
    if stop and not sp.get("detokenize", True):
        raise ValueError("stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")


def _stop_strings(sp: dict) -> list[str]:
    stop = sp.get("stop")
    return [] if stop is None else [stop] if isinstance(stop, str) else stop


def _check_features(features: dict, num_tokens: int) -> None:
    # The engine needs one hash and one in-prompt range per item.
    hashes, places = features["mm_hashes"], features["mm_placeholders"]
    data = features.get("kwargs_data") or {}
    if set(hashes) != set(places) or not set(data) <= set(hashes):
        raise error("features: mm_hashes, mm_placeholders and kwargs_data name different modalities.", param="features")
    for modality, items in hashes.items():
        ranges = places[modality]
        if len(ranges) != len(items) or (modality in data and len(data[modality]) != len(items)):
            raise error(f"features: {modality!r} items do not match their hashes one to one.", param="features")
        for p in ranges:
            if p["offset"] < 0 or p["length"] < 1 or p["offset"] + p["length"] > num_tokens:
                raise error(f"features: a {modality!r} placeholder lies outside the prompt.", param="features")


@dataclass(slots=True)
class Options:
    """What shapes one answer besides the tokens.

    ``logprobs``/``prompt_logprobs`` are the requested k (``None`` = off);
    ``n`` the number of choices.
    """

    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None
    prompt_logprobs: int | None
    n: int = 1
    kv_transfer_params: dict | None = None


class VLLMProtocol:
    """Answers vLLM ``/inference/v1/generate`` and ``/abort_requests`` for a
    sim engine, as vLLM ``version`` does.

    Args:
        engine: the shared simulator engine.
        vocab_size: token ids at or above this are out of vocabulary.
        model_name: the served model name (``model`` in answers).
        usage_chunk: end a stream with the usage chunk when it asks for one;
            off, act as a vLLM build that never sends it (the stream ends
            after its finishing chunk).
        version: the vLLM version played (``GET /version``): any version
            string from 0.25.0 on (see
            :data:`~asgi_generate.workers.versions.VLLM_VERSIONS`).

    Raises:
        ValueError: ``version`` is not a version the simulator can play.
    """

    def __init__(
        self,
        engine: SimEngine,
        vocab_size: int,
        model_name: str = "sim",
        usage_chunk: bool = True,
        version: str = VLLM_DEFAULT_VERSION,
        stream_interval: int = 1,
        kv: KVProducer | KVConsumer | None = None,
    ) -> None:
        behaviour = vllm_behaviour(version)
        if behaviour is None:
            raise ValueError(f"not a vLLM version: {version!r}")
        if parse_version(version) < VLLM_OLDEST_PLAYED:
            raise ValueError(f"the simulator plays vLLM 0.25.0 and later, not {version}")
        self.engine = engine
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.usage_chunk = usage_chunk
        #: Tokens per streamed chunk: an engine step under load yields several.
        self.stream_interval = stream_interval
        self.behaviour: VLLMBehaviour = behaviour
        #: P/D: the KV connector of a producer (prefill) or consumer (decode).
        self.kv = kv

    @property
    def version(self) -> str:
        """The vLLM version played."""
        return self.behaviour.version

    # -- request parsing -------------------------------------------------

    def parse(self, body: bytes, headers: Mapping[bytes, bytes]) -> tuple[Job, Options]:
        """Check a request and build its job; ``headers`` has lower-case names.

        Raises:
            VLLMError: vLLM's status and body for the bad input.
        """
        media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if media != b"application/json":
            raise error(
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                "Bad Request",
            )
        try:
            obj = self._validated(body)
        except Invalid as exc:
            raise render_invalid(exc.errors, self.behaviour.clean_validation_errors) from None
        ids = obj["token_ids"]
        sp = obj["sampling_params"]
        model = obj.get("model")
        if model is not None and model != self.model_name:
            raise error(f"The model `{model}` does not exist.", "NotFoundError", 404, "model")
        n = sp.get("n", 1)
        if n > MAX_NUM_SEQS:
            raise error(f"sampling_params.n must be at most the server's max_num_seqs ({MAX_NUM_SEQS}), got {n}.")
        if self.behaviour.refuses_stop_strings and _stop_strings(sp):
            raise error(
                "stop strings are not supported on a --tokens-only server because detokenization is disabled. "
                "Check stop strings on the coordinator, or use stop_token_ids."
            )
        ks = {}
        for key, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            k = sp.get(key)
            if k == -1:
                k = self.vocab_size
            if k is not None and k > MAX_LOGPROBS:
                raise error(
                    f"Requested {what} logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}",
                    param=key,
                )
            ks[key] = k
        if obj.get("features") is not None:
            _check_features(obj["features"], len(ids))
        if max(ids) >= self.vocab_size:
            raise error(f"Token id {max(ids)} is out of vocabulary")
        if len(ids) > MAX_MODEL_LEN:  # input_processor._validate_prompt_len
            raise error(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                f"of {MAX_MODEL_LEN}. Make sure that `max_model_len` is no smaller than the number "
                "of text tokens."
            )
        if len(ids) == MAX_MODEL_LEN:
            raise error(
                f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {MAX_MODEL_LEN}. Make sure "
                "that `max_model_len` is no smaller than the number of text tokens (prompt + "
                "requested output tokens)."
            )
        # An omitted max_tokens means the rest of the context; more stops at
        # the context end, or is refused by versions that bound it.
        room = MAX_MODEL_LEN - len(ids)
        max_tokens = sp.get("max_tokens")
        if max_tokens is not None and max_tokens > room and self.behaviour.bounds_max_tokens:
            raise error(
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {len(ids)} input tokens, for a total of "
                f"{len(ids) + max_tokens} tokens. Please reduce the length of the input prompt or the number of "
                f"requested output tokens. (parameter=input_tokens, value={len(ids)})",
                param="input_tokens",
            )
        header_id = headers.get(b"x-request-id")
        base = header_id.decode("latin-1") if header_id is not None else obj.get("request_id", uuid.uuid4().hex)
        so = obj.get("stream_options")
        include = so is not None and bool(so.get("include_usage", True))
        job = Job(
            rid=ENGINE_PREFIX + base,
            input_ids=ids,
            max_new_tokens=room if max_tokens is None else min(max_tokens, room),
            stop_token_ids=frozenset(sp.get("stop_token_ids") or ()),
            ignore_eos=sp.get("ignore_eos", False),
        )
        opts = Options(
            stream=bool(obj.get("stream")),
            include_usage=include,
            continuous_usage=include and bool(so.get("continuous_usage_stats")),
            logprobs=ks["logprobs"],
            prompt_logprobs=ks["prompt_logprobs"],
            n=n,
            kv_transfer_params=obj.get("kv_transfer_params"),
        )
        return job, opts

    @staticmethod
    def _validated(body: bytes) -> dict:
        """The body as pydantic validates ``GenerateRequest`` (FastAPI reads
        it with ``json.loads``).

        Raises:
            Invalid: pydantic's errors.
        """
        if not body:
            raise invalid("missing", (), "Field required", None)
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise invalid("json_invalid", (exc.pos,), "JSON decode error", {}, {"error": exc.msg}) from None
        return _validate(obj, _REQUEST)

    # -- answer building -------------------------------------------------

    def _entry(self, tok: int, lp: float, rank: int) -> dict:
        if self.behaviour.generate_schema:
            return {"token_id": tok, "logprob": max(lp, LOGPROB_FLOOR), "rank": rank}
        return {"token": f"token_id:{tok}", "logprob": max(lp, LOGPROB_FLOOR), "bytes": None}

    def _logprobs(self, token: Token, k: int) -> dict:
        """One ``logprobs.content`` entry (vLLM ``_create_tokens_logprobs``;
        newer versions ``GenerateLogProbsContent``)."""
        tok = token.token_id
        model, state = self.engine.model, token.step.state
        rank = model.rank(state, tok)
        ranked = [(tok, model.logprob(state, tok), rank)]
        ranked += [(t, v, i + 1) for i, (t, v) in enumerate(token.step.candidates[:k]) if t != tok]
        return {**self._entry(*ranked[0]), "top_logprobs": [self._entry(*r) for r in ranked[: max(k, 1)]]}

    def _prompt_logprobs(self, ids: list[int], k: int) -> list[dict | None]:
        """``prompt_logprobs``: null, then per position the prompt token and
        the top-k (a top-k entry for the prompt token keeps its place)."""
        model = self.engine.model
        out: list[dict | None] = [None]
        state = model.fold(ids[:1])
        for tok in ids[1:]:
            entry = {
                str(tok): {
                    "logprob": max(model.logprob(state, tok), LOGPROB_FLOOR),
                    "rank": model.rank(state, tok),
                    "decoded_token": None,
                }
            }
            for i, (t, v) in enumerate(model.step(state).candidates[:k]):
                entry[str(t)] = {"logprob": max(v, LOGPROB_FLOOR), "rank": i + 1, "decoded_token": None}
            out.append(entry)
            state = model.advance(state, tok)
        return out

    def _choice(self, index: int, logprobs: Any, finish: str | None, stop_reason: int | None, ids: list[int]) -> dict:
        """One choice in the played version's field order (``model_dump``)."""
        if not self.behaviour.generate_schema:
            return {"index": index, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids,
                    "routed_experts": None}
        return {"index": index, "finish_reason": finish, "stop_reason": stop_reason, "token_ids": ids,
                "routed_experts": None, "sampling_mask": None, "weight_versions": None, "logprobs": logprobs}

    def _chunk(self, rid: str, choices: list[dict], usage: dict | None) -> dict:
        """A stream chunk (``GenerateStreamResponse``; newer versions leave
        out the prompt fields a token-bearing chunk lacks)."""
        if not self.behaviour.generate_schema:
            return {"request_id": rid, "choices": choices, "usage": usage}
        return {"request_id": rid, "usage": usage, "output_mode": "tokens", "choices": choices}

    # -- HTTP ------------------------------------------------------------

    async def generate(self, body: bytes, headers: Mapping[bytes, bytes], receive: Receive, send: Send) -> None:
        """Serve one ``POST /inference/v1/generate``."""
        try:
            job, opts = self.parse(body, headers)
            self.engine.submit(job)
        except VLLMError as exc:
            await send_unary(send, exc.status, orjson.dumps(exc.body))
            return
        except DuplicateRequestId as exc:
            await send_unary(send, 400, orjson.dumps(error(f"Request id {exc} already running.").body))
            return
        last = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, job, tg.cancel_scope)
                last = await self._run(job, opts, send)
                tg.cancel_scope.cancel()
        finally:
            self.engine.finish(job)
        # Sent once the watcher is gone: the server reports the end of every
        # answered request as a disconnect, which is not the client's doing.
        if last is not None:
            for message in last:
                await send(message)

    async def _watch_disconnect(self, receive: Receive, job: Job, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.engine.disconnected(job)
        scope.cancel()

    async def _run(self, job: Job, opts: Options, send: Send) -> list[dict]:
        """Generate, sending all but the answer's last messages, which it returns."""
        prompt = len(job.input_ids)
        out: list[int] = []
        content: list[dict] = []
        finish: str | None = None
        stop_reason: int | None = None
        k = opts.logprobs
        pending: list[int] = []  # streamed tokens not yet sent, with their entries
        if opts.stream:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        params = opts.kv_transfer_params
        if isinstance(self.kv, KVConsumer) and params and params.get("do_remote_prefill"):
            await self.kv.load(params, job.input_ids)
        async for token in self.engine.tokens(job):
            out.append(token.token_id)
            finish = token.finish[0] if token.finish is not None else None
            # vLLM names a matched stop token; EOS (checked first) and caps have none.
            if finish == "stop" and token.token_id in job.stop_token_ids and not (
                token.token_id == self.engine.model.eos_id and not job.ignore_eos
            ):
                stop_reason = token.token_id
            entry = self._logprobs(token, k) if k is not None else None
            if entry is not None:
                content.append(entry)
            if not opts.stream:
                continue
            pending.append(token.token_id)
            if finish is None and len(pending) < self.stream_interval:
                continue
            logprobs = {"content": content[-len(pending):]} if k is not None else None
            for i in range(opts.n):  # one chunk per choice and step
                choice = self._choice(i, logprobs, finish, stop_reason, pending)
                # Continuous usage counts this choice's tokens (vLLM's num_generated_tokens[i]).
                usage = _usage(prompt, len(out)) if opts.continuous_usage else None
                await self._send_chunk(send, self._chunk(job.rid, [choice], usage))
            pending = []
        if job.aborted and finish is None:
            finish = "abort"
            # The aborted output carries the tokens not sent yet; without any,
            # versions before 0.32 skip it and later ones send it anyway.
            if opts.stream and (pending or self.behaviour.generate_schema):
                logprobs = {"content": content[-len(pending):]} if k is not None and pending else None
                for i in range(opts.n):
                    usage = _usage(prompt, len(out)) if opts.continuous_usage else None
                    choice = self._choice(i, logprobs, finish, None, pending)
                    await self._send_chunk(send, self._chunk(job.rid, [choice], usage))
        if opts.stream:
            tail = b""
            if opts.include_usage and self.usage_chunk:
                # The closing chunk leaves out null fields (vLLM's exclude_none).
                usage = _usage(prompt, len(out) * opts.n)
                del usage["prompt_tokens_details"]
                tail = sse_event(orjson.dumps(self._chunk(job.rid, [], usage)))
            return [{"type": "http.response.body", "body": tail + DONE, "more_body": False}]
        pk = opts.prompt_logprobs
        kv_out = None
        if isinstance(self.kv, KVProducer) and params and params.get("do_remote_decode") and not job.aborted:
            kv_out = self.kv.finished(job.rid, job.input_ids, finish == "length")
        logprobs = {"content": content} if k is not None else None
        choices = [self._choice(i, logprobs, finish or "stop", stop_reason, out) for i in range(opts.n)]
        usage = _usage(prompt, len(out) * opts.n)
        prompt_logprobs = self._prompt_logprobs(job.input_ids, pk) if pk is not None else None
        head = {"request_id": job.rid, "model": self.model_name, "created": int(time.time())}
        if self.behaviour.generate_schema:
            answer = {
                **head, "usage": usage, "prompt_logprobs": prompt_logprobs, "prompt_token_id_logprobs": None,
                "prompt_token_ids": None, "mm_placeholders": None, "metrics": None, "kv_transfer_params": kv_out,
                "ec_transfer_params": None, "output_mode": "tokens", "choices": choices,
            }
        else:
            answer = {
                **head, "choices": choices, "usage": usage, "prompt_logprobs": prompt_logprobs,
                "kv_transfer_params": kv_out, "ec_transfer_params": None,
            }
        body = orjson.dumps(answer)
        return [
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            },
            {"type": "http.response.body", "body": body, "more_body": False},
        ]

    @staticmethod
    async def _send_chunk(send: Send, chunk: dict) -> None:
        await send({"type": "http.response.body", "body": sse_event(orjson.dumps(chunk)), "more_body": True})

    async def abort_requests(self, body: bytes, send: Send) -> None:
        """Serve ``POST /abort_requests``: abort the named (prefixed) ids."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            await send_unary(send, 400, orjson.dumps(error(f"JSON decode error: {exc}", "Bad Request").body))
            return
        ids = obj.get("request_ids") if isinstance(obj, dict) else None
        if ids is None:
            missing = error("Missing 'request_ids' in request body", "Bad Request")
            await send_unary(send, 400, orjson.dumps(missing.body))
            return
        # vLLM's engine client takes one id or a list of them.
        ids = [ids] if isinstance(ids, str) else ids if isinstance(ids, list) else []
        self.engine.abort_ids([r for r in ids if isinstance(r, str)])
        await send_unary(send, 200, b"")

    def models(self, model_path: str) -> dict:
        """The ``/v1/models`` body, with ``max_model_len``."""
        now = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": now,
                    "owned_by": "vllm",
                    "root": model_path,
                    "parent": None,
                    "max_model_len": MAX_MODEL_LEN,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex}",
                            "object": "model_permission",
                            "created": now,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }


def _usage(prompt: int, completion: int) -> dict:
    """vLLM's ``UsageInfo`` for ``prompt`` input and ``completion`` output tokens."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }
