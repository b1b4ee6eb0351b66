"""SGLang native parity: the frontend answers exactly as the worker would.

Each request goes to a simulator directly and through the frontend (real
hypercorn, both worker classes); the answers must be equal value for value,
timing fields aside.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from support import post, sse, without_timing

pytestmark = pytest.mark.e2e

PROMPT = [785, 2226, 374, 220, 19, 1010, 77, 3000]
CASES = {
    "ids": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16}},
    "text": {"text": "def main():\n    return 42", "sampling_params": {"max_new_tokens": 12}},
    "one-token-prompt": {"input_ids": [1234], "sampling_params": {"max_new_tokens": 5}},
    "max-1": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}},
    "max-256": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 256, "ignore_eos": True}},
    "logprobs-top0": {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 0,
                      "sampling_params": {"max_new_tokens": 6}},
    "logprobs-top3": {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 3,
                      "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 6}},
    "logprobs-start0": {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                        "top_logprobs_num": 3, "sampling_params": {"max_new_tokens": 4}},
    "logprobs-start-1": {"input_ids": [7], "return_logprob": True, "logprob_start_len": -1,
                         "sampling_params": {"max_new_tokens": 4}},
    "interval-3": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10, "stream_interval": 3}},
    "interval-4-logprobs": {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
                            "token_ids_logprob": [5, 9], "sampling_params": {"max_new_tokens": 9, "stream_interval": 4}},
    "routed-experts": {"input_ids": PROMPT, "return_routed_experts": True,
                       "sampling_params": {"max_new_tokens": 5}},
    "passthrough-fields": {"input_ids": PROMPT, "lora_path": None, "image_data": None,
                           "sampling_params": {"max_new_tokens": 3, "temperature": 0.7,
                                               "custom_params": {"x": 1}, "no_stop_trim": False,
                                               "spaces_between_special_tokens": True}},
}


def _stop_case(sim) -> dict:
    """A request whose third greedy token is made a stop token."""
    first = post(sim.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}}).json()
    stop = first["output_ids"][2]
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [stop]}}


def _with_rid(body: dict, rid: str, stream: bool) -> dict:
    return {**body, "rid": rid, "stream": stream}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unary_parity(frontend, sims, case):
    body = _with_rid(CASES[case], f"u-{case}", False)
    direct = post(sims[0].url, body)
    through = post(frontend.url, body)
    assert direct.status_code == through.status_code == 200
    assert through.headers["content-type"] == "application/json"
    assert without_timing(through.json()) == without_timing(direct.json())


@pytest.mark.parametrize("case", sorted(CASES))
def test_sse_parity(frontend, sims, case):
    body = _with_rid(CASES[case], f"s-{case}", True)
    d_status, direct = sse(sims[0].url, body)
    f_status, through = sse(frontend.url, body)
    assert d_status == f_status == 200
    assert direct[-1] == through[-1] == b"[DONE]"
    assert len(through) == len(direct)
    assert [without_timing(orjson.loads(e)) for e in through[:-1]] == [
        without_timing(orjson.loads(e)) for e in direct[:-1]
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token(frontend, sims, stream):
    body = _with_rid(_stop_case(sims[0]), "stop", stream)
    stop = body["sampling_params"]["stop_token_ids"][0]
    if stream:
        _, events = sse(frontend.url, body)
        final = orjson.loads(events[-2])
    else:
        final = post(frontend.url, body).json()
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(final["output_ids"]) == 3 and final["output_ids"][-1] == stop
    direct = post(sims[1].url, {**body, "stream": False}).json()
    assert without_timing(final) == without_timing(direct)


def test_cumulative_chunks_grow_by_one_token(frontend):
    _, events = sse(frontend.url, {"input_ids": PROMPT, "stream": True, "rid": "grow",
                                   "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}})
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 11))
    for a, b in zip(chunks, chunks[1:]):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 9
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_no_rid_gets_a_32_hex_id(frontend):
    resp = post(frontend.url, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    rid = resp.json()["meta_info"]["id"]
    assert len(rid) == 32 and int(rid, 16) >= 0


def test_put_is_served_like_post(frontend):
    body = {"input_ids": PROMPT, "rid": "put", "sampling_params": {"max_new_tokens": 4}}
    a = post(frontend.url, body).json()
    put = httpx.put(frontend.url + "/generate", content=orjson.dumps(body), timeout=10)
    assert put.status_code == 200
    assert without_timing(put.json()) == without_timing(a)
