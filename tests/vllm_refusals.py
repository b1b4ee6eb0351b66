"""Malformed vLLM ``/inference/v1/generate`` bodies and vLLM 0.33.0's exact
answer to each (its pydantic errors as ``validation_exception_handler``
renders them), asserted of the frontend (tests/codecs/test_vllm_codec.py)
and of the simulator and the frontend in front of it
(tests/e2e/test_vllm_endpoints.py).

The answers were read off vLLM's request model (``GenerateRequest``,
``SamplingParams`` through ``PydanticMsgspecMixin``) validated by pydantic
as FastAPI validates a body: a malformed ``sampling_params`` is first the
failed ``is-instance`` branch of the union, then each field's own error in
``SamplingParams``' field order (``temperature`` before ``max_tokens``);
every error of the body is listed.
"""

from __future__ import annotations

_IS_INSTANCE = ("{'type': 'is_instance_of', 'loc': 'body.sampling_params', 'msg': 'Input should be an instance of "
                "SamplingParams', 'input': %s, 'ctx': {'class': 'SamplingParams'}}")
_NOT_A_DICT = ("{'type': 'dict_type', 'loc': 'body.sampling_params', 'msg': 'Input should be a valid dictionary', "
               "'input': %s}")
_MAX_TOKENS_ABC = ("{'type': 'int_parsing', 'loc': 'body.sampling_params.max_tokens', 'msg': 'Input should be a valid "
                   "integer, unable to parse string as an integer', 'input': 'abc'}")


def _refused(param: str, *errors: str) -> tuple[int, dict]:
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {e}" for e in errors)
    return 400, {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}


#: ``name: (sampling_params or a whole body's other fields, (status, body))``;
#: a case's body is ``{"token_ids": [1, 2, 3, 400], "sampling_params": ...}``
#: updated with ``extra``.
MALFORMED: dict[str, tuple[dict, tuple[int, dict]]] = {
    "null": ({"sampling_params": None}, _refused(
        "body.sampling_params", _IS_INSTANCE % "'None'", _NOT_A_DICT % "'None'")),
    "list": ({"sampling_params": []}, _refused(
        "body.sampling_params", _IS_INSTANCE % "'<list of 0 items>'", _NOT_A_DICT % "'<list of 0 items>'")),
    "string": ({"sampling_params": "x"}, _refused(
        "body.sampling_params", _IS_INSTANCE % "'x'", _NOT_A_DICT % "'x'")),
    "max_tokens_abc": ({"sampling_params": {"max_tokens": "abc"}}, _refused(
        "body.sampling_params", _IS_INSTANCE % "'<dict of 1 items>'", _MAX_TOKENS_ABC)),
    "two_bad_fields": ({"sampling_params": {"max_tokens": "abc", "temperature": "x"}}, _refused(
        "body.sampling_params", _IS_INSTANCE % "'<dict of 2 items>'",
        "{'type': 'float_parsing', 'loc': 'body.sampling_params.temperature', 'msg': 'Input should be a valid number, "
        "unable to parse string as a number', 'input': 'x'}",
        _MAX_TOKENS_ABC)),
    "n_and_max_tokens": ({"sampling_params": {"max_tokens": "abc", "n": 2.5}}, _refused(
        "body.sampling_params", _IS_INSTANCE % "'<dict of 2 items>'",
        "{'type': 'int_from_float', 'loc': 'body.sampling_params.n', 'msg': 'Input should be a valid integer, got a "
        "number with a fractional part', 'input': '2.5'}",
        _MAX_TOKENS_ABC)),
    "and_other_fields": ({"token_ids": "x", "sampling_params": None, "stream": "maybe"}, _refused(
        "body.token_ids",
        "{'type': 'list_type', 'loc': 'body.token_ids', 'msg': 'Input should be a valid list', 'input': 'x'}",
        _IS_INSTANCE % "'None'", _NOT_A_DICT % "'None'",
        "{'type': 'bool_parsing', 'loc': 'body.stream', 'msg': 'Input should be a valid boolean, unable to interpret "
        "input', 'input': 'maybe'}")),
    "bad_token_ids": ({"token_ids": [1, "a", "b"], "sampling_params": {}}, _refused(
        "body.token_ids.1",
        "{'type': 'int_parsing', 'loc': 'body.token_ids.1', 'msg': 'Input should be a valid integer, unable to parse "
        "string as an integer', 'input': 'a'}",
        "{'type': 'int_parsing', 'loc': 'body.token_ids.2', 'msg': 'Input should be a valid integer, unable to parse "
        "string as an integer', 'input': 'b'}")),
}


def malformed_body(name: str) -> dict:
    """The request body of case ``name``."""
    return {"token_ids": [1, 2, 3, 400], **MALFORMED[name][0]}
