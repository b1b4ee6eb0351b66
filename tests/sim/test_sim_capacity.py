"""The simulator's capacity model (``asgi_generate.sim.capacity``): each
engine's limits, queue refusals, retraction and preemption, priority order,
load figures and gauges, and answers that stay the same value for value.
In process: the scheduler stepped by hand, and the ASGI app driven as a
client would."""

from __future__ import annotations

import anyio
import orjson
import pytest

from asgi_generate.sim.app import SimApp
from asgi_generate.sim.capacity import (
    SGLANG_PRIORITY_DISABLED, SGLANG_QUEUE_EVICTED, SGLANG_QUEUE_FULL, VLLM_QUEUE_OVERFLOW, VLLM_QUEUED_TOKENS,
)
from asgi_generate.sim.capacity_flags import capacity_config
from asgi_generate.sim.engine import RECENT_RIDS, Job, SimEngine
from asgi_generate.sim.loads import sglang_loads, vllm_metrics
from asgi_generate.sim.tokenizer import SimTokenizer
from support import asgi_request, sampled


#: The app-level tests run under both event loops the server runs on.
BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])


def _engine(protocol: str, block_size: int = 1, **flags) -> SimEngine:
    return SimEngine(SimTokenizer().model(), capacity=capacity_config(protocol, block_size, **flags),
                     cache_tokens=0)


def _run(engine: SimEngine, steps: int = 5000) -> list[str]:
    """Step the scheduler by hand, each generator taking its token at once;
    the rids in the order they finished."""
    cap, done = engine.capacity, []
    for _ in range(steps):
        if not cap.entries:
            return done
        cap.step_now()
        for entry in list(cap.entries.values()):
            if entry.credit:
                entry.credit = False
                if entry.generated >= entry.max_new:
                    engine.finish(entry.job)
                    done.append(entry.job.rid)
    raise AssertionError("the scheduler did not finish its requests")


def _job(rid: str, first: int, prompt: int, max_new: int, priority: int | None = None) -> Job:
    return Job(rid, [first] * prompt, max_new, ignore_eos=True, priority=priority)


def test_off_unless_a_flag_is_set():
    assert capacity_config("sglang", 1) is None
    assert capacity_config("vllm", 16, scheduling_policy="fcfs") is None
    assert SimApp("sglang").engine.capacity is None
    assert "capacity" not in SimApp("vllm").engine.stats()


@pytest.mark.parametrize("protocol, flag, field", [("vllm", "max_num_queued_tokens", "max_queued_tokens"),
                                                   ("vllm", "max_num_queued_reqs", "max_queued"),
                                                   ("sglang", "max_queued_requests", "max_queued")])
def test_a_queue_limit_of_0_is_a_limit_not_unset(protocol, flag, field):
    # vLLM's check_admission refuses every request at 0 (async_llm.py); SGLang's queue holds none.
    config = capacity_config(protocol, 16, **{flag: 0})
    assert config is not None and getattr(config, field) == 0


@pytest.mark.parametrize("protocol, flags, message", [
    ("sglang", {"max_running_requests": 0}, "--max-running-requests must be a positive integer, got 0"),
    ("sglang", {"max_total_tokens": -5}, "--max-total-tokens must be a positive integer, got -5"),
    ("sglang", {"max_queued_requests": -1}, "--max-queued-requests must be an integer of at least 0, got -1"),
    ("vllm", {"max_num_seqs": 0}, "--max-num-seqs must be a positive integer, got 0"),
    ("vllm", {"num_gpu_blocks_override": 0}, "--num-gpu-blocks-override must be a positive integer, got 0"),
    ("vllm", {"scheduling_policy": "lifo"}, "--scheduling-policy must be fcfs or priority, got 'lifo'"),
    ("vllm", {"max_running_requests": 4}, "--max-running-requests is SGLang's; this simulator plays vllm"),
    ("sglang", {"max_num_seqs": 4}, "--max-num-seqs is vLLM's; this simulator plays sglang"),
    ("sglang", {"step_ms": -1.0}, "--step-ms must be at least 0, got -1.0"),
    ("vllm", {"max_num_queued_tokens": -1}, "--max-num-queued-tokens must be an integer of at least 0, got -1"),
    ("vllm", {"priority_scheduling_preemption_threshold": 3},
     "--priority-scheduling-preemption-threshold is SGLang's; this simulator plays vllm"),
    ("sglang", {"max_num_queued_tokens": 8}, "--max-num-queued-tokens is vLLM's; this simulator plays sglang"),
    ("vllm", {"max_queued_requests": 0}, "--max-queued-requests is SGLang's; this simulator plays vllm"),
    ("sglang", {"schedule_low_priority_values_first": True},
     "--schedule-low-priority-values-first needs --enable-priority-scheduling"),
])
def test_flags_are_validated(protocol, flags, message):
    with pytest.raises(ValueError) as err:
        capacity_config(protocol, 16, **flags)
    assert str(err.value) == message


