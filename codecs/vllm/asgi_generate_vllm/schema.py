"""vLLM's ``/inference/v1/generate`` request schema, checked as vLLM checks it.

Wire sources (vLLM, read through the code index):

- ``vllm/entrypoints/serve/disagg/protocol.py``: ``GenerateRequest``
  (``token_ids`` at least one id, none negative; ``request_id`` a string;
  ``sampling_params`` optional, engine defaults apply: vLLM's test
  ``test_generate_without_sampling_params``), ``MultiModalFeatures`` and
  ``PlaceholderRangeInfo``.
- ``vllm/entrypoints/serve/exception_handling/handlers/validation.py``: a
  pydantic error becomes HTTP 400 ``{"error": {"message": "1 validation
  error:\\n  {'type': ..., 'loc': 'body.token_ids', 'msg': ..., 'input': ...}",
  "type": "Bad Request", "param": "body.token_ids", "code": 400}}``, with
  containers in ``input`` summarised as ``<list of N items>``.
- ``create_error_response``: other bad values are HTTP 400
  ``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``.

Only what the frontend relies on is checked (the prompt, ids, stream options,
``model``, ``features``, ``sampling_params.n`` and ``max_tokens``); every other
field, and every value the engine judges (``n < 1``, ``max_tokens < 1``,
logprob counts, temperatures, ...), reaches the engine untouched and its own
answer passes back. Types are read as pydantic's lax mode reads them (``"7"``
or ``7.0`` for an integer, ``1`` or ``"yes"`` for a boolean), and the value
is forwarded converted, so every vLLM build reads it the same; where vLLM
refuses a value (``2.5`` for an integer) the error is pydantic's own. The frontend's refusals are rendered as vLLM 0.30 and later render them
(a dotted ``loc``, a bounded ``input``).
"""

from __future__ import annotations

from typing import Any

from asgi_generate.sdk import LaxError, RequestError, lax_scalar


class VLLMRequestError(RequestError):
    """A :class:`RequestError` carrying vLLM's error ``type`` and ``param``.

    Args:
        status: HTTP status.
        message: the error message.
        kind: the handler's machine name (``invalid_json`` for a body that
            is not JSON, ``invalid_request`` for one that breaks the schema).
        err_type: vLLM's ``error.type`` (``Bad Request``, ``BadRequestError``).
        param: vLLM's ``error.param``, e.g. ``body.token_ids`` or ``max_tokens``.
    """

    def __init__(
        self, status: int, message: str, kind: str, err_type: str, param: str | None = None
    ) -> None:
        super().__init__(status, message, kind)
        self.err_type = err_type
        self.param = param


def _summarize(value: Any) -> Any:
    # vLLM bounds the echoed input: containers by size, text to 200 chars.
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def validation_error(
    kind: str, loc: tuple, msg: str, value: Any, ctx: dict | None = None
) -> VLLMRequestError:
    """vLLM's rendering of one pydantic error at ``loc`` (a path under ``body``)."""
    where = ".".join(str(p) for p in ("body", *loc))
    err: dict[str, Any] = {"type": kind, "loc": where, "msg": msg, "input": _summarize(value)}
    if ctx is not None:
        err["ctx"] = ctx
    machine = "invalid_json" if kind == "json_invalid" else "invalid_request"
    return VLLMRequestError(400, f"1 validation error:\n  {err}", machine, "Bad Request", where)


def bad_request(message: str, param: str | None = None) -> VLLMRequestError:
    """vLLM's ``BadRequestError`` (HTTP 400) for a bad value."""
    return VLLMRequestError(400, message, "invalid_request", "BadRequestError", param)


# Schema nodes: ("int",), ("str",), ("bool",), ("any",), ("token_ids",),
# ("nullable", node), ("list", node), ("dict", node),
# ("model", {field: node}, required_fields).
INT, STR, BOOL, ANY, TOKEN_IDS = ("int",), ("str",), ("bool",), ("any",), ("token_ids",)
#: The exact JSON type of each scalar kind (anything else goes through
#: :func:`asgi_generate.sdk.lax_scalar`).
_SCALARS = {
    "int": lambda v: type(v) is int,
    "str": lambda v: type(v) is str,
    "bool": lambda v: type(v) is bool,
}
_MODEL_MSG = "Input should be a valid dictionary or object to extract fields from"

