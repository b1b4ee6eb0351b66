"""What a vLLM worker may answer ``/inference/v1/generate`` with, checked.

Wire format: vLLM 0.33.0 ``vllm/entrypoints/scale_out/token_in_token_out/
protocol.py``: ``GenerateResponseBase`` and its choices
(``GenerateChoiceBase``: ``index``, ``finish_reason`` a string or ``null``,
``stop_reason`` an id, a string or ``null``, ``token_ids``,
``routed_experts`` base64 or ``null``, ``logprobs`` an object or ``null``),
the stream's ``GenerateStreamResponseBase`` (the closing usage chunk has no
choices), ``UsageInfo`` (``prompt_tokens``, ``completion_tokens`` an integer
or ``null``, ``prompt_tokens_details.cached_tokens`` an integer or
``null``), ``kv_transfer_params`` an object or ``null`` and
``prompt_logprobs`` a list (of an object or ``null`` per position) or
``null``; ``serving.py`` fills ``token_ids`` of every choice. Usage and
errors are ``vllm/entrypoints/serve/engine/protocol.py``'s (``UsageInfo``,
``PromptTokenUsageInfo``, ``ErrorResponse``:
``{"error": {"message", "type", "param", "code"}}``).

Each check raises :class:`~asgi_generate.sdk.WorkerAnswerError` naming the
field; what the engine can send passes, and fields the codec does not read
(``model``, ``created``, ``metrics``, ...) are not looked at.
"""

from __future__ import annotations

from asgi_generate.sdk import WorkerAnswerError, answer
from asgi_generate.sdk.answer import MISSING, wrong

_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))
_OPT_OBJ = (dict, type(None))
#: A choice's fields checked by type alone: ``(key, types, what it should be)``.
_CHOICE_FIELDS = (("finish_reason", _OPT_STR, "a string"),
                  ("stop_reason", (int, str, type(None)), "an integer or a string"),
                  ("routed_experts", _OPT_STR, "a base64 string"), ("logprobs", _OPT_OBJ, "an object"))


def check_error(obj: dict) -> dict:
    """vLLM's ``error`` object: ``message`` a string, ``code`` (when given)
    an integer. Returns it.

    Raises:
        WorkerAnswerError: another shape.
    """
    err = obj["error"]
    if type(err) is not dict:
        raise wrong("error", err, "an object")
    answer.check(err, "message", "error.message", (str,), "a string", optional=False)
    answer.check(err, "code", "error.code", _OPT_INT, "an integer")
    return err


def check_top(obj: dict, n: int) -> list:
    """The answer's or chunk's top-level fields the codec reads:
    ``request_id``, ``usage``, ``prompt_logprobs``, ``kv_transfer_params``,
    and ``choices`` (of a request of ``n`` choices), returned.

    Raises:
        WorkerAnswerError: a field of the wrong shape, or no ``choices`` list.
    """
    answer.check(obj, "request_id", "request_id", (str,), "a string")
    check_usage(obj.get("usage"))
    logprobs = answer.check(obj, "prompt_logprobs", "prompt_logprobs", (list, type(None)), "a list")
    if type(logprobs) is list:
        for i, entry in enumerate(logprobs):
            if type(entry) not in _OPT_OBJ:
                raise wrong(f"prompt_logprobs[{i}]", entry, "an object or null")
    answer.check(obj, "kv_transfer_params", "kv_transfer_params", _OPT_OBJ, "an object")
    choices = answer.check(obj, "choices", "choices", (list,), "a list", optional=False)
    for i, choice in enumerate(choices):
        check_choice(choice, f"choices[{i}]")
        if not 0 <= choice["index"] < n:
            raise WorkerAnswerError(f"choices[{i}].index is {choice['index']}, expected one of the request's {n}")
    return choices


def check_usage(usage: object) -> None:
    """``usage``: ``null``, missing, or vLLM's ``UsageInfo``.

    Raises:
        WorkerAnswerError: a count of the wrong type.
    """
    if usage is None:
        return
    if type(usage) is not dict:
        raise wrong("usage", usage, "an object")
    answer.check(usage, "prompt_tokens", "usage.prompt_tokens", (int,), "an integer")
    answer.int_or_none(usage, "completion_tokens", "usage.completion_tokens")
    details = answer.check(usage, "prompt_tokens_details", "usage.prompt_tokens_details", _OPT_OBJ, "an object")
    if type(details) is dict:
        answer.int_or_none(details, "cached_tokens", "usage.prompt_tokens_details.cached_tokens")


def check_choice(choice: object, at: str) -> None:
    """One choice: ``index``, ``token_ids``, ``finish_reason``,
    ``stop_reason``, ``routed_experts``, ``logprobs``.

    Raises:
        WorkerAnswerError: a field missing or of the wrong type.
    """
    if type(choice) is not dict:
        raise wrong(at, choice, "an object")
    # Every streamed event passes here: a field's name is formatted only
    # for its error, not for each check.
    get = choice.get
    index = get("index", MISSING)
    if type(index) is not int:
        raise wrong(f"{at}.index", index, "an integer")
    ids = get("token_ids", MISSING)
    if type(ids) is not list or not all(type(i) is int for i in ids):
        answer.int_list(ids, f"{at}.token_ids")
    for key, types, expected in _CHOICE_FIELDS:
        value = get(key, MISSING)
        if value is not MISSING and type(value) not in types:
            raise wrong(f"{at}.{key}", value, expected)
