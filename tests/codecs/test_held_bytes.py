"""What a request holds while it streams, kept small (bench/bench_held_bytes.py
measures the bytes): compact orjson results, packed prompts, and the SGLang
codec keeping only what a resume needs of a stream's last chunk."""

from __future__ import annotations

import array

import orjson
import pytest

from asgi_generate.sdk._codec import Attempt, dumps_compact
from asgi_generate.sdk._token_ids import pack_token_ids
from asgi_generate_sglang.codec import SGLangCodec


def test_dumps_compact_is_orjsons_result():
    # The bytes each holds: bench/bench_held_bytes.py.
    plain = [orjson.dumps(f"rid-{i}") for i in range(200)]
    compact = [dumps_compact(f"rid-{i}") for i in range(200)]
    assert compact == plain
    assert compact[7] == b'"rid-7"'
    big = list(range(1000))
    assert dumps_compact(big) == orjson.dumps(big)



def test_packed_prompt_is_its_ids_and_their_json():
    # A request holds its packed prompt while it streams: a 4-token prompt
    # is its 4 ids and 13 bytes of JSON (the bytes: bench/bench_held_bytes.py).
    packed = [pack_token_ids([11, 12, 13, i]) for i in range(200)]
    assert packed[7].json == b"[11,12,13,7]"
    assert list(packed[7].u32) == [11, 12, 13, 7]



def test_sglang_request_keeps_its_prompt_packed_once_sent():
    # A 2,000-token prompt held as a list of Python ints costs ~36 bytes an
    # id for as long as the request streams; packed, 4 and its JSON text
    # (the bytes: bench/bench_held_bytes.py).
    codec = SGLangCodec()
    prompt = list(range(1000, 3000))
    body = orjson.dumps({"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 9}})
    req = codec.decode(body, {})
    ex = codec.exchange(req, "r0")
    first = ex.worker_request(Attempt("a" * 32, "aggregated"))
    assert type(req.input_ids) is array.array and req.input_ids.tolist() == prompt
    assert req.input_ids_packed.u32 is req.input_ids
    sent = orjson.loads(first.body)
    assert sent["input_ids"] == prompt and sent["rid"] == "a" * 32
    again = orjson.loads(ex.worker_request(Attempt("b" * 32, "aggregated")).body)
    assert again == {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 9}, "rid": "b" * 32}
    resumed = Attempt("c" * 32, "resumed")
    resumed.resumes = [7, 8]
    out = orjson.loads(ex.worker_request(resumed).body)
    assert out["input_ids"] == prompt + [7, 8]
    assert out["sampling_params"] == {"max_new_tokens": 7}



@pytest.mark.parametrize("incremental", [False, True])
def test_sglang_stream_keeps_only_what_a_resume_needs_of_its_last_chunk(incremental):
    # An open stream waits with its last chunk held by the codec: only the
    # part a resumed attempt continues from is kept, and the resumed
    # attempt's chunk reads the same as when the whole chunk was kept.
    codec = SGLangCodec()
    body = orjson.dumps({"input_ids": [1, 2], "stream": True, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": 5}})
    ex = codec.exchange(codec.decode(body, {}), "pub")
    info = {"incremental_streaming_output": incremental}
    first = Attempt("a" * 32, "aggregated", worker_info=info)
    ex.worker_request(first)
    meta = {"id": "a" * 32, "finish_reason": None, "prompt_tokens": 2, "weight_version": "default",
            "completion_tokens": 2, "cached_tokens": 1, "input_token_logprobs": [[None, 1, None]],
            "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]}
    chunk = {"text": "ab", "output_ids": [7, 8], "meta_info": meta}
    event = ex.feed(first, orjson.dumps(chunk))
    assert event.token_ids == [7, 8]
    assert orjson.loads(ex.client_event(event)) == {**chunk, "meta_info": {**meta, "id": "pub"}}
    if incremental:
        assert ex.last == {"meta_info": {"prompt_tokens": 2, "cached_tokens": 1}}
    else:
        assert ex.last == {"text": "ab", "output_ids": [7, 8], "meta_info": {
            "prompt_tokens": 2, "cached_tokens": 1, "input_token_logprobs": [[None, 1, None]],
            "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]}}
    assert ex.payload == b""
    resumed = Attempt("b" * 32, "resumed", worker_info=info, resumes=[7, 8])
    sent = orjson.loads(ex.worker_request(resumed).body)
    assert (sent["input_ids"], sent["sampling_params"]) == ([1, 2, 7, 8], {"max_new_tokens": 3})
    # The resumed engine's own view: a 4-token prompt, its first new token.
    own = {"id": "b" * 32, "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 4,
           "weight_version": "default", "completion_tokens": 1, "cached_tokens": 3,
           "input_token_logprobs": [[None, 1, None]] * 4, "output_token_logprobs": [[-0.125, 9, None]]}
    event = ex.feed(resumed, orjson.dumps({"text": "c", "output_ids": [9], "meta_info": own}))
    assert (event.token_ids, event.finish_reason, event.completion_tokens) == ([9], "length", 3)
    out = orjson.loads(ex.client_event(event))
    expect_meta = {"id": "pub", "finish_reason": {"type": "length", "length": 5}, "prompt_tokens": 2,
                   "weight_version": "default", "completion_tokens": 3, "cached_tokens": 1}
    if incremental:
        assert out == {"text": "c", "output_ids": [9], "meta_info": {
            **expect_meta, "input_token_logprobs": [], "output_token_logprobs": [[-0.125, 9, None]]}}
    else:
        assert out == {"text": "abc", "output_ids": [7, 8, 9], "meta_info": {
            **expect_meta, "input_token_logprobs": [[None, 1, None]],
            "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None], [-0.125, 9, None]]}}