def test_step_time_replaces_the_fixed_latencies():
    with pytest.raises(ValueError, match="drop --ttft-ms"):
        SimApp("sglang", ttft_ms=5, capacity=capacity_config("sglang", 1, step_ms=1.0))


def test_sglang_retracts_the_fewest_output_tokens_and_recomputes():
    # 300 tokens: two 4-token prompts with 200 new tokens each fit the
    # reservation at first (4 + 200 * 0.7 each), not once both decode.
    engine = _engine("sglang", max_total_tokens=300)
    for i in range(3):
        engine.submit(_job(f"r{i}", 10 + i, 4, 200))
    cap = engine.capacity
    cap.step_now()
    assert [e.job.rid for e in cap.running] == ["r0", "r1"] and cap.sequences() == (2, 1)
    assert _run(engine) == ["r0", "r2", "r1"]
    stats = cap.stats()
    assert (stats["retractions"], stats["preemptions"], stats["peak_running"], stats["kv_used"]) == (1, 0, 2, 0)


def test_sglang_aborts_a_retracted_request_that_meets_a_full_queue():
    # As above, with a queue of one: r2 waits, so r1 retracted finds it full
    # (Scheduler._add_request_to_queue applies the limit to retracted requests).
    engine = _engine("sglang", max_total_tokens=300, max_queued_requests=1)
    jobs = [_job(f"r{i}", 10 + i, 4, 200) for i in range(3)]
    engine.submit(jobs[0])
    engine.submit(jobs[1])
    engine.capacity.step_now()  # both run: the queue is empty again
    engine.submit(jobs[2])
    assert _run(engine) == ["r0", "r2"]
    assert jobs[1].refused == (503, SGLANG_QUEUE_FULL) and engine.capacity.sequences() == (0, 0)
    assert (engine.capacity.retractions, engine.capacity.queue_refusals) == (1, 1)


def test_vllm_preempts_the_last_running_and_recomputes():
    # 10 blocks of 4 tokens; three 8-token prompts growing to 38 tokens.
    engine = _engine("vllm", 4, num_gpu_blocks_override=10, max_num_seqs=4)
    for i in range(3):
        engine.submit(_job(f"v{i}", 10 + i, 8, 30))
    assert _run(engine) == ["v0", "v1", "v2"]
    assert (engine.capacity.preemptions, engine.capacity.retractions) == (3, 0)


def test_vllm_max_num_seqs_and_batched_tokens():
    engine = _engine("vllm", 16, max_num_seqs=2, max_num_batched_tokens=10)
    for i in range(3):
        engine.submit(_job(f"v{i}", 10 + i, 8, 3))
    cap = engine.capacity
    # The budget of 10 takes v0's 8 prompt tokens and 2 of v1's (chunked).
    assert cap.step_now() == (0, 10)
    assert [(e.job.rid, e.computed) for e in cap.running] == [("v0", 8), ("v1", 2)]
    assert cap.sequences() == (2, 1)


