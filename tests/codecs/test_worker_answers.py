"""Malformed worker answers at the codecs' sans-IO surface.

Each case is a valid worker exchange (every payload a worker of that engine
sends, in order, with the attempt it belongs to): SGLang and vLLM, unary
and streamed (SGLang cumulative and incremental), aggregated and P/D
(prefill then decode leg), an SGLang batch. The law: a copy with one
payload broken (a field replaced by a value of a JSON kind the protocol
never has there, a required field left out, the payload not an object or
not JSON) decodes to the same events as the valid one, or
:meth:`Exchange.feed` raises :class:`WorkerAnswerError` at the broken
payload; never any other exception, never another event.

The kinds each field may have are written here from the engines' sources
(SGLang 0.5.23 ``managers/tokenizer_manager.py`` ``_handle_batch_output``,
``managers/schedule_batch.py`` finish reasons; vLLM 0.33.0
``entrypoints/scale_out/token_in_token_out/protocol.py``), independently of
the codecs' checks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import orjson
import pytest
from asgi_generate_sglang import SGLangCodec
from asgi_generate_vllm import VLLMCodec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asgi_generate.sdk import WorkerAnswerError
from asgi_generate.sdk._codec import Attempt, Pair

LAW = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
E = "0123456789abcdef0123456789abcdef"

#: One value of each JSON kind, what a broken field is set to.
VALUES = {"null": None, "bool": True, "int": 5, "float": 1.5, "str": "nope", "list": ["x"], "dict": {"garbage": True}}
KINDS = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}
NUMBER = {"int", "float", "null"}

#: SGLang: the kinds each field may have (``*``: any list index); a field
#: not listed is one the codec passes through unread (any kind).
SGLANG_KINDS = {
    "": {"dict"},
    "text": {"str", "null"},
    "output_ids": {"list"},
    "output_ids[*]": {"int"},
    "meta_info": {"dict"},
    "meta_info.finish_reason": {"dict", "null"},
    "meta_info.finish_reason.type": {"str"},
    "meta_info.finish_reason.matched": {"int", "str", "list", "null"},
    "meta_info.finish_reason.matched[*]": {"int"},
    "meta_info.finish_reason.length": {"int", "null"},
    "meta_info.prompt_tokens": {"int"},
    "meta_info.completion_tokens": {"int"},
    "meta_info.cached_tokens": {"int"},
    "meta_info.weight_version": {"str"},
    "meta_info.routed_experts": {"str", "null"},
    "meta_info.cached_tokens_details": {"dict", "null"},
    "error": {"dict"},
    "error.message": {"str"},
    "error.code": {"int"},
    "index": {"int"},
}
for _key in ("input_token_logprobs", "output_token_logprobs"):
    SGLANG_KINDS |= {f"meta_info.{_key}": {"list", "null"}, f"meta_info.{_key}[*]": {"list"},
                     f"meta_info.{_key}[*][0]": NUMBER, f"meta_info.{_key}[*][1]": {"int"},
                     f"meta_info.{_key}[*][2]": {"str", "null"}}
for _key in ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"):
    SGLANG_KINDS |= {f"meta_info.{_key}": {"list", "null"}, f"meta_info.{_key}[*]": {"list", "null"},
                     f"meta_info.{_key}[*][*]": {"list"}, f"meta_info.{_key}[*][*][0]": NUMBER,
                     f"meta_info.{_key}[*][*][1]": {"int"}, f"meta_info.{_key}[*][*][2]": {"str", "null"}}
#: Fields an SGLang answer object always has (an error object: ``error.message``).
SGLANG_REQUIRED = {"meta_info", "output_ids", "meta_info.finish_reason", "meta_info.finish_reason.type",
                   "error.message", "index"}

VLLM_KINDS = {
    "": {"dict"},
    "request_id": {"str"},
    "choices": {"list"},
    "choices[*]": {"dict"},
    "choices[*].index": {"int"},
    "choices[*].token_ids": {"list"},
    "choices[*].token_ids[*]": {"int"},
    "choices[*].finish_reason": {"str", "null"},
    "choices[*].stop_reason": {"int", "str", "null"},
    "choices[*].routed_experts": {"str", "null"},
    "choices[*].logprobs": {"dict", "null"},
    "usage": {"dict", "null"},
    "usage.prompt_tokens": {"int"},
    "usage.completion_tokens": {"int", "null"},
    "usage.prompt_tokens_details": {"dict", "null"},
    "usage.prompt_tokens_details.cached_tokens": {"int", "null"},
    "prompt_logprobs": {"list", "null"},
    "prompt_logprobs[*]": {"dict", "null"},
    "kv_transfer_params": {"dict", "null"},
    "error": {"dict", "null"},
    "error.message": {"str"},
    "error.code": {"int", "null"},
}
VLLM_REQUIRED = {"choices", "choices[*].index", "choices[*].token_ids", "error.message"}


def sg_meta(finish, done, **extra) -> dict:
    return {"id": E, "finish_reason": finish, "prompt_tokens": 3, "weight_version": "default",
            "completion_tokens": done, "cached_tokens": 1, **extra}


IN_LPS = [[None, 1, None], [-0.5, 2, None], [-0.25, 3, "c"]]
OUT_LPS = [[-0.125, 5, None], [-1, 6, "b"]]
TOPS = [None, [[-1, 6, None], [-2.5, 7, "x"]]]


def sg_cumulative(lps: bool) -> list[dict]:
    logprobs = lambda n: {"input_token_logprobs": IN_LPS, "output_token_logprobs": OUT_LPS[:n],
                          "output_top_logprobs": TOPS[:n]} if lps else {}
    return [
        {"text": "a", "output_ids": [5], "meta_info": sg_meta(None, 1, **logprobs(1))},
        {"text": "ab", "output_ids": [5, 6],
         "meta_info": sg_meta({"type": "stop", "matched": [6]}, 2, e2e_latency=0.5, **logprobs(2))},
    ]


def sg_incremental() -> list[dict]:
    return [
        {"text": "a", "output_ids": [5], "meta_info": sg_meta(None, 1, input_token_logprobs=IN_LPS,
                                                               output_token_logprobs=OUT_LPS[:1])},
        {"text": "b", "output_ids": [6], "meta_info": sg_meta({"type": "length", "length": 2}, 2,
                                                               input_token_logprobs=[],
                                                               output_token_logprobs=OUT_LPS[1:])},
    ]


SG_PREFILL = {"text": "", "output_ids": [9], "meta_info": sg_meta({"type": "length", "length": 1}, 1,
                                                                    input_token_logprobs=IN_LPS)}
SG_ERROR = {"error": {"message": "bad", "type": "invalid_request_error", "code": 400, "retryable": False}}


def vl_choice(ids, finish, **extra) -> dict:
    return {"index": 0, "logprobs": None, "finish_reason": finish, "stop_reason": None, "token_ids": ids,
            "routed_experts": None, **extra}


VL_USAGE = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 1}}
VL_STREAM = [
    {"request_id": f"generate-tokens-{E}", "choices": [vl_choice([5], None)], "usage": None},
    {"request_id": f"generate-tokens-{E}", "choices": [vl_choice([6], "stop", stop_reason=6)], "usage": None},
    {"request_id": f"generate-tokens-{E}", "choices": [], "usage": VL_USAGE},
]
VL_UNARY = {"request_id": f"generate-tokens-{E}", "model": "m", "created": 1,
            "choices": [vl_choice([5, 6], "length")], "usage": VL_USAGE,
            "prompt_logprobs": [None, {"2": {"logprob": -0.5, "rank": 1}}, {"3": {"logprob": -1.0, "rank": 1}}],
            "kv_transfer_params": None}
VL_PREFILL = {**VL_UNARY, "choices": [vl_choice([9], "length")],
              "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1]}}
VL_ERROR = {"error": {"message": "engine died", "type": "InternalServerError", "param": None, "code": 500}}


@dataclass
class Case:
    """A valid worker exchange: ``run`` makes a fresh exchange and the
    attempts, and yields ``(attempt, payload)`` in order."""

    codec: Any
    body: dict
    legs: list[tuple[str, dict, list[Any]]]  # (role, worker_info, payloads) per leg
    kinds: dict
    required: set

    def run(self, payloads: list[bytes]) -> tuple[list, Any]:
        """The events of feeding ``payloads`` (the legs' payloads in
        order), and the exception that stopped it (``None``: none)."""
        codec = self.codec
        ex = codec.exchange(codec.decode(orjson.dumps(self.body), {b"content-type": b"application/json"}), "f" * 32)
        pair = Pair() if len(self.legs) == 2 else None
        events: list = []
        at = 0
        try:
            for role, info, leg_payloads in self.legs:
                attempt = Attempt(E, role, "w0", info, pair=pair)
                if self.body.get("text") is not None or type((self.body.get("input_ids") or [0])[0]) is list:
                    attempt.entries = [0, 1]
                    attempt.entry_ids = {0: E, 1: E[::-1]}
                ex.worker_request(attempt)
                for _ in leg_payloads:
                    events.append(ex.feed(attempt, payloads[at]))
                    at += 1
            if not self.body.get("stream"):
                ex.unary_body()
        except Exception as exc:  # noqa: BLE001 - the law says which are allowed
            return events, exc
        return events, None

    def payloads(self) -> list[Any]:
        return [p for _, _, leg in self.legs for p in leg]


SG_STREAM = {"input_ids": [1, 2, 3], "stream": True, "return_logprob": True}
SG_UNARY = {"input_ids": [1, 2, 3], "return_logprob": True}
VL_BODY = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
INC = {"incremental_streaming_output": True}
V33 = {"version": "0.33.0"}

CASES = {
    "sglang_unary": Case(SGLangCodec(), SG_UNARY, [("aggregated", {}, sg_cumulative(True)[1:])],
                         SGLANG_KINDS, SGLANG_REQUIRED),
    "sglang_stream": Case(SGLangCodec(), SG_STREAM, [("aggregated", {}, sg_cumulative(True))],
                          SGLANG_KINDS, SGLANG_REQUIRED),
    "sglang_stream_tail": Case(SGLangCodec(), {**SG_STREAM, "return_logprob": False},
                               [("aggregated", {}, sg_cumulative(False))], SGLANG_KINDS, SGLANG_REQUIRED),
    "sglang_incremental": Case(SGLangCodec(), SG_STREAM, [("aggregated", INC, sg_incremental())],
                               SGLANG_KINDS, SGLANG_REQUIRED),
    "sglang_stream_error": Case(SGLangCodec(), SG_STREAM,
                                [("aggregated", {}, [sg_cumulative(True)[0], SG_ERROR])], SGLANG_KINDS,
                                SGLANG_REQUIRED),
    "sglang_pd_unary": Case(SGLangCodec(), SG_UNARY, [("prefill", {}, [SG_PREFILL]),
                                                      ("decode", {}, sg_cumulative(True)[1:])],
                            SGLANG_KINDS, SGLANG_REQUIRED),
    "sglang_pd_stream": Case(SGLangCodec(), SG_STREAM, [("prefill", {}, [SG_PREFILL]),
                                                        ("decode", {}, sg_cumulative(True))],
                             SGLANG_KINDS, SGLANG_REQUIRED),
    "sglang_batch_unary": Case(SGLangCodec(), {"input_ids": [[1, 2], [3]]},
                               [("aggregated", {}, [[sg_cumulative(False)[1], sg_cumulative(True)[1]]])],
                               {**{f"[*].{k}" if k else "[*]": v for k, v in SGLANG_KINDS.items()}, "": {"list"}},
                               {f"[*].{k}" for k in SGLANG_REQUIRED if k != "index"}),
    "sglang_batch_stream": Case(SGLangCodec(), {"input_ids": [[1, 2], [3]], "stream": True},
                                [("aggregated", {}, [{**c, "index": i} for i, c in
                                                     enumerate(sg_cumulative(False))])],
                                SGLANG_KINDS, SGLANG_REQUIRED),
    "vllm_unary": Case(VLLMCodec(), VL_BODY, [("aggregated", V33, [VL_UNARY])],
                       {**VLLM_KINDS, "choices[*].finish_reason": {"str"}}, VLLM_REQUIRED | {"choices[*].finish_reason"}),
    "vllm_stream": Case(VLLMCodec(), {**VL_BODY, "stream": True}, [("aggregated", V33, VL_STREAM)],
                        VLLM_KINDS, VLLM_REQUIRED),
    "vllm_stream_error": Case(VLLMCodec(), {**VL_BODY, "stream": True},
                              [("aggregated", V33, [VL_STREAM[0], VL_ERROR])], VLLM_KINDS, VLLM_REQUIRED),
    "vllm_pd_stream": Case(VLLMCodec(), {**VL_BODY, "stream": True},
                           [("prefill", V33, [VL_PREFILL]), ("decode", V33, VL_STREAM)], VLLM_KINDS, VLLM_REQUIRED),
    # (The decode leg answers no prompt logprobs: the prefill leg computed them.)
    "vllm_pd_unary": Case(VLLMCodec(), VL_BODY, [("prefill", V33, [VL_PREFILL]),
                                                 ("decode", V33, [{**VL_UNARY, "prompt_logprobs": None}])],
                          VLLM_KINDS, VLLM_REQUIRED),
}


def paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path into ``value`` (dict keys and list indices), the root included."""
    out = [path]
    if type(value) is dict:
        for k, v in value.items():
            out += paths(v, (*path, k))
    elif type(value) is list:
        for i, v in enumerate(value):
            out += paths(v, (*path, i))
    return out


