"""What an SGLang worker may answer a ``/generate`` request with, checked.

Wire format: SGLang 0.5.23 ``managers/tokenizer_manager.py``
(``TokenizerManager._handle_batch_output``: the object ``{"text",
"output_ids", "meta_info"}``, ``text`` left out under
``--skip-tokenizer-init``; ``meta_info`` with ``id``, ``finish_reason``,
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, the logprob
lists with ``return_logprob``, ``routed_experts`` with
``return_routed_experts``), ``managers/schedule_batch.py`` (the
``finish_reason`` objects' ``to_json``: ``null`` while running, else
``{"type", ...}`` with ``matched`` an id, a list of ids or a string,
``length``, or an abort's ``message``/``status_code``/``err_type``) and
``entrypoints/http_server.py`` (``generate_request``: a streamed
``ValueError`` as ``{"error": {"message", "type", "code", ...}}``). A
logprob entry is SGLang's triple ``[logprob, token_id, text]``, the logprob
``null`` where there is none (the first prompt token) and the text ``null``
without ``return_text_in_logprobs``; top and token-ids logprobs hold a list
of triples, or ``null``, per position.

Each check raises :class:`~asgi_generate.sdk.WorkerAnswerError` naming the
field; what the engine can send passes, and fields the codec does not read
(``id``, ``e2e_latency``, ...) are not looked at.
"""

from __future__ import annotations

from asgi_generate.sdk import WorkerAnswerError, answer
from asgi_generate.sdk.answer import MISSING, wrong

#: ``meta_info`` lists with one triple per position.
TRIPLES = ("input_token_logprobs", "output_token_logprobs")
#: ``meta_info`` lists with a list of triples (or ``null``) per position.
NESTED = ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")
_INPUTS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
#: Every logprob list, in the order the checks raise in.
_LISTS = TRIPLES + NESTED
_NUMBER = (int, float, type(None))
_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))
_TRIPLE = "a [logprob, token_id, text] triple"
_TRIPLE_TYPES = ((_NUMBER, "a number or null"), ((int,), "an integer"), (_OPT_STR, "a string or null"))
#: ``meta_info`` fields checked by type alone, as ``(key, types, what it
#: should be)``: those before the logprob lists, and those after (the order
#: the checks raise in).
_COUNTS = (("prompt_tokens", (int,), "an integer"), ("completion_tokens", (int,), "an integer"),
           ("cached_tokens", (int,), "an integer"), ("weight_version", (str,), "a string"))
_EXTRAS = (("routed_experts", _OPT_STR, "a base64 string"), ("routed_experts_dtype", _OPT_STR, "a string"),
           ("cached_tokens_details", (dict, type(None)), "an object"))


def chunk_meta(chunk: dict, at: str, start: int = 0, inputs: bool = True) -> dict | None:
    """Check ``chunk``, one SGLang answer object (``at`` its path in the
    body, e.g. ``""`` or ``"[2]."``): its ``meta_info`` (see
    :func:`check_meta`), or ``None`` for SGLang's ``{"error": ...}``.

    Raises:
        WorkerAnswerError: neither, or a field of the wrong shape.
    """
    meta = chunk.get("meta_info", MISSING)
    if meta is MISSING and "error" in chunk:
        check_error(chunk, at)
        return None
    if type(meta) is not dict:
        raise wrong(f"{at}meta_info", meta, "an object")
    answer.int_list(chunk.get("output_ids", MISSING), f"{at}output_ids")
    answer.check(chunk, "text", f"{at}text", _OPT_STR, "a string")
    check_meta(meta, f"{at}meta_info", start, inputs)
    return meta


def check_error(chunk: dict, at: str) -> None:
    """SGLang's ``{"error": {"message", "code", ...}}``: ``message`` a
    string, ``code`` (when given) an HTTP error status.

    Raises:
        WorkerAnswerError: another shape.
    """
    err = chunk["error"]
    if type(err) is not dict:
        raise wrong(f"{at}error", err, "an object")
    answer.check(err, "message", f"{at}error.message", (str,), "a string", optional=False)
    code = answer.check(err, "code", f"{at}error.code", (int,), "an HTTP error status")
    if code is not MISSING and not 400 <= code <= 599:
        raise WorkerAnswerError(f"{at}error.code is {code}, expected an HTTP error status")


def check_meta(meta: dict, at: str, start: int = 0, inputs: bool = True) -> None:
    """Check the ``meta_info`` fields the codec reads: ``finish_reason``,
    the token counts, ``weight_version``, the logprob lists (each one's type; the output
    lists' entries from position ``start``, what a cumulative chunk added;
    the prompt lists' entries when ``inputs``) and the expert rows.

    Raises:
        WorkerAnswerError: a field of the wrong shape.
    """
    finish = meta.get("finish_reason", MISSING)
    if finish is not None:
        if type(finish) is not dict:
            raise wrong(f"{at}.finish_reason", finish, "an object or null")
        answer.check(finish, "type", f"{at}.finish_reason.type", (str,), "a string", optional=False)
        matched = finish.get("matched")
        if type(matched) is list:
            answer.int_list(matched, f"{at}.finish_reason.matched")
        elif matched is not None and type(matched) not in (int, str):
            raise wrong(f"{at}.finish_reason.matched", matched, "an integer, a list of integers or a string")
        answer.check(finish, "length", f"{at}.finish_reason.length", _OPT_INT, "an integer")
        answer.check(finish, "message", f"{at}.finish_reason.message", _OPT_STR, "a string")
        answer.check(finish, "status_code", f"{at}.finish_reason.status_code", _OPT_INT, "an integer")
    # Every streamed event passes here: a field's name is formatted only
    # for its error, not for each check.
    get = meta.get
    for key, types, expected in _COUNTS:
        value = get(key, MISSING)
        if value is not MISSING and type(value) not in types:
            raise wrong(f"{at}.{key}", value, expected)
    for key in _LISTS:
        value = get(key)
        if value is None:
            continue
        if type(value) is not list:
            raise wrong(f"{at}.{key}", value, "a list")
        if not inputs and key in _INPUTS:
            continue
        first = 0 if key in _INPUTS else start
        if key in TRIPLES:
            _triples(value, f"{at}.{key}", first)
            continue
        for i in range(first, len(value)):
            if value[i] is not None:
                if type(value[i]) is not list:
                    raise wrong(f"{at}.{key}[{i}]", value[i], "a list of logprob triples or null")
                _triples(value[i], f"{at}.{key}[{i}]", 0)
    for key, types, expected in _EXTRAS:
        value = get(key, MISSING)
        if value is not MISSING and type(value) not in types:
            raise wrong(f"{at}.{key}", value, expected)


def _triples(value: list, at: str, start: int) -> None:
    """Check ``value[start:]``, each a ``[logprob, token_id, text]`` triple."""
    for i in range(start, len(value)):
        entry = value[i]
        if type(entry) is not list:
            raise wrong(f"{at}[{i}]", entry, _TRIPLE)
        if len(entry) != 3:
            raise WorkerAnswerError(f"{at}[{i}] is a list of {len(entry)}, expected {_TRIPLE}")
        for j, (types, expected) in enumerate(_TRIPLE_TYPES):
            if type(entry[j]) not in types:
                raise wrong(f"{at}[{i}][{j}]", entry[j], expected)