def test_priority_orders_the_queue():
    sglang = _engine("sglang", max_running_requests=1, enable_priority_scheduling=True)
    for rid, prio in (("a", None), ("b", 1), ("c", 5), ("d", None), ("e", 1)):
        sglang.submit(_job(rid, 10, 4, 2, prio))
    # Larger first; none is the lowest; ties in arrival order.
    assert _run(sglang) == ["c", "b", "e", "a", "d"]
    low = _engine("sglang", max_running_requests=1, enable_priority_scheduling=True,
                  schedule_low_priority_values_first=True)
    for rid, prio in (("a", None), ("b", 1), ("c", 5)):
        low.submit(_job(rid, 10, 4, 2, prio))
    assert _run(low) == ["b", "c", "a"]
    vllm = _engine("vllm", 16, max_num_seqs=1, scheduling_policy="priority")
    for rid, prio in (("a", 0), ("b", 3), ("c", -2)):
        vllm.submit(_job(rid, 10, 4, 2, prio))
    assert _run(vllm) == ["c", "a", "b"]  # smaller first
    fcfs = _engine("vllm", 16, max_num_seqs=1)
    for rid, prio in (("a", 0), ("b", 3), ("c", -2)):
        fcfs.submit(_job(rid, 10, 4, 2, prio))
    assert _run(fcfs) == ["a", "b", "c"]  # FCFS ignores priority


@pytest.mark.parametrize("flags", [{}, {"max_num_seqs": 4}])
def test_vllm_serves_a_nonzero_priority_without_priority_scheduling(flags):
    # vLLM 0.33.0 refuses no priority under FCFS, whatever GenerateRequest.priority's
    # description says: no check in serve_tokens, AsyncLLM.add_request,
    # InputProcessor.process_inputs or Scheduler.add_request; the FCFS queue ignores it.
    app = SimApp("vllm", capacity=capacity_config("vllm", 16, **flags), cache_tokens=0)
    for priority in (7, -3, "2"):
        status, _, raw = anyio.run(asgi_request, app, "POST", "/inference/v1/generate", orjson.dumps(
            {"token_ids": [5, 6], "priority": priority, "sampling_params": {"max_tokens": 3, "ignore_eos": True}}))
        assert (status, orjson.loads(raw)["choices"][0]["token_ids"]) == (200, sampled([5, 6], 0, 3, True))


def test_sglang_priority_when_disabled_is_ignored_or_aborted():
    ignored = _engine("sglang", max_running_requests=1)
    for rid, prio in (("a", None), ("b", 7)):
        ignored.submit(_job(rid, 10, 4, 2, prio))
    assert _run(ignored) == ["a", "b"]
    strict = _engine("sglang", abort_on_priority_when_disabled=True)
    job, plain = _job("p", 10, 4, 2, 7), _job("q", 10, 4, 2)
    strict.submit(job)
    strict.submit(plain)
    assert job.refused == (503, SGLANG_PRIORITY_DISABLED) and plain.refused is None
    assert _run(strict) == ["q"]


def test_sglang_full_queue_refuses_or_evicts_the_least_preferred():
    engine = _engine("sglang", max_running_requests=1, max_queued_requests=1, enable_priority_scheduling=True)
    jobs = [_job("run", 10, 4, 5, 0), _job("low", 11, 4, 5, 0), _job("high", 12, 4, 5, 9), _job("lower", 13, 4, 5, -3)]
    engine.submit(jobs[0])
    engine.capacity.step_now()  # "run" runs; the queue is empty
    for job in jobs[1:]:
        engine.submit(job)
    assert jobs[1].refused == (503, SGLANG_QUEUE_EVICTED)
    assert jobs[2].refused is None
    assert jobs[3].refused == (503, SGLANG_QUEUE_FULL)
    assert [e.job.rid for e in engine.capacity.waiting] == ["high"] and engine.capacity.queue_refusals == 2


