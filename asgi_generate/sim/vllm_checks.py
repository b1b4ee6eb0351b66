"""What vLLM refuses before generating, as the simulator checks it.

The request schema (vLLM's ``GenerateRequest`` and ``SamplingParams``
pydantic models, read in lax mode), ``SamplingParams._verify_args``
(``vllm/sampling_params.py``) and the rendering of their errors by vLLM's
``validation_exception_handler``; :mod:`asgi_generate.sim.vllm` applies
them in vLLM's order.
"""

from __future__ import annotations

import re
from typing import Any

from .lax import LaxError, lax_scalar


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
    """vLLM's ``validation_exception_handler``: 400, ``param`` the first
    error's cleaned ``loc`` (no error here carries a ``VLLMValidationError``,
    which pydantic never catches); from 0.30 each error shows its cleaned
    ``loc`` and a bounded ``input`` (at most ten errors listed), before it
    pydantic's own (``loc`` tuple, whole ``input``, every error)."""
    param = _clean_loc(errors[0]["loc"])
    label = "error" if len(errors) == 1 else "errors"
    if not cleaned:
        message = f"{len(errors)} validation {label}:\n" + "".join(f"  {e}\n" for e in errors)
        return error(message.rstrip(), "Bad Request", 400, param)
    # From 0.30 (_format_error): at most ten errors, each cut at 1,000
    # characters, and the message scrubbed (utils.sanitize_message).
    shown = []
    for e in errors[:_MAX_REPORTED]:
        text = str({**e, "loc": _clean_loc(e["loc"]), "input": _summarize(e["input"])})
        shown.append(text[:1000] + "...[truncated]" if len(text) > 1000 else text)
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {t}\n" for t in shown)
    if len(errors) > _MAX_REPORTED:
        message += f"  ...and {len(errors) - _MAX_REPORTED} more {label}\n"
    for pattern, replacement in _SCRUB:
        message = pattern.sub(replacement, message)
    return error(message.strip(), "Bad Request", 400, param)