PLACEHOLDER = ("model", {"offset": INT, "length": INT}, ("offset", "length"))
FEATURES = (
    "model",
    {
        "mm_hashes": ("dict", ("list", STR)),
        "mm_placeholders": ("dict", ("list", PLACEHOLDER)),
        "kwargs_data": ("nullable", ("dict", ("list", ("nullable", STR)))),
    },
    ("mm_hashes", "mm_placeholders"),
)
STREAM_OPTIONS = (
    "model",
    {"include_usage": ("nullable", BOOL), "continuous_usage_stats": ("nullable", BOOL)},
    (),
)
# Only the sampling fields the frontend reads (choices, the output cap); the
# engine checks the rest.
SAMPLING_PARAMS = ("model", {"n": INT, "max_tokens": ("nullable", INT)}, ())
# GenerateRequest in vLLM's field order, so the first error is vLLM's first.
GENERATE_REQUEST = (
    "model",
    {
        "request_id": STR,
        "token_ids": TOKEN_IDS,
        "features": ("nullable", FEATURES),
        "sampling_params": SAMPLING_PARAMS,
        "model": ("nullable", STR),
        "stream": ("nullable", BOOL),
        "stream_options": ("nullable", STREAM_OPTIONS),
        "cache_salt": ("nullable", STR),
        "priority": INT,
        "kv_transfer_params": ("nullable", ("dict", ANY)),
        "ec_transfer_params": ("nullable", ("dict", ANY)),
    },
    ("token_ids",),
)


def check(value: Any, node: tuple, loc: tuple = (), converted: list | None = None) -> Any:
    """Check ``value`` against schema ``node``; ``loc`` is its path under
    ``body``. Returns the value as vLLM reads it: scalars pydantic's lax mode
    takes (``"8"`` or ``8.0`` for an integer, ``1`` or ``"yes"`` for a
    boolean) come back converted, and containers are converted in place, so
    the body the engine gets reads the same everywhere; each conversion's
    ``loc`` is appended to ``converted`` when given.

    Raises:
        VLLMRequestError: 400, vLLM's validation shape, for the first mismatch
            in field order.
    """
    kind = node[0]
    if kind == "any":
        return value
    if kind == "token_ids":
        value = check(value, ("list", INT), loc, converted)
        if not value:
            raise validation_error(
                "too_short", loc, "List should have at least 1 item after validation, not 0", value,
                {"field_type": "List", "min_length": 1, "actual_length": 0},
            )
        if min(value) < 0:
            why = "token_ids must not contain negative values"
            raise validation_error("value_error", loc, f"Value error, {why}", value, {"error": ValueError(why)})
        return value
    if kind == "nullable":
        return value if value is None else check(value, node[1], loc, converted)
    if kind in _SCALARS:
        if _SCALARS[kind](value):
            return value
        try:
            read = lax_scalar(kind, value)
        except LaxError as exc:
            raise validation_error(exc.kind, loc, exc.msg, value) from None
        if converted is not None:
            converted.append(loc)
        return read
    if kind == "list":
        if type(value) is not list:
            raise validation_error("list_type", loc, "Input should be a valid list", value)
        item = node[1]
        if item[0] in _SCALARS and all(map(_SCALARS[item[0]], value)):  # fast path: long token id lists
            return value
        for i, v in enumerate(value):
            value[i] = check(v, item, (*loc, i), converted)
        return value
    if kind == "dict":
        if type(value) is not dict:
            raise validation_error("dict_type", loc, "Input should be a valid dictionary", value)
        for key, v in value.items():
            value[key] = check(v, node[1], (*loc, key), converted)
        return value
    fields, required = node[1], node[2]
    if type(value) is not dict:
        raise validation_error("model_attributes_type", loc, _MODEL_MSG, value)
    for key, sub in fields.items():
        if key in value:
            value[key] = check(value[key], sub, (*loc, key), converted)
        elif key in required:
            raise validation_error("missing", (*loc, key), "Field required", value)
    return value