def test_load_figures_and_gauges_are_the_schedulers():
    sglang = _engine("sglang", max_running_requests=2, max_total_tokens=1000)
    for i in range(3):
        sglang.submit(_job(f"r{i}", 10 + i, 6, 50))
    sglang.capacity.step_now()  # two prefills of 6 tokens; one waits
    status, body, _ = sglang_loads(sglang, b"", "0.5.23", 262144)
    load = orjson.loads(body)["loads"][0]
    assert status == 200
    assert {k: load[k] for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens",
                                 "num_active_tokens", "max_total_num_tokens", "max_running_requests",
                                 "token_usage")} == {
        "num_running_reqs": 2, "num_waiting_reqs": 1, "num_used_tokens": 12, "num_total_tokens": 18,
        "num_active_tokens": 18, "max_total_num_tokens": 1000, "max_running_requests": 2, "token_usage": 0.012}
    vllm = _engine("vllm", 16, max_num_seqs=1, num_gpu_blocks_override=8)
    for i in range(2):
        vllm.submit(_job(f"v{i}", 10 + i, 20, 5))
    vllm.capacity.step_now()  # 20 prompt tokens: 2 of 8 blocks
    labels = 'engine="0",model_name="m"'
    assert vllm_metrics(vllm, "m").decode().splitlines()[2::3] == [
        f"vllm:num_requests_running{{{labels}}} 1.0",
        f"vllm:num_requests_waiting{{{labels}}} 1.0",
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.25",
        f"vllm:num_preemptions_total{{{labels}}} 0.0",
    ]


# -- through the ASGI app ---------------------------------------------------


