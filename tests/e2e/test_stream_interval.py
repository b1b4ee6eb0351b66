"""Several tokens per streamed event on the vLLM route (``sim --protocol vllm
--stream-interval N``, as vLLM sends under load): each chunk's logprob
entries are the entries of its own tokens, and the frontend passes the
chunks on as the engine sent them, on both worker classes. (The SGLang side
is in ``test_sglang_endpoints.py``.)"""

from __future__ import annotations

import orjson
import pytest

from support import sse, start_frontend, start_sim

pytestmark = pytest.mark.e2e

GEN = "/inference/v1/generate"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def pair(request):
    sim = start_sim("vllm", extra=["--stream-interval", "3"])
    fe = start_frontend([f"vllm={sim.url}"], worker_class=request.param)
    yield fe, sim
    fe.stop()
    sim.stop()


def test_vllm_chunks_carry_n_tokens_with_their_logprobs(pair):
    fe, sim = pair
    body = {"token_ids": [785, 2226, 374], "stream": True, "request_id": "si",
            "sampling_params": {"max_tokens": 8, "ignore_eos": True, "logprobs": 1}}
    status, direct = sse(sim.url, body, GEN, headers=JSON)
    f_status, through = sse(fe.url, body, GEN, headers=JSON)
    assert (status, f_status) == (200, 200) and direct[-1] == through[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in direct[:-1]]
    assert [orjson.loads(e) for e in through[:-1]] == chunks
    choices = [c["choices"][0] for c in chunks]
    assert [len(c["token_ids"]) for c in choices] == [3, 3, 2]
    assert [c["finish_reason"] for c in choices] == [None, None, "length"]
    for c in choices:  # older vLLM labels entries "token_id:N", newer gives token_id
        ids = [e["token_id"] if "token_id" in e else int(e["token"].split(":")[1]) for e in c["logprobs"]["content"]]
        assert ids == c["token_ids"]
