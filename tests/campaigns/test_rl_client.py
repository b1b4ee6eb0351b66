"""A rollout client written from published RL trainers' request shapes runs
through the frontend: SGLang ``/generate`` with batched ``input_ids``,
``n`` samples and ``return_logprob`` (slime, AReaL, verl's SGLang rollouts),
vLLM ``/inference/v1/generate`` with ``n`` samples and ``output_kind``
(vLLM ``RequestOutputKind``: 1 DELTA for streams, 2 FINAL_ONLY for unary
calls), and the trainer's weight update around them: pause, update, continue
(SGLang) and pause/resume (vLLM) while streams of both routes run, then a
cache flush. Every stream completes whole, with the model's samples."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from support import campaign_size, post, sampled, sse, start_frontend, start_sim, stats, wait_until

pytestmark = pytest.mark.e2e

TOKENS = 30
#: Streams of each route. What it catches, a stream cut or lost by the
#: pause, update and continue around it, shows on any stream in flight:
#: 5 of each (20 SGLang entries with n = 2 over 2 prompts), 25 under bench/.
STREAMS = campaign_size(5, 25)
PROMPTS = [[7, 8, 9], [10, 11, 12, 13]]


@pytest.fixture(scope="module")
def rollout():
    # A long first token: every stream is running before the trainer pauses
    # (the streams start in well under a second; 5 s is room for a loaded
    # machine, 8 s at the full size).
    timing = {"ttft_ms": campaign_size(5000, 8000), "itl_ms": 5}
    sims = [start_sim(**timing), start_sim(**timing), start_sim("vllm", **timing), start_sim("vllm", **timing)]
    fe = start_frontend([f"sglang={s.url}" for s in sims[:2]] + [f"vllm={s.url}" for s in sims[2:]],
                        worker_class="asyncio")
    yield fe, sims
    fe.stop()
    for s in sims:
        s.stop()


def sglang_rollout(k: int) -> dict:
    return {"input_ids": PROMPTS, "rid": f"step3-g{k}", "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0, "n": 2}}


def vllm_rollout(k: int) -> dict:
    return {"token_ids": PROMPTS[k % 2], "stream": True, "request_id": f"step3-v{k}",
            "sampling_params": {"max_tokens": TOKENS, "ignore_eos": True, "n": 2, "logprobs": 0, "output_kind": 1}}


def test_rollout_with_a_weight_update_while_streams_run(rollout):
    fe, sims = rollout
    results: dict = {}

    def run(key: str, body: dict, path: str) -> None:
        results[key] = sse(fe.url, body, path)

    jobs = [(f"s{k}", sglang_rollout(k), "/generate") for k in range(STREAMS)]
    jobs += [(f"v{k}", vllm_rollout(k), "/inference/v1/generate") for k in range(STREAMS)]
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    # SGLang streams x 4 entries, vLLM streams (their 2 choices run under one id).
    wait_until(lambda: sum(stats(s)["running"] for s in sims[:2]) == 4 * STREAMS
               and sum(stats(s)["running"] for s in sims[2:]) == STREAMS, timeout=30, interval=0.2)
    assert httpx.post(fe.url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert httpx.post(fe.url + "/pause?mode=keep").status_code == 200
    upd = httpx.post(fe.url + "/update_weights_from_disk", json={"model_path": "/ckpt/step-4"})
    assert (upd.status_code, upd.json()["success"]) == (200, True)
    assert all(t.is_alive() for t in threads)
    assert httpx.post(fe.url + "/continue_generation").status_code == 200
    assert httpx.post(fe.url + "/resume").status_code == 200
    for t in threads:
        t.join(60)
    assert len(results) == 2 * STREAMS
    for k in range(STREAMS):
        status, events = results[f"s{k}"]
        assert (status, events[-1]) == (200, b"[DONE]")
        last = {}
        for e in events[:-1]:
            chunk = orjson.loads(e)
            last[chunk["index"]] = chunk
        # Prompt-major: entry i * 2 + s is sample s of prompt i.
        assert [last[j]["output_ids"] for j in range(4)] == [sampled(PROMPTS[j // 2], j % 2, TOKENS, True) for j in range(4)]
        assert all(len(last[j]["meta_info"]["output_token_logprobs"]) == TOKENS for j in range(4))
        assert {last[j]["meta_info"]["finish_reason"]["type"] for j in range(4)} == {"length"}
    for k in range(STREAMS):
        status, events = results[f"v{k}"]
        assert (status, events[-1]) == (200, b"[DONE]")
        got: dict = {0: [], 1: []}
        for e in events[:-1]:
            chunk = orjson.loads(e)
            assert chunk["request_id"] == f"generate-tokens-step3-v{k}"
            for c in chunk["choices"]:
                got[c["index"]] += c["token_ids"]
        assert got == {s: sampled(PROMPTS[k % 2], s, TOKENS, True) for s in (0, 1)}
    assert sum(stats(s)["running"] for s in sims) == 0
    flushed = httpx.post(fe.url + "/flush_cache")
    assert flushed.status_code == 200
    # The trainer's next step: unary calls with FINAL_ONLY output and batched
    # prompts (at once: each waits out the long first token).
    with ThreadPoolExecutor(2) as pool:
        final, batch = pool.map(lambda args: post(fe.url, *args).json(), [
            ({"token_ids": PROMPTS[0], "sampling_params": {"max_tokens": 3, "n": 3, "output_kind": 2}},
             "/inference/v1/generate"),
            ({"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 3}},)])
    assert [c["token_ids"] for c in final["choices"]] == [sampled(PROMPTS[0], s, 3) for s in range(3)]
    assert [a["output_ids"] for a in batch] == [sampled(p, 0, 3) for p in PROMPTS]