async def _until(predicate, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


@BACKENDS
def test_sglang_identical_tokens_under_retraction(backend):
    cap = capacity_config("sglang", 1, max_total_tokens=300, step_ms=1.0)
    app = SimApp("sglang", capacity=cap, cache_tokens=0)
    prompts = [[10 + i] * 4 for i in range(3)]
    answers: dict[int, tuple[int, dict]] = {}

    async def one(i: int) -> None:
        body = {"input_ids": prompts[i], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        status, _, raw = await asgi_request(app, "POST", "/generate", orjson.dumps(body))
        answers[i] = status, orjson.loads(raw)

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)

    anyio.run(run, backend=backend)
    for i in range(3):
        status, body = answers[i]
        assert status == 200 and body["output_ids"] == sampled(prompts[i], 0, 200, ignore_eos=True)
    assert app.engine.capacity.retractions >= 1


@BACKENDS
def test_vllm_overflow_answer_and_identical_tokens_under_preemption(backend):
    cap = capacity_config("vllm", 4, num_gpu_blocks_override=10, max_num_queued_reqs=3, step_ms=1.0)
    app = SimApp("vllm", block_size=4, capacity=cap, cache_tokens=0)
    prompts = [[10 + i] * 8 for i in range(3)]
    answers: dict[int, tuple[int, dict]] = {}

    async def one(i: int) -> None:
        body = {"token_ids": prompts[i], "sampling_params": {"max_tokens": 30, "ignore_eos": True},
                "request_id": f"q{i}"}
        status, _, raw = await asgi_request(app, "POST", "/inference/v1/generate", orjson.dumps(body))
        answers[i] = status, orjson.loads(raw)

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
            await _until(lambda: app.engine.capacity.unfinished() == 3)
            status, _, raw = await asgi_request(app, "POST", "/inference/v1/generate", orjson.dumps(
                {"token_ids": [7, 7], "sampling_params": {"max_tokens": 3}}))
            answers[3] = status, orjson.loads(raw)

    anyio.run(run, backend=backend)
    assert answers[3] == (503, {"error": {"message": VLLM_QUEUE_OVERFLOW, "type": "Service Unavailable",
                                          "param": None, "code": 503}})
    for i in range(3):
        status, body = answers[i]
        assert status == 200 and body["choices"][0]["token_ids"] == sampled(prompts[i], 0, 30, ignore_eos=True)
    assert app.engine.capacity.preemptions == 3
    status, _, raw = anyio.run(asgi_request, app, "GET", "/metrics", backend=backend)
    assert 'vllm:num_preemptions_total{engine="0",model_name="sim"} 3.0' in raw.decode().splitlines()


def test_vllm_max_num_queued_tokens_counts_prompts_until_their_first_token():
    # AsyncLLM.check_admission: refused once the prefilling prompts reach the limit (>=, the
    # newcomer's own prompt not counted); a sequence stops counting at its first token.
    engine = _engine("vllm", 16, max_num_seqs=2, max_num_queued_tokens=12)
    cap = engine.capacity
    assert cap.config.max_queued_tokens == 12 and cap.vllm_admission(1) is None
    engine.submit(_job("a", 10, 8, 3))
    assert (cap.prefilling_tokens(), cap.vllm_admission(1)) == (8, None)
    engine.submit(Job("b", [11] * 2, 3, ignore_eos=True, seqs=2))  # n = 2: two prompts prefilling
    assert cap.prefilling_tokens() == 12
    assert (cap.vllm_admission(1), cap.vllm_admission(5)) == (VLLM_QUEUED_TOKENS, VLLM_QUEUED_TOKENS)
    cap.step_now()  # a's prefill gives its first token; b's two sequences wait for two free seats
    assert (cap.prefilling_tokens(), cap.vllm_admission(1)) == (4, None)
    assert _run(engine) == ["a", "b"] and cap.prefilling_tokens() == 0
    assert (cap.queued_token_refusals, cap.queue_refusals) == (2, 0)
    stats = cap.stats()
    assert (stats["max_queued_tokens"], stats["queued_token_refusals"]) == (12, 2)
    # --max-num-queued-reqs is checked first.
    both = _engine("vllm", 16, max_num_queued_reqs=1, max_num_queued_tokens=1)
    both.submit(_job("c", 10, 4, 2))
    assert both.capacity.vllm_admission(1) == VLLM_QUEUE_OVERFLOW


@BACKENDS
def test_vllm_max_num_queued_tokens_answer_and_identical_tokens(backend):
    cap = capacity_config("vllm", 16, max_num_seqs=1, max_num_queued_tokens=8, step_ms=1.0)
    app = SimApp("vllm", capacity=cap, cache_tokens=0)
    prompts = {"a": [10] * 4, "b": [11] * 8}
    answers: dict[str, tuple[int, dict]] = {}

    async def one(rid: str, ids: list[int], max_tokens: int = 40) -> None:
        body = {"token_ids": ids, "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
                "request_id": rid}
        status, _, raw = await asgi_request(app, "POST", "/inference/v1/generate", orjson.dumps(body))
        answers[rid] = status, orjson.loads(raw)

    async def run() -> None:
        capacity = app.engine.capacity
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "a", prompts["a"])
            await _until(lambda: capacity.running and capacity.running[0].generated >= 1)
            tg.start_soon(one, "b", prompts["b"])  # waits for the one seat: 8 prompt tokens prefilling
            await _until(lambda: capacity.prefilling_tokens() == 8)
            await one("c", [12] * 2, 3)

    anyio.run(run, backend=backend)
    assert answers["c"] == (503, {"error": {"message": VLLM_QUEUED_TOKENS, "type": "Service Unavailable",
                                            "param": None, "code": 503}})
    for rid in ("a", "b"):
        status, body = answers[rid]
        assert status == 200 and body["choices"][0]["token_ids"] == sampled(prompts[rid], 0, 40, ignore_eos=True)
    assert app.engine.capacity.queued_token_refusals == 1 and app.engine.received == 2


def test_vllm_n_is_bounded_by_max_num_seqs():
    app = SimApp("vllm", capacity=capacity_config("vllm", 16, max_num_seqs=2))
    status, _, raw = anyio.run(asgi_request, app, "POST", "/inference/v1/generate", orjson.dumps(
        {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2, "n": 3}}))
    assert (status, orjson.loads(raw)) == (400, {"error": {
        "message": "sampling_params.n must be at most the server's max_num_seqs (2), got 3.",
        "type": "BadRequestError", "param": None, "code": 400}})


