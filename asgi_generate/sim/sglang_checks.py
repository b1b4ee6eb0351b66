"""What SGLang refuses before generating, as the simulator checks it.

``SamplingParams(**sampling_params)`` with its ``__post_init__`` and
``verify`` (``python/sglang/srt/sampling/sampling_params.py``: unknown keys
are a ``TypeError``, an unhandled 500; bad values ``ValueError``s, 400
``{"error": {"message"}}`` from ``http_server.py``) and the schema errors of
the request model; :mod:`asgi_generate.sim.sglang` applies them.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 128
_SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30
#: ``SamplingParams``' API fields; any other key is a ``TypeError`` in SGLang.
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
        "logit_bias", "sampling_seed",
    }
)


class SGLangError(Exception):
    """An error SGLang answers before generating: ``status`` and JSON body
    (``None``: an unhandled exception, Starlette's plain 500)."""

    def __init__(self, status: int, body: dict | None) -> None:
        super().__init__(body)
        self.status = status
        self.body = body


def schema_error(message: str) -> SGLangError:
    """A request that does not match SGLang's schema (400, FastAPI shape)."""
    return SGLangError(
        400,
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
    )


def value_error(message: str) -> SGLangError:
    """A ValueError raised while normalising the request (400)."""
    return SGLangError(400, {"error": {"message": message}})


def field(obj: dict, key: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise schema_error(f"{key}: expected {names}, got {type(value).__name__}")
    return value


def verify_sampling(sp: dict, vocab_size: int) -> dict[int, float] | None:
    """SGLang's ``SamplingParams(**sp)``, ``__post_init__`` and ``verify``:
    the same refusals with the same messages. Returns the logit bias by
    token id (``None`` without one).

    Raises:
        SGLangError: 500 (no body) for an unknown key, SGLang's ``TypeError``;
            400 value errors for values ``verify`` refuses.
    """
    unknown = sorted(set(sp) - SAMPLING_KEYS)
    if unknown:
        raise SGLangError(500, None)

    def num(key: str, default: float) -> float:
        value = sp.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise schema_error(f"sampling_params.{key}: expected a number, got {type(value).__name__}")
        return value

    temperature, top_k = num("temperature", 1.0), num("top_k", -1)
    if 0 <= temperature < _SAMPLING_EPS:
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    top_p, min_p = num("top_p", 1.0), num("min_p", 0.0)
    freq, pres = num("frequency_penalty", 0.0), num("presence_penalty", 0.0)
    rep, min_new = num("repetition_penalty", 1.0), num("min_new_tokens", 0)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise value_error(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise value_error(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise value_error(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1:
        raise value_error(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if not -2.0 <= freq <= 2.0:
        raise value_error(f"frequency_penalty must be in [-2, 2], got {freq}.")
    if not -2.0 <= pres <= 2.0:
        raise value_error(f"presence_penalty must be in [-2, 2], got {pres}.")
    if not 0.0 < rep <= 2.0:
        raise value_error(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rep}.")
    if not 0 <= min_new:
        raise value_error(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    max_new = sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is not None:
        if max_new < 0:
            raise value_error(f"max_new_tokens must be at least 0, got {max_new}.")
        if not min_new <= max_new:
            raise value_error(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    bias = field(sp, "logit_bias", (dict,), None)
    if bias is not None:
        parsed = {}
        for key, value in bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise SGLangError(500, None) from None
            if not 0 <= token_id < vocab_size:
                raise value_error(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise schema_error(f"sampling_params.logit_bias: expected numbers, got {type(value).__name__}")
            parsed[token_id] = float(value)
        bias = parsed
    # Empty grammars are unset (__post_init__).
    if sum(bool(sp.get(k)) for k in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        raise value_error("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    return bias or None
