"""kv-aware routing across frontend replicas, in process: the engines' own
load routes as each engine serves them (SGLang ``/v1/loads``, vLLM
``/metrics``) and as the simulator does, the policy weighing the fleet's
requests (the engine's reading plus this replica's requests since) so that
replicas reading the same engines place new prompts alike, and
``cache_salt``: a request's blocks are hashed in its salt's namespace, so
two salts never share a block."""

from __future__ import annotations

import anyio
import orjson
import pytest

from asgi_generate.sdk._codec import BatchItem, GenerateRequest
from asgi_generate.sim.app import SimApp
from asgi_generate.protocols import PROTOCOLS
from asgi_generate.workers.engine_load import EngineLoad, parse_load
from asgi_generate.workers.kv_events import Source, Stored, Subscriber
from asgi_generate.workers.policies.kv_aware import KVAwarePolicy
from asgi_generate.workers.policies.kv_loads import read_due, read_loads
from fakes import CallPool, CannedAnswer
from asgi_generate_sglang import SGLangCodec
from asgi_generate_vllm import VLLMCodec
from support import asgi_json, asgi_request

# SGLang 0.5.23 GET /v1/loads (v1_loads.get_loads: LoadSnapshot.to_dict's
# core keys per DP rank), two ranks.
SGLANG_LOADS = orjson.dumps({
    "timestamp": "2026-12-02T07:00:00+00:00", "version": "0.5.23", "accelerator": "NVIDIA H100",
    "num_accelerators": 1,
    "loads": [{"timestamp": 1.0, "dp_rank": r, "num_running_reqs": 3 + r, "num_waiting_reqs": 2,
               "num_waiting_uncached_tokens": 500, "num_used_tokens": 9, "num_total_tokens": 9,
               "num_active_tokens": 9, "max_total_num_tokens": 100, "token_usage": 0.1} for r in (0, 1)],
})
# vLLM 0.33.0 GET /metrics (PrometheusStatLogger's gauges), two engines.
VLLM_METRICS = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""


def test_engine_load_bodies_parse_summed_over_ranks():
    assert parse_load("sglang", SGLANG_LOADS) == EngineLoad(3 + 2 + 4 + 2, 1000, 0.1)
    assert parse_load("vllm", VLLM_METRICS) == EngineLoad(7, 0, 0.5)
    for protocol, bad in (("sglang", b'{"loads": [{"dp_rank": 0}]}'), ("sglang", b"<html>"),
                          ("vllm", b"vllm:num_requests_running 1\n")):
        with pytest.raises(ValueError):
            parse_load(protocol, bad)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_the_simulator_serves_its_engines_load_route(protocol):
    """Three prompts queued behind one prefill unit: one running, two
    waiting, as the engine's own route says them."""
    app = SimApp(protocol, prefill_us_per_token=20_000)
    path, body = (("/generate", {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 1}})
                  if protocol == "sglang" else
                  ("/inference/v1/generate", {"token_ids": [7, 8, 9], "sampling_params": {"max_tokens": 1}}))

    async def run() -> tuple[bytes, bytes]:
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(asgi_json, app, "POST", path, {**body, ("rid" if protocol == "sglang" else
                                                                      "request_id"): f"r{i}"})
            while len(app.engine.running) < 3:
                await anyio.sleep(0.005)
            route = "/v1/loads" if protocol == "sglang" else "/metrics"
            _, _, busy = await asgi_request(app, "GET", route, query=b"include=core" if protocol == "sglang" else b"")
        return busy, (await asgi_request(app, "GET", route))[2]

    busy, idle = anyio.run(run)
    if protocol == "sglang":
        load = orjson.loads(busy)["loads"][0]
        assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_waiting_uncached_tokens"]) == (1, 2, 6)
        assert set(orjson.loads(busy)) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    # the queue figures (the KV usage is the simulator's capacity model's)
    busy, idle = parse_load(protocol, busy), parse_load(protocol, idle)
    assert (busy.requests, busy.waiting_tokens) == (3, 6 if protocol == "sglang" else 0)
    assert (idle.requests, idle.waiting_tokens) == (0, 0)


class _Worker:
    """A candidate as the router hands it to the policy."""

    def __init__(self, i: int) -> None:
        self.id, self.url, self.outstanding = f"w{i}", f"http://127.0.0.1:{9000 + i}", 0
        self.inflight: list = []


def _pick(policy: KVAwarePolicy, workers: list, ids: list[int], salt: str | None = None) -> str:
    key = policy.routing_key(GenerateRequest(stream=False, input_ids=ids, cache_salt=salt), {})
    return policy.choose(workers, key, lambda c: min(c, key=lambda w: w.outstanding)).id


def _replica(workers: list, readings: list[int] | None) -> KVAwarePolicy:
    policy = KVAwarePolicy()
    for w, n in zip(workers, readings or []):
        policy._kv(w).read(EngineLoad(n, 0), w.outstanding)
    return policy


def test_replicas_weigh_the_fleets_requests_alike():
    workers = [_Worker(i) for i in range(4)]
    fresh = [list(range(1000 * i, 1000 * i + 64)) for i in range(1, 7)]  # cached nowhere
    readings = [3, 3, 0, 2]  # the other replicas' requests, as the engines count them
    a, b = _replica(workers, readings), _replica(workers, readings)
    assert [_pick(a, workers, p) for p in fresh] == [_pick(b, workers, p) for p in fresh] == ["w2"] * 6
    blind = _replica(workers, None)  # its own counts only: every worker looks idle
    assert len({_pick(blind, workers, p) for p in fresh}) > 1
    # This replica's own requests count fresh, on top of the others'...
    workers[2].outstanding = 3
    assert _pick(a, workers, fresh[0]) == "w3"
    # ...and its own in a reading are not counted twice.
    a._kv(workers[3]).read(EngineLoad(4, 0), 2)
    assert a._kv(workers[3]).others == 2