def test_step_time_is_the_roofline():
    engine = _engine("vllm", 16, step_ms=2.0, step_us_per_seq=100.0, step_us_per_prefill_token=10.0)
    for i in range(2):
        engine.submit(_job(f"v{i}", 10 + i, 8, 3))
    cap = engine.capacity
    # Two prefills of 8 tokens: 2 ms + 2 x 100 us + 16 x 10 us.
    assert cap._schedule().seconds == pytest.approx(0.00236)
    cap.step_now()
    for entry in cap.running:
        entry.credit = False
    assert cap._schedule().seconds == pytest.approx(0.0022)  # two decodes


@BACKENDS
def test_queueing_shows_as_latency(backend):
    # One seat, 5 ms steps: the second request waits out the first's 10 steps.
    cap = capacity_config("vllm", 16, max_num_seqs=1, step_ms=5.0)
    app = SimApp("vllm", capacity=cap, cache_tokens=0)
    took: dict[int, float] = {}

    async def one(i: int) -> None:
        start = anyio.current_time()
        status, _, _ = await asgi_request(app, "POST", "/inference/v1/generate", orjson.dumps(
            {"token_ids": [10 + i] * 4, "sampling_params": {"max_tokens": 10, "ignore_eos": True}}))
        assert status == 200
        took[i] = anyio.current_time() - start

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(one, i)

    anyio.run(run, backend=backend)
    assert app.engine.capacity.steps == 20  # a prefill step with the first token, then 9 decodes, each
    first, second = sorted(took.values())  # trio starts the two in either order
    assert first >= 0.05 and second >= 0.1


@BACKENDS
def test_preemption_keeps_logprobs_and_expert_rows(backend):
    body = {"token_ids": [10] * 8, "sampling_params": {"max_tokens": 30, "ignore_eos": True, "logprobs": 2}}

    async def answers(app: SimApp) -> list[dict]:
        out: list[dict] = []

        async def one(i: int) -> None:
            raw = (await asgi_request(app, "POST", "/inference/v1/generate", orjson.dumps(
                {**body, "token_ids": [10 + i] * 8, "request_id": f"p{i}"})))[2]
            out.append((i, orjson.loads(raw)["choices"][0]))

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
        return [choice for _, choice in sorted(out)]

    cap = capacity_config("vllm", 4, num_gpu_blocks_override=10, step_ms=0.5)
    loaded = SimApp("vllm", block_size=4, capacity=cap, cache_tokens=0, routed_experts=True)
    plain = SimApp("vllm", block_size=4, cache_tokens=0, routed_experts=True)
    got, want = anyio.run(answers, loaded, backend=backend), anyio.run(answers, plain, backend=backend)
    assert loaded.engine.capacity.preemptions >= 1
    assert got == want and all(c["routed_experts"] and len(c["logprobs"]["content"]) == 30 for c in got)


