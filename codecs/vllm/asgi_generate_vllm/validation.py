"""vLLM's whole refusal of a malformed ``/inference/v1/generate`` body.

The frontend's fast check (:func:`asgi_generate_vllm.schema.check`) reads
only the fields it relies on and stops at the first mismatch. When it
refuses, this module says what vLLM itself would answer for the same body:
every error pydantic finds in vLLM's request model, rendered as vLLM's
``validation_exception_handler`` renders them.

The wording follows vLLM 0.33.0 (the rendering is the same from 0.30;
before 0.30 vLLM shows pydantic's ``loc`` tuples and whole inputs, which a
frontend that refuses before it picks a worker does not know to use):

- ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``:
  ``GenerateRequest`` (its fields in declaration order, ``token_ids``'s
  ``validate_token_ids``, the ``_validate_cache_salt`` before-validator:
  ``vllm/entrypoints/generate/base/protocol.py`` ``validate_cache_salt``,
  whose ``VLLMValidationError`` is no ``ValueError`` and so is answered by
  ``create_error_response``, a ``BadRequestError`` naming ``cache_salt``),
  ``MultiModalFeatures``, ``PlaceholderRangeInfo``, ``ReasoningParserKwargs``,
  ``ParseContext``; ``StreamOptions`` (``entrypoints/generate/base/protocol.py``);
- ``vllm/sampling_params.py`` ``SamplingParams`` (a ``msgspec.Struct``) as
  ``PydanticMsgspecMixin.__get_pydantic_core_schema__``
  (``vllm/v1/serial_utils.py``) exposes it to pydantic: a union of an
  ``is-instance`` check and a typed dict of its public fields, so every
  malformed ``sampling_params`` is first reported as ``is_instance_of``;
  ``StructuredOutputsParams`` and ``RepetitionDetectionParams`` (pydantic
  dataclasses);
- FastAPI validates the parsed JSON in Python lax mode
  (``TypeAdapter.validate_python(value, from_attributes=True)``) and puts
  ``body`` before every ``loc``;
- ``vllm/entrypoints/serve/exception_handling/handlers/validation.py``:
  ``param`` is the first error's ``loc`` without pydantic's schema segments
  (``clean_loc_for_param``), each error is shown with that ``loc`` and a
  bounded ``input`` (``_format_error``, ``_summarize_error_input``), at most
  ten of them, and ``utils.py`` ``sanitize_message`` scrubs the message.

Not mirrored: checks vLLM runs on values once a model's fields are well
typed (``SamplingParams._verify_args`` and
``StructuredOutputsParams.__post_init__``, whose ``VLLMValidationError``
pydantic does not catch, so vLLM answers it alone as a ``BadRequestError``;
the model validators of ``GenerateRequest`` and ``MultiModalFeatures``).
The frontend never refuses for those (the engine answers them), but a body
it refuses for another field that also breaks one of them gets the schema
errors here, where vLLM would answer that value's refusal.
"""

from __future__ import annotations

import re
from enum import Enum
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictInt, TypeAdapter, ValidationError, field_validator
from pydantic.dataclasses import dataclass
from pydantic_core import core_schema

from .schema import VLLMRequestError, bad_request


class RequestOutputKind(Enum):
    """``vllm/sampling_params.py`` ``RequestOutputKind``."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """The fields of ``vllm/sampling_params.py`` ``StructuredOutputsParams``."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


