"""``asgi-generate sim`` with the capacity model's flags: the engines' own
refusal of an overflowing queue, their load figures and gauges while
requests run, retraction and preemption counted, and a frontend in front
that still answers token for token what an unloaded engine would."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from asgi_generate.sim.capacity import SGLANG_QUEUE_FULL, VLLM_QUEUE_OVERFLOW
from support import post, sampled, start_frontend, start_sim, stats, wait_until

pytestmark = pytest.mark.e2e

GEN = "/inference/v1/generate"


def _capacity(sim) -> dict:
    return stats(sim)["capacity"]


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_sglang_queue_full_and_loads(worker_class):
    sim = start_sim("sglang", extra=["--max-running-requests", "1", "--max-queued-requests", "1",
                                     "--step-ms", "2", "--worker-class", worker_class])
    try:
        body = {"input_ids": [10] * 4, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, sim.url, body, timeout=60)
            wait_until(lambda: _capacity(sim)["running"] == 1)
            waiting = pool.submit(post, sim.url, {**body, "input_ids": [11] * 4}, timeout=60)
            wait_until(lambda: _capacity(sim)["waiting"] == 1)
            refused = post(sim.url, {"input_ids": [7, 7], "sampling_params": {"max_new_tokens": 3}})
            assert refused.status_code == 503
            assert refused.json() == {"object": "error", "message": SGLANG_QUEUE_FULL, "type": "503",
                                      "param": None, "code": 503}
            load = httpx.get(sim.url + "/v1/loads", timeout=5).json()["loads"][0]
            assert (load["num_running_reqs"], load["num_waiting_reqs"], load["max_running_requests"]) == (1, 1, 1)
            # The running request holds its prompt and output; the waiting one's 4 tokens are pending.
            assert 4 <= load["num_used_tokens"] <= 204
            assert load["num_total_tokens"] == load["num_active_tokens"] == load["num_used_tokens"] + 4
            assert load["token_usage"] == load["num_used_tokens"] / 262144
            for prompt, answer in (([10] * 4, running), ([11] * 4, waiting)):
                r = answer.result()
                assert r.status_code == 200 and r.json()["output_ids"] == sampled(prompt, 0, 200, ignore_eos=True)
        assert _capacity(sim)["queue_refusals"] == 1
    finally:
        sim.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_sglang_identical_tokens_through_the_frontend_under_retraction(worker_class):
    # 300 tokens hold two 4-token prompts at first, not both of their 200 new tokens.
    sim = start_sim("sglang", extra=["--max-total-tokens", "300", "--step-ms", "2", "--worker-class", worker_class])
    fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class)
    try:
        prompts = [[10 + i] * 4 for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(post, fe.url, {"input_ids": p, "sampling_params": {
                "max_new_tokens": 200, "ignore_eos": True}}, timeout=60) for p in prompts]
            for prompt, answer in zip(prompts, answers):
                r = answer.result()
                assert r.status_code == 200 and r.json()["output_ids"] == sampled(prompt, 0, 200, ignore_eos=True)
        cap = _capacity(sim)
        assert cap["retractions"] >= 1 and (cap["running"], cap["waiting"], cap["kv_used"]) == (0, 0, 0)
        load = httpx.get(sim.url + "/v1/loads", timeout=5).json()["loads"][0]
        assert (load["max_total_num_tokens"], load["num_used_tokens"], load["token_usage"]) == (300, 0, 0.0)
    finally:
        fe.stop()
        sim.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_vllm_overflow_gauges_and_identical_tokens_under_preemption(worker_class):
    # 10 blocks of 4 tokens; three 8-token prompts growing to 38 tokens each.
    sim = start_sim("vllm", extra=["--block-size", "4", "--num-gpu-blocks-override", "10",
                                   "--max-num-queued-reqs", "3", "--step-ms", "2", "--worker-class", worker_class])
    fe = start_frontend([f"vllm={sim.url}"], worker_class=worker_class)
    try:
        prompts = [[10 + i] * 8 for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(post, fe.url, {"token_ids": p, "sampling_params": {
                "max_tokens": 30, "ignore_eos": True}}, GEN, timeout=60) for p in prompts]
            wait_until(lambda: (lambda c: c["running"] + c["waiting"] == 3)(_capacity(sim)))
            refused = post(sim.url, {"token_ids": [7, 7], "sampling_params": {"max_tokens": 3}}, GEN)
            assert refused.status_code == 503
            assert refused.json() == {"error": {"message": VLLM_QUEUE_OVERFLOW, "type": "Service Unavailable",
                                                "param": None, "code": 503}}
            metrics = _gauges(sim)
            assert metrics["vllm:num_requests_running"] + metrics["vllm:num_requests_waiting"] == 3.0
            assert 0.0 < metrics["vllm:kv_cache_usage_perc"] <= 1.0
            for prompt, answer in zip(prompts, answers):
                r = answer.result()
                assert r.status_code == 200
                assert r.json()["choices"][0]["token_ids"] == sampled(prompt, 0, 30, ignore_eos=True)
        cap = _capacity(sim)
        assert cap["preemptions"] >= 1 and cap["queue_refusals"] == 1
        metrics = _gauges(sim)
        assert metrics["vllm:num_preemptions_total"] == float(cap["preemptions"])
        assert (metrics["vllm:num_requests_running"], metrics["vllm:num_requests_waiting"],
                metrics["vllm:kv_cache_usage_perc"]) == (0.0, 0.0, 0.0)
    finally:
        fe.stop()
        sim.stop()


def _gauges(sim) -> dict[str, float]:
    """``/metrics`` as ``{name: value}`` (one series each: the labels are checked too)."""
    out = {}
    for line in httpx.get(sim.url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, labels = series.split("{", 1)
            assert labels == 'engine="0",model_name="sim"}'
            out[name] = float(value)
    return out