def test_cache_salt_namespaces_a_requests_blocks():
    policy = KVAwarePolicy(ttl=0.001)
    workers = [_Worker(0), _Worker(1)]
    ids = list(range(100, 164))  # four 16-token blocks
    for w, salt in zip(workers, ("a", "b")):
        kv = policy._kv(w)
        kv.subscriber = object()  # events arrive: the index, not the tree, scores it
        kv.index.apply([Stored([11, 12, 13, 14], None, ids, 16, salt)])
    assert _pick(policy, workers, ids + [1], "a") == "w0"
    assert _pick(policy, workers, ids + [1], "b") == "w1"
    assert policy.overlapped == 2
    _pick(policy, workers, ids + [1])  # unsalted: neither salt's blocks are its
    _pick(policy, workers, ids + [1], "c")
    assert policy.overlapped == 2


def test_both_codecs_carry_cache_salt():
    sglang, vllm = SGLangCodec(), VLLMCodec()
    headers = {b"content-type": b"application/json"}
    for salt in ("s", None):
        body = orjson.dumps({"input_ids": [1, 2], **({"cache_salt": salt} if salt else {})})
        assert sglang.decode(body, headers).cache_salt == salt
        body = orjson.dumps({"token_ids": [1, 2], "sampling_params": {"max_tokens": 1},
                             **({"cache_salt": salt} if salt else {})})
        assert vllm.decode(body, headers).cache_salt == salt


def test_n_samples_of_one_prompt_route_by_that_prompt():
    policy = KVAwarePolicy()
    ids = list(range(100, 164))
    samples = GenerateRequest(stream=False, items=[BatchItem(None, ids, None, 0) for _ in range(4)])
    assert policy.routing_key(samples, {}).ids == ids
    two = GenerateRequest(stream=False, items=[BatchItem(None, ids, None, 0), BatchItem(None, ids[1:], None, 1)])
    assert policy.routing_key(two, {}) is None  # two prompts: least outstanding, as before


def test_an_idle_engines_load_is_read_again_only_once_something_moves():
    """A reading of 0 requests stands while this replica routes nothing
    there and the engine publishes nothing: the next reading waits up to
    the idle interval; a busy engine, a request of ours, a route or an event
    batch makes it due at once."""
    policy = KVAwarePolicy()
    worker = _Worker(0)
    kv = policy._kv(worker)
    assert read_due(kv, 0, 0.0, policy.load_idle_interval)  # no reading yet
    kv.read(EngineLoad(0, 0), 0)
    kv.read_at, kv.read_mark = 10.0, kv.activity()
    assert not read_due(kv, 0, 10.5, policy.load_idle_interval)
    assert not read_due(kv, 0, 10.999, policy.load_idle_interval)
    assert read_due(kv, 0, 11.0, policy.load_idle_interval)
    assert read_due(kv, 0, 10.0, KVAwarePolicy(load_idle_interval=0).load_idle_interval)  # 0: always
    assert read_due(kv, 1, 10.5, policy.load_idle_interval)  # ours are in flight there
    kv.routed += 1  # routed there since
    assert read_due(kv, 0, 10.5, policy.load_idle_interval)
    kv.subscriber = Subscriber(Source("tcp://127.0.0.1:1"), kv.index)
    kv.read_mark = kv.activity()
    assert not read_due(kv, 0, 10.5, policy.load_idle_interval)
    kv.subscriber.batches += 1  # its engine published (another replica's request)
    assert read_due(kv, 0, 10.5, policy.load_idle_interval)
    kv.read(EngineLoad(2, 0), 0)  # a busy engine: every interval
    kv.read_mark = kv.activity()
    assert read_due(kv, 0, 10.0, policy.load_idle_interval)


def test_the_load_reader_skips_an_idle_engine_and_reads_a_busy_one():
    """The reader's loop over an engine that answers 0 requests, then 3:
    idle, it reads once and then sleeps, never polling, until this replica
    routes there (the policy wakes it); then it reads at once, and every
    interval while the engine is busy."""
    bodies = [b'{"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]}']

    worker = _Worker(0)
    worker.healthy, worker.pool = True, CallPool(lambda method, path, body: CannedAnswer(200, bodies[-1]))
    worker.protocol = PROTOCOLS["sglang"]
    policy = KVAwarePolicy(load_interval=0.01, load_idle_interval=3600.0)
    kv = policy._kv(worker)

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_loads, worker, kv, policy.load_interval, policy.load_idle_interval, policy.clock)
            with anyio.fail_after(10):
                while kv.waiter is None:
                    await anyio.sleep(0.005)
            await anyio.sleep(0.05)  # five intervals: a polling reader would have turned five times
            assert (len(worker.pool.calls), kv.readings, kv.skipped) == (1, 1, 1)
            bodies.append(b'{"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 0}]}')
            kv.routed += 1  # a route there: read at once, then every interval while busy
            kv.wake()
            while kv.readings < 3:
                await anyio.sleep(0.005)
            assert kv.engine == EngineLoad(3, 0)
            tg.cancel_scope.cancel()

    anyio.run(run)