@dataclass
class RepetitionDetectionParams:
    """The fields of ``vllm/sampling_params.py`` ``RepetitionDetectionParams``."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


#: ``SamplingParams``' public fields and their types, in declaration order
#: (pydantic reports their errors in this order). ``prompt_logprob_token_ids``
#: is an ndarray validated as ``list[list[StrictInt]]``.
SAMPLING_FIELDS: dict[str, Any] = {
    "n": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "temperature": float,
    "watermarking": bool | None,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int | None,
    "stop": str | list[str] | None,
    "stop_token_ids": list[int] | None,
    "ignore_eos": bool,
    "max_tokens": int | None,
    "min_tokens": int,
    "logprobs": int | None,
    "prompt_logprobs": int | None,
    "prompt_logprob_token_ids": list[list[StrictInt]] | None,
    "prompt_logprob_start": int | None,
    "logprob_token_ids": list[int] | None,
    "flat_logprobs": bool,
    "detokenize": bool,
    "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool,
    "include_stop_str_in_output": bool,
    "output_kind": RequestOutputKind,
    "stream_interval": int | None,
    "skip_clone": bool,
    "output_text_buffer_length": int,
    "structured_outputs": StructuredOutputsParams | None,
    "logit_bias": dict[int, float] | None,
    "allowed_token_ids": list[int] | None,
    "extra_args": dict[str, Any] | None,
    "bad_words": list[str] | None,
    "skip_reading_prefix_cache": bool | None,
    "thinking_token_budget": int | None,
    "repetition_detection": RepetitionDetectionParams | None,
    "routed_experts_prompt_start": int,
    "trace_decode_token_ids": list[int] | None,
}


class SamplingParams:
    """``sampling_params`` as vLLM's pydantic sees it: an instance of the
    class, or a typed dict of :data:`SAMPLING_FIELDS` (all optional,
    unknown keys ignored)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        fields = {name: core_schema.typed_dict_field(handler(hint), required=False)
                  for name, hint in SAMPLING_FIELDS.items()}
        typed = core_schema.no_info_after_validator_function(_validate_msgspec, core_schema.typed_dict_schema(fields))
        return core_schema.union_schema([core_schema.is_instance_schema(cls), typed])


def _validate_msgspec(value: dict) -> dict:
    # Named as vLLM's converter, whose name is in pydantic's loc segment
    # ("function-after[_validate_msgspec(), typed-dict]").
    return value


class OpenAIBaseModel(BaseModel):
    """vLLM's ``OpenAIBaseModel``: extra fields allowed."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    """``vllm/entrypoints/generate/base/protocol.py`` ``StreamOptions``."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class PlaceholderRangeInfo(BaseModel):
    """One multimodal item's placeholder range (``PlaceholderRangeInfo``)."""

    offset: int = Field(ge=0)
    length: int = Field(gt=0)


class MultiModalFeatures(BaseModel):
    """The fields of ``MultiModalFeatures`` (its model validator is the engine's)."""

    mm_hashes: dict[str, list[str]]
    mm_placeholders: dict[str, list[PlaceholderRangeInfo]]
    kwargs_data: dict[str, list[str | None]] | None = None
    mm_metadata: dict[str, list[str | None]] | None = None


class ReasoningParserKwargs(BaseModel):
    """``ReasoningParserKwargs``: extra fields forbidden."""

    model_config = ConfigDict(extra="forbid")

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class FunctionDefinition(OpenAIBaseModel):
    """``vllm/entrypoints/generate/base/protocol.py`` ``FunctionDefinition``."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    """``vllm/entrypoints/openai/chat_completion/protocol.py`` ``ChatCompletionToolsParam``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None


class ChatCompletionNamedFunction(OpenAIBaseModel):
    """``ChatCompletionNamedFunction`` (chat completion protocol)."""

    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    """``ChatCompletionNamedToolChoiceParam``: its name is a union branch's ``loc`` segment."""

    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


class ParseContext(BaseModel):
    """``ParseContext``: the chat context ``/render`` passes on, extra fields kept."""

    model_config = ConfigDict(extra="allow")

    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    history_tool_call_cnt: int = Field(default=0, ge=0)


class GenerateRequest(BaseModel):
    """The fields of vLLM's ``GenerateRequest``, in its order."""

    request_id: str = ""
    token_ids: list[int] = Field(min_length=1)

    @field_validator("token_ids")
    @classmethod
    def validate_token_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v

    token_offsets: list[tuple[int, int]] | None = None
    features: MultiModalFeatures | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: SamplingParams
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: ReasoningParserKwargs | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    parse_context: ParseContext | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


@lru_cache(maxsize=1)
def _adapter() -> TypeAdapter:
    return TypeAdapter(GenerateRequest)


# validate_cache_salt's bounds.
_SALT_FORBIDDEN = frozenset("@/\\\x00")
_SALT_MAX = 128
_MAX_REPORTED = 10
_MAX_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000
_BRACKETED = re.compile(r"[\[\]{}()]")
#: pydantic's schema-kind segments that vLLM drops from a ``loc``.
_LOC_MARKERS = frozenset((
    "function-wrap function-after function-before function-plain json-or-python lax-or-strict chain default "
    "nullable tagged-union union call arguments is-instance is-subclass callable str int float bool bytes "
    "bytearray list tuple dict set frozenset complex none nonetype"
).split())
_SANITIZE = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)


