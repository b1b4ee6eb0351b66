"""vLLM ``usage.prompt_tokens_details`` byte for byte, as vLLM 0.33 answers
it (``ServingTokens`` in ``vllm/entrypoints/scale_out/token_in_token_out/
serving.py``), from the simulator directly and through the frontend,
aggregated and prefill/decode.

With ``--enable-prompt-tokens-details`` every final usage carries
``PromptTokenUsageInfo`` with the prefix-cache hit as ``cached_tokens``, 0 on
a cold cache included: a unary answer keeps its null fields (``model_dump``),
a stream's closing usage chunk drops them (``exclude_none``). Without the
flag a unary answer's ``prompt_tokens_details`` is null and a stream's is
absent. A P/D answer carries the prefill leg's hit, rendered as the decode
leg's answer renders it.
"""

from __future__ import annotations

import httpx
import orjson
import pytest
from support import sse, start_frontend, start_sim

pytestmark = pytest.mark.e2e

GEN = "/inference/v1/generate"
JSON = {"content-type": "application/json"}
#: 40 prompt tokens: a warm cache holds 39 of them, counted in whole 16-token blocks.
PROMPT_LEN, WARM = 40, 32


@pytest.fixture(scope="module", params=[True, False], ids=["details", "no-details"])
def served(request):
    """``(flag, {"direct", "aggregated", "pd": url})``: a simulator, a
    frontend in front of it, and a P/D frontend in front of a producer and a
    consumer, all with the flag on or all with it off."""
    flag = ["--enable-prompt-tokens-details"] * request.param
    agg = start_sim("vllm", cold=False, extra=flag)
    prefill = start_sim("vllm", cold=False, extra=["--kv-role", "producer", *flag])
    decode = start_sim("vllm", cold=False, extra=["--kv-role", "consumer", *flag])
    procs = [agg, prefill, decode]
    try:
        procs.append(start_frontend([f"vllm={agg.url}"]))
        procs.append(start_frontend([], extra=["--disaggregation", "always", "--prefill", f"vllm={prefill.url}",
                                               "--decode", f"vllm={decode.url}"]))
        yield request.param, {"direct": agg.url, "aggregated": procs[3].url, "pd": procs[4].url}
    finally:
        for p in reversed(procs):
            p.stop()


def _usage(cached: int | None, stream: bool) -> bytes:
    """vLLM 0.33's final ``usage`` JSON for one output token (``cached``
    ``None``: the flag off)."""
    usage = {"prompt_tokens": PROMPT_LEN, "total_tokens": PROMPT_LEN + 1, "completion_tokens": 1,
             "prompt_tokens_details": None, "completion_tokens_details": None}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached, "created_cache_tokens": None,
                                          "multimodal_tokens": None}
    if stream:
        usage = {k: v for k, v in usage.items() if v is not None}
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return orjson.dumps(usage)


def _answered_usage(url: str, body: dict) -> bytes:
    """The raw ``usage`` JSON of the unary answer, or of the stream's closing chunk."""
    if body.get("stream"):
        status, events = sse(url, body, GEN)
        assert status == 200 and events[-1] == b"[DONE]"
        raw = events[-2]
        assert raw.startswith(b'{"request_id":"generate-tokens-') and b'"choices":[]' in raw
    else:
        r = httpx.post(url + GEN, content=orjson.dumps(body), headers=JSON, timeout=30)
        assert r.status_code == 200
        raw = r.content
    # orjson keeps the key order and writes the same compact JSON vLLM's
    # answer and the simulator's do.
    return orjson.dumps(orjson.loads(raw)["usage"])


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("path", ["direct", "aggregated", "pd"])
def test_usage_is_vllms_on_a_cold_and_a_warm_cache(served, path, stream):
    flag, urls = served
    # A prompt of its own per case, so the first request finds the cache cold.
    first = 1000 + 100 * ["direct", "aggregated", "pd"].index(path) + 50 * stream
    body = {"model": "sim", "request_id": f"details-{path}-{stream}",
            "token_ids": list(range(first, first + PROMPT_LEN)), "sampling_params": {"max_tokens": 1}}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    cold, warm = _answered_usage(urls[path], body), _answered_usage(urls[path], body)
    assert cold == _usage(0 if flag else None, stream)
    assert warm == _usage(WARM if flag else None, stream)
