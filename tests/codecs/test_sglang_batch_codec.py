"""The SGLang batch codec, sans-IO (codecs/sglang/asgi_generate_sglang/batch.py):
SGLang's item order and ids, the engine bodies of any split into legs, and
the join law (legs answered in any order give the answer of one engine
request, in entry order, with the client's ids)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate.sdk._codec import LEG_DONE, Attempt, RequestError
from asgi_generate_sglang.codec import SGLangCodec

CODEC = SGLangCodec()


def decode(obj: dict):
    return CODEC.decode(orjson.dumps(obj), {})


@pytest.mark.parametrize("rid,n,expected", [
    ("r", 1, ["r_0", "r_1", "r_2"]),
    (["a", "b", "c"], 1, ["a", "b", "c"]),
    (None, 1, [None, None, None]),
    ("r", 2, [None] * 6),  # SGLang runs samples under fresh uuids
])
def test_items_are_sglangs_entries(rid, n, expected):
    body = {"input_ids": [[1], [2, 3], [1]], "sampling_params": {"n": n}}
    if rid is not None:
        body["rid"] = rid
    req = decode(body)
    assert [i.public_id for i in req.items] == expected
    # Prompt-major; equal prompts share a group (one worker under --split-batches).
    assert [i.input_ids for i in req.items] == [p for p in ([1], [2, 3], [1]) for _ in range(n)]
    assert [i.group for i in req.items] == [g for g in (0, 1, 0) for _ in range(n)]


@pytest.mark.parametrize("body,message", [
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "The specified rids length mismatch with the batch_size for batch processing."),
    ({"text": ["x", "y"], "rid": ["a", "a"]}, "Duplicate request IDs detected within the request: ['a']"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {}]},
     "The parallel_sample_num should be the same for all samples in sample params."),
])
def test_refusals(body, message):
    with pytest.raises(RequestError) as err:
        decode({**body, "stream": True})
    assert (err.value.status, err.value.message, err.value.in_band) == (400, message, True)


def _engine_answer(body: dict) -> list[dict]:
    """What a deterministic engine answers a batch body: one object per entry."""
    return [{"text": "", "output_ids": [len(p), k], "meta_info": {"id": rid, "finish_reason": {"type": "stop"},
                                                                  "prompt_tokens": len(p)}}
            for k, (p, rid) in enumerate(zip(body["input_ids"], body["rid"]))]


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 4), n=st.integers(1, 3), rid=st.sampled_from(["str", "list", None]),
    sp_list=st.booleans(), data=st.data(),
)
def test_any_split_joins_into_the_one_request_answer(size, n, rid, sp_list, data):
    prompts = [[10 + i] * (i + 1) for i in range(size)]
    body = {"input_ids": prompts, "sampling_params": [{"n": n, "max_new_tokens": i} for i in range(size)]
            if sp_list else {"n": n}, "return_logprob": [i % 2 == 0 for i in range(size)]}
    if rid == "str":
        body["rid"] = "r"
    elif rid == "list":
        body["rid"] = [f"q{i}" for i in range(size)]
    req = decode(body)
    items = len(req.items)
    assert items == size * n
    # Any partition of the entries into legs, answered in any order.
    legs_of = data.draw(st.lists(st.integers(0, 2), min_size=items, max_size=items))
    legs = [[j for j in range(items) if legs_of[j] == k] for k in range(3)]
    legs = [leg for leg in legs if leg]
    ex = CODEC.exchange(req, "f" * 32)
    attempts = []
    for k, leg in enumerate(legs):
        a = Attempt(f"{k:032x}", entries=leg, entry_ids={j: f"e{j:031x}" for j in leg})
        sent = orjson.loads(ex.worker_request(a).body)
        assert sent["input_ids"] == [prompts[j // n] for j in leg]
        assert sent["rid"] == [a.entry_ids[j] for j in leg]
        if n > 1 or sp_list:
            assert [p["n"] for p in sent["sampling_params"]] == [1 if n > 1 else n] * len(leg)
        assert sent["return_logprob"] == [(j // n) % 2 == 0 for j in leg]
        attempts.append((a, sent))
    order = data.draw(st.permutations(range(len(attempts))))
    finishes = []
    for k in order:
        a, sent = attempts[k]
        event = ex.feed(a, orjson.dumps(_engine_answer(sent)))
        assert sorted(j for j, _ in event.entries) == a.entries
        finishes.append(event.finish_reason)
        if event.finish_reason is None:
            assert ex.end_of_stream(a).finish_reason == LEG_DONE
    assert finishes[-1] == "stop" and set(finishes[:-1]) <= {None}
    status, answer = ex.unary_body()
    got = orjson.loads(answer)
    assert status == 200 and len(got) == items
    for j, obj in enumerate(got):
        public = req.items[j].public_id
        assert obj["meta_info"]["id"] == (public if public is not None else f"e{j:031x}")
        assert obj["output_ids"][0] == len(prompts[j // n])


def test_stream_chunks_carry_the_clients_index_and_id():
    req = decode({"input_ids": [[1], [2], [3]], "rid": "r", "stream": True})
    ex = CODEC.exchange(req, "f" * 32)
    a = Attempt("0" * 32, entries=[2, 0], entry_ids={2: "x" * 32, 0: "y" * 32})
    ex.worker_request(a)
    chunk = {"text": "", "output_ids": [5], "meta_info": {"id": "y" * 32, "finish_reason": None}, "index": 1}
    event = ex.feed(a, orjson.dumps(chunk))
    assert event.entries[0][0] == 0 and event.token_ids == [5] and event.finish_reason is None
    assert orjson.loads(ex.client_event(event)) == {**chunk, "meta_info": {"id": "r_0", "finish_reason": None},
                                                    "index": 0}
    chunk["output_ids"] = [5, 6]  # cumulative: only the new id counts
    assert ex.feed(a, orjson.dumps(chunk)).token_ids == [6]


@pytest.mark.parametrize("body,items", [
    ({"input_ids": [1], "sampling_params": {"n": 4}}, 4),
    ({"input_ids": [[1], [2]], "sampling_params": {"n": 2}}, 4),
    ({"text": ["a", "b", "c", "d"]}, 4),
])
def test_a_request_may_carry_up_to_max_items(body, items):
    codec = SGLangCodec()
    codec.max_items = 4
    assert len(codec.decode(orjson.dumps(body), {}).items) == items


@pytest.mark.parametrize("body,message", [
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "n": 100000}},
     "The request carries 100000 items (1 prompts x n 100000), more than the 16384 this server allows per request "
     "(--max-request-items)."),
    ({"input_ids": [[1]] * 3, "sampling_params": {"n": 6000}},
     "The request carries 18000 items (3 prompts x n 6000), more than the 16384 this server allows per request "
     "(--max-request-items)."),
    ({"text": ["x"] * 16385},
     "The request carries 16385 items (16385 prompts x n 1), more than the 16384 this server allows per request "
     "(--max-request-items)."),
])
@pytest.mark.parametrize("stream", [False, True])
def test_more_items_than_max_items_are_refused_before_any_is_made(body, message, stream):
    with pytest.raises(RequestError) as err:
        decode({**body, "stream": stream})
    assert (err.value.status, err.value.message, err.value.in_band) == (400, message, stream)
    assert CODEC.error_body(err.value) == orjson.dumps({"error": {"message": message}})