@BACKENDS
def test_a_vanished_client_frees_its_place_in_the_queue(backend):
    cap = capacity_config("sglang", 1, max_running_requests=1, step_ms=2.0)
    app = SimApp("sglang", capacity=cap, cache_tokens=0, disconnect_abort_s=0.0)
    gone = anyio.Event()

    async def queued() -> None:
        sent = [{"type": "http.request", "body": orjson.dumps(
            {"input_ids": [11] * 4, "sampling_params": {"max_new_tokens": 50}}), "more_body": False}]

        async def receive() -> dict:
            if sent:
                return sent.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            pass

        scope = {"type": "http", "method": "POST", "path": "/generate", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")]}
        await app(scope, receive, send)

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(asgi_request, app, "POST", "/generate", orjson.dumps(
                {"input_ids": [10] * 4, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}))
            await _until(lambda: app.engine.capacity.sequences() == (1, 0))
            tg.start_soon(queued)
            await _until(lambda: app.engine.capacity.sequences() == (1, 1))
            gone.set()
            await _until(lambda: app.engine.capacity.sequences() == (1, 0))
            assert app.engine.capacity.stats()["peak_running"] == 1
            tg.cancel_scope.cancel()

    anyio.run(run, backend=backend)


def test_rid_lists_are_bounded_and_counts_exact():
    app = SimApp("vllm")
    count = RECENT_RIDS + 50

    async def run() -> None:
        for i in range(count):
            await asgi_request(app, "POST", "/inference/v1/generate", orjson.dumps(
                {"token_ids": [5], "sampling_params": {"max_tokens": 1}, "request_id": f"m{i}"}))
        await asgi_request(app, "POST", "/abort_requests", orjson.dumps({"request_ids": [f"x{i}" for i in range(count)]}))

    anyio.run(run)
    stats = app.engine.stats()
    assert stats["received"] == count and stats["completed"] == count
    assert len(stats["seen_rids"]) == RECENT_RIDS == stats["recent_rids_max"]
    assert stats["seen_rids"][-1].endswith("m%d" % (count - 1)) and stats["seen_rids"][0].endswith("m50")
    assert len(stats["abort_named_ids"]) == RECENT_RIDS and stats["abort_named_total"] == count


def test_the_step_cache_is_bounded():
    from asgi_generate.sim.model import MAX_CACHED_STEPS

    model = SimTokenizer().model()
    first = model.step(12345)
    for state in range(3 * MAX_CACHED_STEPS):
        model.step(state)
    assert len(model._cache) <= MAX_CACHED_STEPS == 4096
    assert model.step(12345) == first  # recomputed the same


# -- SGLang's priority preemption ---------------------------------------------


def _places(cap) -> tuple[list[str], list[str]]:
    """The running rids (sorted) and the waiting ones in the order the queue takes them."""
    return sorted(e.job.rid for e in cap.running), [e.job.rid for e in sorted(cap.waiting, key=cap._sglang_rank)]


def _by_hand(engine: SimEngine, jobs: list[Job]) -> None:
    """Submit ``jobs`` and step once, every granted token taken."""
    for job in jobs:
        engine.submit(job)
    engine.capacity.step_now()
    for entry in engine.capacity.entries.values():
        entry.credit = False


def test_sglang_priority_preemption_takes_the_least_preferred_past_the_threshold():
    # PrefillAdder.preempt_to_schedule: every seat taken, the newcomer preempts the least
    # preferred running request when it beats it by more than the threshold (default 10).
    engine = _engine("sglang", max_running_requests=2, enable_priority_scheduling=True)
    cap = engine.capacity
    _by_hand(engine, [_job("a", 10, 4, 6, 0), _job("b", 11, 4, 6, 5)])
    _by_hand(engine, [_job("c", 12, 4, 6, 10)])  # beats a by 10: not more than 10
    assert (_places(cap), cap.preemptions) == ((["a", "b"], ["c"]), 0)
    _by_hand(engine, [_job("d", 13, 4, 6, 11)])  # beats a by 11: a goes back to the queue
    assert (_places(cap), cap.preemptions) == ((["b", "d"], ["c", "a"]), 1)
    a = cap.entries[id(next(e.job for e in cap.waiting if e.job.rid == "a"))]
    assert (a.generated, a.computed, a.need) == (2, 0, 4 + 2)  # recomputes prompt and both tokens
    # c (10) takes b's seat, a (0) d's; a has 4 tokens left, c 6: they end in the same step.
    assert _run(engine) == ["b", "d", "a", "c"]
    assert (cap.preemptions, cap.retractions, cap.stats()["preemptions"]) == (1, 0, 1)


@pytest.mark.parametrize("flags, preempted", [
    ({"priority_scheduling_preemption_threshold": 4}, ["a"]),
    ({"priority_scheduling_preemption_threshold": 5}, []),
    ({"disable_priority_preemption": True}, []),
    ({}, []),
])
def test_sglang_priority_preemption_threshold_and_switch(flags, preempted):
    engine = _engine("sglang", max_running_requests=1, enable_priority_scheduling=True, **flags)
    cap = engine.capacity
    _by_hand(engine, [_job("a", 10, 4, 6, 1)])
    _by_hand(engine, [_job("b", 11, 4, 6, 6)])
    assert _places(cap)[1] == (preempted or ["b"]) and cap.preemptions == len(preempted)


def test_sglang_priority_preemption_with_low_values_first_and_without_a_priority():
    # Smaller first: the largest value goes; a request without one ranks last
    # (Scheduler._set_or_validate_priority: sys.maxsize) and is preempted by anyone.
    engine = _engine("sglang", max_running_requests=2, enable_priority_scheduling=True,
                     schedule_low_priority_values_first=True)
    cap = engine.capacity
    _by_hand(engine, [_job("none", 10, 4, 6), _job("fifty", 11, 4, 6, 50)])
    _by_hand(engine, [_job("zero", 12, 4, 6, 0)])
    assert _places(cap) == (["fifty", "zero"], ["none"])
    _by_hand(engine, [_job("thirty", 13, 4, 6, 30)])  # beats fifty by 20
    assert _places(cap) == (["thirty", "zero"], ["fifty", "none"])
    assert cap.preemptions == 2


def test_sglang_priority_preemption_frees_enough_of_the_pool():
    # min_tokens_to_remove: the newcomer's prompt and max_new_tokens beyond what is free,
    # covered by the reserved tokens of the requests preempted (ignore_eos: ratio 1).
    engine = _engine("sglang", max_running_requests=2, max_total_tokens=64, enable_priority_scheduling=True)
    cap = engine.capacity
    _by_hand(engine, [_job("a", 10, 4, 20, 0), _job("b", 11, 4, 20, 1)])
    assert _places(cap) == (["a", "b"], [])
    _by_hand(engine, [_job("c", 12, 4, 40, 50)])
    # Free: 64 - 8 held - 2 x 19 x 0.7 reserved = 29.4; c asks 4 + 40 = 44, 14.6 more, which
    # a's 19 reserved tokens (ignore_eos: ratio 1) cover: b stays.
    assert (_places(cap), cap.preemptions) == ((["b", "c"], ["a"]), 1)
    # A newcomer whose 4 + 200 tokens all the running requests' reservations cannot cover
    # preempts nobody (preempt_to_schedule returns False).
    _by_hand(engine, [_job("e", 13, 4, 200, 90)])
    assert (_places(cap), cap.preemptions) == ((["b", "c"], ["e", "a"]), 1)


@BACKENDS
def test_sglang_identical_tokens_under_priority_preemption(backend):
    cap = capacity_config("sglang", 1, max_running_requests=1, enable_priority_scheduling=True, step_ms=2.0)
    app = SimApp("sglang", capacity=cap, cache_tokens=0)
    answers: dict[str, dict] = {}

    async def one(rid: str, first: int, priority: int) -> None:
        body = {"input_ids": [first] * 4, "rid": rid, "priority": priority,
                "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
        status, _, raw = await asgi_request(app, "POST", "/generate", orjson.dumps(body))
        assert status == 200
        answers[rid] = orjson.loads(raw)

    async def run() -> None:
        capacity = app.engine.capacity
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "low", 10, 0)
            await _until(lambda: capacity.running and capacity.running[0].generated >= 5)
            tg.start_soon(one, "high", 11, 20)
            await _until(lambda: capacity.preemptions == 1)
            assert [e.job.rid for e in capacity.running] == ["high"]

    anyio.run(run, backend=backend)
    for rid, first in (("low", 10), ("high", 11)):
        meta = answers[rid]["meta_info"]
        assert answers[rid]["output_ids"] == sampled([first] * 4, 0, 30, ignore_eos=True)
        assert (meta["finish_reason"], meta["completion_tokens"]) == ({"type": "length", "length": 30}, 30)
    stats = app.engine.capacity.stats()
    assert (stats["preemptions"], stats["retractions"], stats["peak_running"]) == (1, 0, 1)