#: The most values a refused body may hold where pydantic could find an
#: error each (token ids that are not integers, the items of every other
#: container): pydantic builds every error it finds, about 10 us each, so
#: a body past this gets the fast check's first error alone.
MAX_ERROR_SITES = 10_000


def refusal(obj: Any) -> VLLMRequestError | None:
    """vLLM's answer to the parsed JSON body ``obj``: the
    ``validate_cache_salt`` ``BadRequestError`` (it runs before any field
    is read), else every pydantic error of its request model as one 400
    (:func:`render`); ``None`` when vLLM's schema takes ``obj`` or when
    it could hold more than :data:`MAX_ERROR_SITES` errors."""
    if isinstance(obj, dict) and (salt := _salt_refusal(obj.get("cache_salt"))) is not None:
        return salt
    if _error_sites(obj) > MAX_ERROR_SITES:
        return None
    try:
        _adapter().validate_python(obj, from_attributes=True)
    except ValidationError as exc:
        return render([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)])
    return None


def _error_sites(obj: Any) -> int:
    """How many errors pydantic could find in ``obj``, at most (counted up
    to just past :data:`MAX_ERROR_SITES`): a long ``token_ids`` of integers
    holds none."""
    if type(obj) is not dict:
        return 1
    ids = obj.get("token_ids")
    sites = sum(type(v) is not int for v in ids) if type(ids) is list else 0
    stack = [v for k, v in obj.items() if k != "token_ids"]
    while stack and sites <= MAX_ERROR_SITES:
        value = stack.pop()
        if type(value) is list:
            sites += len(value)
            stack.extend(value)
        elif type(value) is dict:
            sites += len(value)
            stack.extend(value.values())
    return sites


def _salt_refusal(salt: Any) -> VLLMRequestError | None:
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        why = "Parameter 'cache_salt' must be a non-empty string if provided."
    elif len(salt) > _SALT_MAX or any(c in _SALT_FORBIDDEN for c in salt):
        why = "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."
    else:
        return None
    # VLLMValidationError.__str__ names its parameter.
    return bad_request(_sanitize(f"{why} (parameter=cache_salt)"), "cache_salt")


def clean_loc(loc: tuple) -> str:
    """vLLM's ``clean_loc_for_param``: the dotted ``loc`` without pydantic's
    schema segments (bracketed ones and :data:`_LOC_MARKERS`)."""
    parts = [str(p) for p in loc if not _BRACKETED.search(str(p)) and str(p).lower() not in _LOC_MARKERS]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def summarize(value: Any) -> Any:
    """vLLM's ``_summarize_error_input``: a bounded stand-in for an echoed
    value (containers by their size, text cut at 200 characters)."""
    if isinstance(value, str):
        return value[:_MAX_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_INPUT_CHARS else value
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"
    return text[:_MAX_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_INPUT_CHARS else text


def _format(err: dict) -> str:
    err = dict(err)
    if "input" in err:
        err["input"] = summarize(err["input"])
    err["loc"] = clean_loc(tuple(err["loc"]))
    text = str(err)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def _sanitize(message: str) -> str:
    for pattern, replacement in _SANITIZE:
        message = pattern.sub(replacement, message)
    return message.strip()


def render(errors: list[dict]) -> VLLMRequestError:
    """vLLM's 400 for pydantic ``errors`` (dicts with ``type``, ``loc``
    under ``body``, ``msg``, ``input``, maybe ``ctx``):
    ``{"message": "N validation errors:\\n  {...}\\n  {...}", "type": "Bad
    Request", "param": <first loc, cleaned>}``, at most ten errors shown
    (then ``...and K more errors``)."""
    count = len(errors)
    label = "error" if count == 1 else "errors"
    shown = errors[:_MAX_REPORTED]
    message = f"{count} validation {label}:\n" + "".join(f"  {_format(e)}\n" for e in shown)
    if count > len(shown):
        message += f"  ...and {count - len(shown)} more {label}\n"
    return VLLMRequestError(400, _sanitize(message.rstrip()), "invalid_request", "Bad Request",
                            clean_loc(tuple(errors[0]["loc"])))