def pattern(path: tuple) -> str:
    """``path`` as :data:`SGLANG_KINDS` names fields: ``a.b[*].c``."""
    out = ""
    for step in path:
        out += "[*]" if type(step) is int else (f".{step}" if out else step)
    return out


def triple_pattern(path: tuple) -> str:
    """``path`` with its last index kept (a logprob triple's position)."""
    if not path or type(path[-1]) is not int:
        return pattern(path)
    return f"{pattern(path[:-1])}[{path[-1]}]"


def legal(kinds: dict, path: tuple) -> set | None:
    """The kinds the protocol allows at ``path``; ``None``: any (a field the codec does not read)."""
    for name in (triple_pattern(path), pattern(path)):
        if name in kinds:
            return kinds[name]
    return None


def parent_legal(kinds: dict, path: tuple) -> bool:
    """Whether every field above ``path`` is one the codec reads (a field
    inside one it passes through unread may hold anything)."""
    return all(legal(kinds, path[:i]) is not None for i in range(len(path)))


def put(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    value = copy.deepcopy(value)
    holder = value
    for step in path[:-1]:
        holder = holder[step]
    if new is DELETE:
        del holder[path[-1]]
    else:
        holder[path[-1]] = new
    return value


DELETE = object()
_INPUTS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def resent(case: Case, i: int, path: tuple) -> bool:
    """Whether ``path`` of payload ``i`` is a logprob entry an SGLang
    cumulative chunk repeats from its leg's last one (the prompt's, or an
    output position that chunk had): the codec read it there, and passes it
    on unread (reading the whole answer in every chunk would make a
    stream's work grow with the square of its length)."""
    at = 0
    for role, info, leg in case.legs:
        if i < at + len(leg):
            k = i - at
            break
        at += len(leg)
    if case.codec.name != "sglang" or not case.body.get("stream") or role == "prefill" \
            or info.get("incremental_streaming_output") or k == 0 or len(path) < 3 or path[:1] != ("meta_info",):
        return False
    if type(leg[k]) is not dict:
        return False
    return path[1] in _INPUTS or (path[1].startswith("output_") and type(path[2]) is int
                                  and path[2] < len(leg[k - 1]["output_ids"]))


@st.composite
def broken(draw) -> tuple[str, int, bytes, bool]:
    """A case, the index of its broken payload, the payload, and whether
    the law requires a :class:`WorkerAnswerError` (a kind the protocol
    never has, or a required field left out) rather than allowing the
    same events (a field the codec does not read)."""
    name = draw(st.sampled_from(sorted(CASES)))
    case = CASES[name]
    payloads = case.payloads()
    i = draw(st.integers(0, len(payloads) - 1))
    value = payloads[i]
    how = draw(st.sampled_from(["replace", "replace", "replace", "delete", "not_json"]))
    if how == "not_json":
        return name, i, draw(st.sampled_from([b"", b"{", b"<html>502</html>", b'{"a":1'])), True
    candidates = [p for p in paths(value) if parent_legal(case.kinds, p)]
    if how == "delete":
        required = [p for p in candidates if p and type(p[-1]) is str and pattern(p) in case.required]
        if required:
            path = draw(st.sampled_from(required))
            return name, i, orjson.dumps(put(value, path, DELETE)), True
    path = draw(st.sampled_from(candidates))
    allowed = None if resent(case, i, path) else legal(case.kinds, path)
    kinds = [k for k in VALUES if allowed is None or k not in allowed]
    kind = draw(st.sampled_from(kinds))
    return name, i, orjson.dumps(put(value, path, VALUES[kind])), allowed is not None


def baseline(case: Case) -> list:
    events, exc = case.run([orjson.dumps(p) for p in case.payloads()])
    assert exc is None, exc
    return events


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_valid_exchange_decodes(name):
    assert baseline(CASES[name])


@LAW
@given(broken())
def test_law_a_broken_answer_is_the_same_events_or_a_worker_answer_error(drawn):
    name, i, payload, must_raise = drawn
    case = CASES[name]
    good = baseline(case)
    payloads = [orjson.dumps(p) for p in case.payloads()]
    payloads[i] = payload
    events, exc = case.run(payloads)
    assert events == good[: len(events)]
    if exc is not None:
        assert type(exc) is WorkerAnswerError, repr(exc)
        assert (exc.status, exc.kind) == (502, "bad_worker_answer")
        assert exc.message.startswith("worker answer: ")
        assert len(events) == i, "only the broken payload may be refused"
    else:
        assert not must_raise, f"{name}: payload {i} {payload!r} was read"
        assert events == good


@pytest.mark.parametrize(
    "name, i, payload, message",
    [("sglang_unary", 0, b'{"garbage": true}', "meta_info is missing, expected an object"),
     ("sglang_unary", 0, b'{"text": 5, "output_ids": "nope", "meta_info": []}', "meta_info is a list, expected an object"),
     ("sglang_unary", 0, b'{"text": "a", "output_ids": "nope", "meta_info": {}}',
      "output_ids is a string, expected a list of integers"),
     ("sglang_unary", 0, b"[]", "the body is a list, expected an object"),
     ("sglang_stream", 1, b'{"text":"ab","output_ids":[5,"6"],"meta_info":{}}',
      "output_ids[1] is a string, expected an integer"),
     ("sglang_stream_tail", 1, orjson.dumps({**sg_cumulative(False)[1], "output_ids": [5, 6.0]}),
      "output_ids[1] is a number, expected an integer"),
     ("sglang_stream_tail", 1, orjson.dumps({**sg_cumulative(False)[1], "meta_info": sg_meta(
         {"type": "stop"}, "2")}), "meta_info.completion_tokens is a string, expected an integer"),
     ("sglang_stream", 1, orjson.dumps({**sg_cumulative(True)[1], "meta_info": sg_meta(
         {"type": "stop"}, 2, output_token_logprobs=[OUT_LPS[0], [-1, 6]])}),
      "meta_info.output_token_logprobs[1] is a list of 2, expected a [logprob, token_id, text] triple"),
     ("sglang_stream", 0, b'{"error": "flat"}', "error is a string, expected an object"),
     ("sglang_stream", 0, b'{"error": {"message": "m", "code": 200}}', "error.code is 200, expected an HTTP error status"),
     ("sglang_pd_stream", 0, orjson.dumps({**SG_PREFILL, "meta_info": sg_meta({"type": 1}, 1)}),
      "meta_info.finish_reason.type is an integer, expected a string"),
     ("sglang_batch_unary", 0, b'[{"meta_info": {}}]', "the body is a list of 1, expected 2 answers"),
     ("sglang_batch_stream", 0, orjson.dumps({**sg_cumulative(False)[0], "index": 2}),
      "index is 2, expected an entry of the leg's 2"),
     ("vllm_unary", 0, b'{"garbage": true}', "choices is missing, expected a list"),
     ("vllm_unary", 0, b'{"text": 5, "output_ids": "nope", "meta_info": []}', "choices is missing, expected a list"),
     ("vllm_stream", 0, orjson.dumps({**VL_STREAM[0], "choices": [vl_choice("nope", None)]}),
      "choices[0].token_ids is a string, expected a list of integers"),
     ("vllm_stream", 0, orjson.dumps({**VL_STREAM[0], "choices": [vl_choice([5], None, index=1)]}),
      "choices[0].index is 1, expected one of the request's 1"),
     ("vllm_stream", 2, orjson.dumps({**VL_STREAM[2], "usage": {**VL_USAGE, "prompt_tokens_details": []}}),
      "usage.prompt_tokens_details is a list, expected an object"),
     ("vllm_pd_stream", 0, orjson.dumps({**VL_PREFILL, "kv_transfer_params": "x"}),
      "kv_transfer_params is a string, expected an object"),
     ("vllm_pd_unary", 0, b"5", "the body is an integer, expected an object")],
)
def test_broken_answers_name_the_field(name, i, payload, message):
    case = CASES[name]
    payloads = [orjson.dumps(p) for p in case.payloads()]
    payloads[i] = payload
    events, exc = case.run(payloads)
    assert (type(exc), len(events)) == (WorkerAnswerError, i)
    assert (exc.status, exc.kind, exc.message) == (502, "bad_worker_answer", f"worker answer: {message}")


def test_what_the_engines_send_is_read():
    # SGLang: text null (a cumulative chunk whose text the engine defers),
    # text absent (--skip-tokenizer-init), finish_reason null, a logprob
    # null (the first prompt token), matched a token id list.
    case = CASES["sglang_stream"]
    first = {**sg_cumulative(True)[0], "text": None}
    last = sg_cumulative(True)[1]
    del last["text"]
    events, exc = case.run([orjson.dumps(first), orjson.dumps(last)])
    assert (exc, events) == (None, baseline(case))
    # vLLM: completion_tokens and cached_tokens null, stop_reason a string,
    # prompt_logprobs null, finish_reason null mid-stream.
    case = CASES["vllm_stream"]
    usage = {**VL_STREAM[2], "usage": {**VL_USAGE, "completion_tokens": None,
                                       "prompt_tokens_details": {"cached_tokens": None}}}
    events, exc = case.run([orjson.dumps(VL_STREAM[0]), orjson.dumps(VL_STREAM[1]), orjson.dumps(usage)])
    assert exc is None
    assert events[:2] == baseline(case)[:2]
    assert (events[2].completion_tokens, events[2].cached_tokens) == (None, None)