_MAX_REPORTED = 10
#: sanitize_message's patterns: memory addresses, traceback lines, file paths.
_SCRUB = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)


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
        "structured_outputs": ANY,
    },
    (),
)
REQUEST = (
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


def validate(value: Any, node: tuple) -> Any:
    """``value`` as pydantic validates it against ``node`` (lax numbers and
    booleans, unknown fields dropped).

    Raises:
        Invalid: every error pydantic finds, in its order (fields in
            declaration order, list items in order, ``stop``'s union: one
            error per branch).
    """
    errors: list[dict] = []
    out = _walk(value, node, (), errors)
    if errors:
        raise Invalid(errors)
    return out


def _walk(value: Any, node: tuple, loc: tuple, errors: list[dict]) -> Any:
    """``value`` validated against ``node`` at ``loc`` (a path under
    ``body``), its errors appended to ``errors``."""
    kind = node[0]
    if kind == "any" or (kind == "nullable" and value is None):
        return value
    if kind == "nullable":
        return _walk(value, node[1], loc, errors)
    if kind == "sampling":
        return _validate_sampling(value, errors)
    if kind == "token_ids":  # list[int] = Field(min_length=1), then the negative-id validator
        before = len(errors)
        ids = _walk(value, ("list", INT), loc, errors)
        if len(errors) > before:
            return ids
        if not ids:
            errors.extend(invalid("too_short", loc, "List should have at least 1 item after validation, not 0", value,
                                  {"field_type": "List", "min_length": 1, "actual_length": 0}).errors)
        elif min(ids) < 0:
            why = "token_ids must not contain negative values"
            errors.extend(invalid("value_error", loc, f"Value error, {why}", value, {"error": ValueError(why)}).errors)
        return ids
    if kind == "stop":  # str | list[str]
        if type(value) is str:
            return value
        branch: list[dict] = []
        out = _walk(value, ("list", STR), (*loc, "list[str]"), branch)
        if branch:
            errors.extend(invalid("string_type", (*loc, "str"), "Input should be a valid string", value).errors)
            errors.extend(branch)
        return out
    if kind in ("int", "float", "str", "bool"):
        try:
            return _lax(kind, value, loc)
        except Invalid as exc:
            errors.extend(exc.errors)
            return value
    if kind == "list":
        if type(value) is not list:
            errors.extend(invalid("list_type", loc, "Input should be a valid list", value).errors)
            return value
        return [_walk(v, node[1], (*loc, i), errors) for i, v in enumerate(value)]
    if kind == "dict":
        if type(value) is not dict:
            errors.extend(invalid("dict_type", loc, "Input should be a valid dictionary", value).errors)
            return value
        return {key: _walk(v, node[1], (*loc, key), errors) for key, v in value.items()}
    if type(value) is not dict:
        errors.extend(invalid(
            "model_attributes_type", loc, "Input should be a valid dictionary or object to extract fields from", value
        ).errors)
        return value
    out = {}
    for key, sub in node[1].items():
        if key in value:
            out[key] = _walk(value[key], sub, (*loc, key), errors)
        elif key in node[2]:
            errors.extend(invalid("missing", (*loc, key), "Field required", value).errors)
    return out


def _validate_sampling(value: Any, errors: list[dict]) -> Any:
    """``sampling_params``: the typed dict, whose errors come after the
    failed ``is-instance`` branch of the union ``PydanticMsgspecMixin``
    builds; once every field is well typed, ``SamplingParams``' own checks
    (``_verify_args``, run as pydantic builds it).

    Raises:
        VLLMError: ``_verify_args`` refused a value. Its
            ``VLLMValidationError`` is no ``ValueError``
            (``vllm/exceptions.py``: a ``VLLMError``), so pydantic does not
            catch it: it ends validation (no other field's error is shown)
            and vLLM's ``VLLMError`` handler answers it
            (``create_error_response``: ``BadRequestError``, ``param`` the
            parameter it names).
    """
    loc = ("sampling_params", _SP_MARKER)
    found: list[dict] = []
    sp = value
    if type(value) is not dict:
        found = invalid("dict_type", loc, "Input should be a valid dictionary", value).errors
    else:
        sp = _walk(value, _SAMPLING, loc, found)
        if not found:
            try:
                _verify_args(sp)
            except VLLMValidationError as exc:
                raise error(str(exc), param=exc.parameter) from None
    if found:
        errors.append({"type": "is_instance_of", "loc": ("body", "sampling_params", "is-instance[SamplingParams]"),
                       "msg": "Input should be an instance of SamplingParams", "input": value,
                       "ctx": {"class": "SamplingParams"}})
        errors.extend(found)
    return sp


class VLLMValidationError(Exception):
    """vLLM's ``VLLMValidationError`` (``vllm/exceptions.py``, a
    ``VLLMClientError``, no ``ValueError``): the refused parameter and
    value, shown after the message."""

    def __init__(self, message: str, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        extras = [f"{k}={v}" for k, v in (("parameter", self.parameter), ("value", self.value)) if v is not None]
        return f"{super().__str__()} ({', '.join(extras)})" if extras else super().__str__()


def _verify_args(sp: dict) -> None:
    """``SamplingParams._verify_args`` (vllm/sampling_params.py), for the
    fields the simulator reads: every refusal a ``VLLMValidationError``."""
    def f(key: str, default: float) -> float:
        return float(sp.get(key, default))

    n = sp.get("n", 1)
    if n < 1:  # _verify_num_sequences
        raise VLLMValidationError(f"n must be at least 1, got {n}.")
    for key in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= f(key, 0.0) <= 2.0:
            raise VLLMValidationError(f"{key} must be in [-2, 2], got {f(key, 0.0)}.")
    if f("repetition_penalty", 1.0) <= 0.0:
        raise VLLMValidationError(f"repetition_penalty must be greater than zero, got {f('repetition_penalty', 1.0)}.")
    t = f("temperature", 1.0)
    if t < 0.0:
        raise VLLMValidationError(f"temperature must be non-negative, got {t}.", "temperature", t)
    if t > 2.0:
        raise VLLMValidationError(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    if not 0.0 < f("top_p", 1.0) <= 1.0:
        raise VLLMValidationError(f"top_p must be in (0, 1], got {f('top_p', 1.0)}.", "top_p", f("top_p", 1.0))
    if sp.get("top_k", 0) < -1:
        raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {sp['top_k']}.")
    if not 0.0 <= f("min_p", 0.0) <= 1.0:
        raise VLLMValidationError(f"min_p must be in [0, 1], got {f('min_p', 0.0)}.")
    max_tokens = sp.get("max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise VLLMValidationError(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    min_tokens = sp.get("min_tokens", 0)
    if min_tokens < 0:
        raise VLLMValidationError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:
        raise VLLMValidationError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    for key in ("logprobs", "prompt_logprobs"):
        k = sp.get(key)
        if k is not None and k != -1 and k < 0:
            raise VLLMValidationError(f"{key} must be non-negative or -1, got {k}.", key, k)
    stop = stop_strings(sp)
    if any(not s for s in stop):
        raise VLLMValidationError("stop cannot contain an empty string.")
    if stop and not sp.get("detokenize", True):
        raise VLLMValidationError(
            "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")


def stop_strings(sp: dict) -> list[str]:
    stop = sp.get("stop")
    return [] if stop is None else [stop] if isinstance(stop, str) else stop


def check_features(features: dict, num_tokens: int) -> None:
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
