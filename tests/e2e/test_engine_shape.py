"""The simulator's model shape flags and grammars, as each engine bounds and
refuses them, asked of the simulator directly and through the frontend, for
every engine version the simulator plays.

The shape: SGLang ``--context-length``, vLLM ``--max-model-len`` and
``--max-logprobs``, and ``--vocab-size`` for both (a vocabulary padded past
the tokenizer's 4,096 ids, as real checkpoints are). The grammars: SGLang's
scheduler aborts one that does not compile with 400 ``Failed to compile ...
grammar: ...`` (unary, or the abort finish as a stream's last chunk); a
vLLM ``--tokens-only`` server refuses every ``structured_outputs``
(:mod:`asgi_generate.sim.grammars`).
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from asgi_generate.sdk._versions import VLLM_VERSIONS, vllm_behaviour
from support import CONTINUATION, PROMPT, same, sse, start_frontend, start_sim, without_timing

pytestmark = pytest.mark.e2e

CONTEXT = 1024
VOCAB = 8192
HTTP = httpx.Client(timeout=30)
JSON = {"content-type": "application/json"}


def _both(served, path: str, body: dict, stream: bool = False) -> tuple[int, object]:
    """The answer to ``body``, the same directly and through the frontend:
    ``(status, object)``, or ``(status, SSE payloads)`` for a stream."""
    answers = []
    for url in served:
        if stream:
            status, events = sse(url, {**body, "stream": True}, path)
            answers.append((status, [without_timing(orjson.loads(e)) for e in events if e != b"[DONE]"]))
        else:
            r = HTTP.post(url + path, content=orjson.dumps(body), headers=JSON)
            obj = r.json()
            if isinstance(obj, dict):
                obj.pop("created", None)
            answers.append((r.status_code, without_timing(obj)))
    assert answers[0][0] == answers[1][0]
    same(answers[1][1], answers[0][1])
    return answers[0]


# -- SGLang -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang():
    """``(simulator URL, frontend URL)``: SGLang with a 1,024-token context
    and an 8,192-id vocabulary."""
    sim = start_sim("sglang", extra=["--context-length", str(CONTEXT), "--vocab-size", str(VOCAB)])
    front = start_frontend([f"sglang={sim.url}"])
    yield sim.url, front.url
    front.stop()
    sim.stop()


def generate(served, body: dict, stream: bool = False):
    return _both(served, "/generate", {"rid": "shape", **body}, stream)


def refused(message: str) -> tuple[int, dict]:
    return 400, {"error": {"message": message}}


def test_sglang_context_length_bounds_the_prompt_and_max_new_tokens(sglang):
    assert generate(sglang, {"input_ids": [5] * CONTEXT}) == refused(
        "The input (1024 tokens) is longer than the model's context length (1024 tokens).")
    # SGLang's sampling_params is a plain dict: 1e18 stays a float in the sum and the message.
    for max_new, total in ((CONTEXT - 3, "1025"), (2**31, "2147483652"), (2**63, "9223372036854775812"),
                           (1e18, "1e+18")):
        assert generate(sglang, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_new}}) == refused(
            f"Requested token count exceeds the model's maximum context length of 1024 tokens. You requested a "
            f"total of {total} tokens: 4 tokens from the input messages and {max_new} tokens for "
            "the completion. Please reduce the number of tokens in the input messages or the completion to fit "
            "within the limit.")
    status, answer = generate(sglang, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": CONTEXT - 4}})
    assert (status, answer["output_ids"]) == (200, CONTINUATION)
    info = HTTP.get(sglang[0] + "/get_server_info").json()
    assert info["context_length"] == CONTEXT


def test_sglang_vocab_size_bounds_every_token_id(sglang):
    last = VOCAB - 1
    status, answer = generate(sglang, {
        "input_ids": [*PROMPT, last], "return_logprob": True, "token_ids_logprob": [last],
        "sampling_params": {"max_new_tokens": 2, "logit_bias": {str(last): -5}}})
    assert status == 200 and len(answer["output_ids"]) == 2
    assert [row[0][1] for row in answer["meta_info"]["output_token_ids_logprobs"]] == [last, last]
    assert generate(sglang, {"input_ids": [*PROMPT, VOCAB]}) == refused("Token id out of range [0, 8192).")
    assert generate(sglang, {"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [VOCAB]}) == refused(
        "token_ids_logprob contains out-of-vocabulary token id 8192; valid range is [0, 8192).")
    assert generate(sglang, {"input_ids": PROMPT, "sampling_params": {"logit_bias": {"8192": 1}}}) == refused(
        "logit_bias must has keys in [0, 8191], got 8192.")


BAD_GRAMMARS = [
    ({"regex": "("}, "Failed to compile regex grammar: regex does not parse: missing ), unterminated subpattern "
                     "at position 0"),
    ({"json_schema": "{not json"}, "Failed to compile json grammar: Expecting property name enclosed in double "
                                   "quotes: line 1 column 2 (char 1)"),
    ({"json_schema": '{"type": "nonsense"}'}, "Failed to compile json grammar: not a JSON Schema: 'nonsense' is not "
                                             "valid under any of the given schemas"),
    ({"json_schema": '{"type": "array", "uniqueItems": true}'},
     "Failed to compile json grammar: JSON Schema at # is not supported by xgrammar: keyword(s) uniqueItems would "
     "be ignored"),
    ({"json_schema": '{"properties": {"a": {"type": "string", "format": "email", "maxLength": 9}}}'},
     "Failed to compile json grammar: JSON Schema at #/properties/a is not supported by xgrammar: constraints "
     "format, minLength/maxLength cannot be enforced together"),
    ({"ebnf": 'start ::= "a"'}, 'Failed to compile ebnf grammar: the grammar has no rule named "root"'),
    ({"structural_tag": "[]"}, 'Failed to compile structural_tag grammar: a structural tag is {"format": {...}} or '
                               '{"structures": [...], "triggers": [...]}'),
    ({"regex": "a\x00"}, "Failed to compile regex grammar: Invalid regex: NUL bytes (\\u0000) are not allowed"),
]


@pytest.mark.parametrize("grammar, message", BAD_GRAMMARS, ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
def test_sglang_refuses_a_grammar_that_does_not_compile(sglang, grammar, message):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, **grammar}}
    assert generate(sglang, body) == refused(message)
    status, (final,) = generate(sglang, body, stream=True)
    assert (status, final["output_ids"], final["meta_info"]["finish_reason"]) == (200, [], {
        "type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"})


@pytest.mark.parametrize("grammar", [{"regex": "[a-z]+"}, {"json_schema": '{"type": "object"}'},
                                     {"json_schema": "$$ANY$$"}, {"ebnf": 'root ::= "yes" | "no"'},
                                     {"regex": "", "ebnf": ""}])
def test_sglang_serves_a_grammar_that_compiles_unconstrained(sglang, grammar):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, **grammar}}
    status, answer = generate(sglang, body)
    assert (status, answer["output_ids"]) == (200, CONTINUATION[:3])


def test_sglang_refuses_two_grammars(sglang):
    body = {"input_ids": PROMPT, "sampling_params": {"regex": "a", "structural_tag": "{}"}}
    assert generate(sglang, body) == refused("Only one of json_schema, regex, ebnf, or structural_tag can be set.")


# -- vLLM --------------------------------------------------------------------------


@pytest.fixture(scope="module", params=VLLM_VERSIONS)
def vllm(request):
    """``(version, (simulator URL, frontend URL))``: vLLM with a 1,024-token
    context, an 8,192-id vocabulary and ``--max-logprobs -1`` (the vocabulary)."""
    sim = start_sim("vllm", extra=["--engine-version", request.param, "--max-model-len", str(CONTEXT),
                                   "--vocab-size", str(VOCAB), "--max-logprobs", "-1"])
    front = start_frontend([f"vllm={sim.url}"], worker_class="asyncio")
    yield request.param, (sim.url, front.url)
    front.stop()
    sim.stop()


def vgen(vllm, params: dict, ids: list[int] = PROMPT) -> tuple[int, object]:
    status, answer = _both(vllm[1], "/inference/v1/generate",
                           {"request_id": "shape", "token_ids": ids, "sampling_params": params})
    if status == 200:
        answer.pop("request_id")
    return status, answer


def bad(message: str, param: str | None = None) -> tuple[int, dict]:
    return 400, {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


def test_vllm_max_model_len_bounds_the_prompt_and_max_tokens(vllm):
    assert vgen(vllm, {}, [5] * (CONTEXT + 1)) == bad(
        "The decoder prompt (length 1025) is longer than the maximum model length of 1024. Make sure that "
        "`max_model_len` is no smaller than the number of text tokens.")
    assert vgen(vllm, {}, [5] * CONTEXT)[1]["error"]["message"].startswith(
        "The decoder prompt (length 1024) plus the number of requested output tokens (at least 1) is longer than "
        "the maximum model length of 1024.")
    assert HTTP.get(vllm[1][0] + "/v1/models").json()["data"][0]["max_model_len"] == CONTEXT
    for max_tokens in (CONTEXT - 3, 2**31, 2**63, 1e18):
        status, answer = vgen(vllm, {"max_tokens": max_tokens, "stop_token_ids": [CONTINUATION[3]]})
        if vllm_behaviour(vllm[0]).bounds_max_tokens:
            assert (status, answer["error"]["message"]) == (400, (
                f"This model's maximum context length is 1024 tokens. However, you requested {int(max_tokens)} "
                f"output tokens and your prompt contains 4 input tokens, for a total of {int(max_tokens) + 4} "
                "tokens. Please reduce the length of the input prompt or the number of requested output tokens. "
                "(parameter=input_tokens, value=4)"))
        else:  # generation stops at the context end
            assert (status, answer["choices"][0]["token_ids"]) == (200, CONTINUATION[:4])
    status, answer = vgen(vllm, {"max_tokens": CONTEXT - 4, "ignore_eos": True})
    assert (status, len(answer["choices"][0]["token_ids"])) == (200, CONTEXT - 4)


def test_vllm_logprobs_minus_one_is_the_whole_vocabulary(vllm):
    status, answer = vgen(vllm, {"max_tokens": 1, "logprobs": -1, "prompt_logprobs": -1})
    assert status == 200
    (entry,) = answer["choices"][0]["logprobs"]["content"]
    top = entry["top_logprobs"]
    assert len(top) == VOCAB
    key = "token_id" if vllm_behaviour(vllm[0]).generate_schema else "token"
    ids = [e[key] if key == "token_id" else int(e[key].removeprefix("token_id:")) for e in top]
    assert sorted(ids) == list(range(VOCAB)) and ids[0] == CONTINUATION[0]
    assert [e["logprob"] for e in top] == sorted((e["logprob"] for e in top), reverse=True)
    assert all(len(row) == VOCAB for row in answer["prompt_logprobs"][1:])


def test_vllm_vocab_size_bounds_logprobs_and_token_ids(vllm):
    assert vgen(vllm, {"logprobs": VOCAB + 1}) == bad(
        "Requested sample logprobs of 8193, which is greater than max allowed: 8192", "logprobs")
    assert vgen(vllm, {"prompt_logprobs": VOCAB + 1}) == bad(
        "Requested prompt logprobs of 8193, which is greater than max allowed: 8192", "prompt_logprobs")
    assert vgen(vllm, {"max_tokens": 1}, [*PROMPT, VOCAB - 1])[0] == 200
    assert vgen(vllm, {"max_tokens": 1}, [*PROMPT, VOCAB]) == bad("Token id 8192 is out of vocabulary")


@pytest.mark.parametrize("structured", [{"regex": "("}, {"regex": "[a-z]+"}, {"json": {"type": "object"}},
                                        {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a"'}])
def test_vllm_tokens_only_refuses_structured_outputs(vllm, structured):
    assert vgen(vllm, {"max_tokens": 2, "structured_outputs": structured}) == bad(
        "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'")
