"""The frontend's side of KV cache events, in process: the wire decoded as
each engine version encodes it (tagged maps, positional arrays), the
subscriber's sequence checks (gap filled by replay, gap replay cannot fill,
restart) against the simulator's real publisher on loopback, and the index
(stores chained by parent, removals, clears, predictions)."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("zmq", reason="pyzmq (a dependency since KV events: pip install -e .)")

from typing import Any, Optional

import anyio
import msgspec
import orjson

from asgi_generate.sim.kv_events import EventWire, KVEventPublisher, KVEventsConfig
from asgi_generate.workers.block_hash import ROOT, block_hashes, namespace_seed
from asgi_generate.workers.kv_events import Cleared, Removed, Source, Stored, Subscriber, decode_batch
from asgi_generate.workers.kv_index import KVIndex
from asgi_generate.workers.policies.kv_aware import KVAwarePolicy
from asgi_generate.workers.policies.kv_sources import follow_events
from asgi_generate.workers.worker import Worker
from asgi_generate.protocols import PROTOCOLS
from fakes import CallPool, CannedAnswer


# Structs shaped as the engines declare theirs: vLLM 0.33 (tagged maps,
# ``vllm/distributed/kv_events.py``), SGLang 0.5.18 (arrays,
# ``sglang/srt/disaggregation/kv_events.py``).
class VBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class VEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class VStored(VEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple]]] = None
    group_idx: Optional[int] = None


class VRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]


class SBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class SEvent(msgspec.Struct, array_like=True, tag=True):
    pass


class SStored(SEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class SMeta(msgspec.Struct):
    cache_salt: str


class SStoredSalted(SStored, tag="BlockStored", kw_only=True):
    metadata: SMeta


class SCleared(SEvent, tag="AllBlocksCleared"):
    pass


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def test_vllm_tagged_maps_decode():
    payload = msgspec.msgpack.encode(VBatch(1.5, [
        VStored([2**64 - 1, 7], None, list(range(32)), 16, None, "GPU", None, [("salt",), None], 0),
        VRemoved([7], "GPU"),
    ], 0))
    stored, removed = decode_batch(payload)
    assert stored == Stored([2**64 - 1, 7], None, list(range(32)), 16, "salt")
    assert removed == Removed([7])


def test_sglang_arrays_decode_with_and_without_salt():
    payload = msgspec.msgpack.encode(SBatch(1.5, [
        SStored([-3], None, [5], 1, None, "GPU"),
        SStoredSalted([-4], -3, [6], 1, None, "GPU", metadata=SMeta("s")),
        SCleared(),
    ], 0))
    a, b, c = decode_batch(payload)
    assert a == Stored([-3], None, [5], 1, None) and b == Stored([-4], -3, [6], 1, "s")
    assert isinstance(c, Cleared)
    with pytest.raises(ValueError):
        decode_batch(b"\x01\x02")


def test_index_chains_by_parent_and_follows_removals():
    index = KVIndex(1000, ttl=5.0)
    ids = list(range(48))
    ours = block_hashes(ROOT, ids, 16)
    index.apply([Stored([101], None, ids[:16], 16, None)])
    index.apply([Stored([102, 103], 101, ids[16:], 16, None)])
    assert index.overlap(ours, 0) == (3, 0) and index.block_size == 16
    index.apply([Stored([999], 555, ids[:16], 16, None)])  # its parent was never seen
    assert index.orphans == 1
    index.apply([Removed([103])])
    assert index.overlap(ours, 0) == (2, 0)
    salted = block_hashes(namespace_seed(("s",)), ids, 16)
    index.apply([Stored([201], None, ids[:16], 16, "s")])
    assert index.overlap(salted, 0) == (1, 0)
    index.apply([Cleared()])
    assert index.overlap(ours, 0) == (0, 0) and index.resets == {"cleared": 1}


def test_predictions_expire_and_are_confirmed():
    index = KVIndex(1000, ttl=5.0)
    ids = list(range(32))
    ours = block_hashes(ROOT, ids, 16)
    index.predict(ours, now=100.0)
    assert index.overlap(ours, 104.0) == (2, 2) and index.pending == 2
    assert index.overlap(ours, 105.0) == (0, 0)  # expired
    index.predict(ours, now=200.0)
    index.apply([Stored([1, 2], None, ids, 16, None)])
    assert (index.predicted, index.confirmed) == (4, 2)


class Recorder:
    def __init__(self) -> None:
        self.events: list = []
        self.resets: list[str] = []

    def apply(self, events: list) -> None:
        self.events.extend(events)

    def reset(self, reason: str) -> None:
        self.resets.append(reason)


def _publisher(buffer_steps: int = 100) -> KVEventPublisher:
    config = KVEventsConfig("tcp://*:0", "tcp://*:0", buffer_steps=buffer_steps)
    return KVEventPublisher(config, EventWire("vllm", None, 16))


async def _until(predicate, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


def _stored(i: int) -> dict:
    return {"type": "BlockStored", "block_hashes": [i], "parent_block_hash": None, "token_ids": [i] * 16,
            "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}


@pytest.mark.anyio
async def test_subscriber_replays_history_and_gaps_and_sees_restarts():
    pub = _publisher()
    sink = Recorder()
    sub = Subscriber(Source(pub.endpoint, pub.replay_endpoint), sink)
    try:
        pub.publish([_stored(0)])  # before anyone listened: replayed at the start
        async with anyio.create_task_group() as tg:
            await tg.start(sub.run)
            while not sink.events:  # the slow joiner: publish until one arrives
                pub.publish([_stored(1)])
                await anyio.sleep(0.05)
            await _until(lambda: sub.last_seq is not None)
            assert sink.events[0].hashes == [0] and sub.replays == 1
            seq = pub.stats()["next_seq"]
            pub.drop(seq, seq + 2)
            for i in range(3):
                pub.publish([_stored(100 + i)])
            await _until(lambda: sub.last_seq == seq + 2)
            assert [e.hashes[0] for e in sink.events[-3:]] == [100, 101, 102]
            assert (sub.gaps, sub.replays, sub.rebuilds, sink.resets) == (1, 2, 0, [])
            pub.restart()
            pub.publish([_stored(7)])
            await _until(lambda: sub.restarts == 1)
            assert sink.resets == ["restart"] and sink.events[-1].hashes == [7]
            tg.cancel_scope.cancel()
    finally:
        pub.close()


@pytest.mark.anyio
async def test_a_gap_replay_cannot_fill_rebuilds():
    pub = _publisher(buffer_steps=1)
    sink = Recorder()
    sub = Subscriber(Source(pub.endpoint, pub.replay_endpoint), sink)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(sub.run)
            while not sink.events:
                pub.publish([_stored(1)])
                await anyio.sleep(0.05)
            seq = pub.stats()["next_seq"]
            pub.drop(seq, seq + 2)
            for i in range(3):  # the buffer keeps only the last
                pub.publish([_stored(100 + i)])
            await _until(lambda: sub.last_seq == seq + 2)
            assert (sub.gaps, sub.rebuilds, sink.resets) == (1, 1, ["gap"])
            assert sink.events[-1].hashes == [102]
            tg.cancel_scope.cancel()
    finally:
        pub.close()


@pytest.mark.anyio
async def test_a_burst_of_batches_is_taken_on_the_event_loop_in_order(monkeypatch):
    """Live batches are received without a worker thread (the socket's
    zmq.FD is waited on by the event loop): only the start's replay runs
    in one. A burst published at once arrives whole and in order, each
    batch told to ``on_batch`` (the policy's load reader wakes on it), and
    an idle subscriber makes no thread calls at all."""
    threads = []
    real = anyio.to_thread.run_sync

    async def counted(fn, *args, **kwargs):
        threads.append(fn.__name__)
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    pub = _publisher()
    sink = Recorder()
    told = []
    sub = Subscriber(Source(pub.endpoint, pub.replay_endpoint), sink, on_batch=lambda: told.append(sub.batches))
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(sub.run)
            while not sink.events:  # the slow joiner
                pub.publish([_stored(1)])
                await anyio.sleep(0.05)
            await anyio.sleep(0.3)  # idle: nothing to receive, no thread
            first = sub.last_seq
            for i in range(50):
                pub.publish([_stored(200 + i)])
            await _until(lambda: sub.last_seq == first + 50)
            assert [e.hashes[0] for e in sink.events[-50:]] == list(range(200, 250))
            assert threads == ["_replay"] and (sub.gaps, sub.rebuilds) == (0, 0)
            assert told == list(range(1, sub.batches + 1))
            tg.cancel_scope.cancel()
    finally:
        pub.close()


def _zmq_threads() -> int:
    """This process's ZMQ background threads (libzmq names them ``ZMQbg/...``)."""
    names = (pathlib.Path(t, "comm").read_text() for t in pathlib.Path("/proc/self/task").iterdir())
    return sum(name.startswith("ZMQbg") for name in names)


@pytest.mark.anyio
@pytest.mark.skipif(not pathlib.Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
async def test_subscribers_share_one_zmq_context():
    # A subscriber per worker of a fleet of hundreds: each context of its own
    # would add two threads (I/O and reaper) per worker.
    pubs = [_publisher() for _ in range(8)]
    sinks = [Recorder() for _ in pubs]
    subs = [Subscriber(Source(p.endpoint, None), s) for p, s in zip(pubs, sinks)]
    try:
        before = _zmq_threads()
        async with anyio.create_task_group() as tg:
            for sub in subs:
                await tg.start(sub.run)
            with anyio.fail_after(20):
                for i, pub in enumerate(pubs):
                    while not sinks[i].events:  # the slow joiner: publish until one arrives
                        pub.publish([_stored(i)])
                        await anyio.sleep(0.02)
            assert [s.events[0].hashes for s in sinks] == [[i] for i in range(8)]
            assert _zmq_threads() - before <= 2
            tg.cancel_scope.cancel()
    finally:
        for pub in pubs:
            pub.close()


class _Comeback(Worker):
    """A worker as the router keeps it: up or down, marked down so many
    times, answering ``GET /kv_event_sources`` with where its publisher of
    the moment publishes."""

    def __init__(self) -> None:
        self.pub = _publisher()
        pool = CallPool(lambda method, path, body: CannedAnswer(200, orjson.dumps(self.pub.vllm_sources())))
        super().__init__("w0", PROTOCOLS["vllm"], "http://127.0.0.1:9000", pool, pool)
        self.healthy = True


async def _followed(policy: KVAwarePolicy, worker: _Comeback, n: int) -> dict:
    """Publish block ``n`` on ``worker``'s publisher until a subscriber to
    it applied it (the slow joiner), then ``policy``'s ``/stats`` row for it."""
    kv = policy.workers[worker.id]

    def applied() -> bool:
        sub = kv.subscriber
        return sub is not None and sub.source.endpoint == worker.pub.endpoint and sub.events > 0

    with anyio.fail_after(10):
        while not applied():
            worker.pub.publish([_stored(n)])
            await anyio.sleep(0.02)
    return policy.stats()["workers"][worker.id]


@pytest.mark.anyio
async def test_a_worker_back_from_a_restart_is_followed_on_its_new_endpoint():
    # A restarted engine binds a new port (vLLM's tcp://*:0): once its worker
    # is down, and again when it was marked down and up before the service
    # ran, the subscriber stops and the one following the worker back up asks
    # where it publishes now, on a reset index.
    worker = _Comeback()
    policy = KVAwarePolicy()
    kv = policy._kv(worker)
    old = [worker.pub]
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow_events, worker, kv, None)
            row = await _followed(policy, worker, 1)
            assert (row["source"], row["subscriber"]["endpoint"], row["blocks"]) == ("events", worker.pub.endpoint, 1)
            for bounce in (True, False):
                worker.times_down += 1
                worker.healthy = False
                if bounce:  # down for good: the subscriber stops
                    await _until(lambda: kv.subscriber is None)
                    assert (policy.stats()["workers"]["w0"]["source"], kv.index.blocks) == ("tree", 0)
                worker.pub.close()
                worker.pub = _publisher()
                old.append(worker.pub)
                worker.healthy = True
                row = await _followed(policy, worker, 2 + bounce)
                assert worker.pub.endpoint not in [pub.endpoint for pub in old[:-1]]
                assert (row["source"], row["subscriber"]["endpoint"], row["blocks"]) == (
                    "events", worker.pub.endpoint, 1)
                assert row["subscriber"]["batches"] >= 1
            assert row["resets"] == {"restart": 2}
            tg.cancel_scope.cancel()
    finally:
        for pub in old:
            pub.close()


@pytest.mark.anyio
async def test_the_subscriber_service_sleeps_until_the_worker_changes():
    """Down, the service waits on the worker's health (no look on a timer,
    no request); the moment it is up, it asks where the worker publishes;
    following it, it waits on the worker's health again."""
    worker = _Comeback()
    worker.healthy = False
    policy = KVAwarePolicy()
    kv = policy._kv(worker)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow_events, worker, kv, None)
            await _until(lambda: worker._health_waiters)  # waiting for the change
            assert worker.pool.calls == [] and kv.subscriber is None
            worker.healthy = True
            row = await _followed(policy, worker, 1)
            assert worker.pool.calls == [(b"GET", b"/kv_event_sources", b"")] and row["source"] == "events"
            await _until(lambda: worker._health_waiters)  # following: waiting for it to leave
            worker.times_down += 1
            worker.healthy = False
            await _until(lambda: kv.subscriber is None)
            tg.cancel_scope.cancel()
    finally:
        worker.pub.close()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_worker_health_waiter_cancelled_in_one_event_loop_leaves_nothing_for_the_next(backend):
    """A service cancelled while it waits on the worker's health (its app
    stopped) leaves no event behind: a waiter in another event loop is
    woken by the next change (an event of the first loop would be waited
    on there: asyncio refuses one bound to a different loop)."""
    from asgi_generate.workers.router import Router
    worker = Router([("sglang", "http://127.0.0.1:9")]).workers[0]
    woken = []

    async def wait(then_cancel: bool) -> None:
        async with anyio.create_task_group() as tg:
            async def one() -> None:
                await worker.health_changed()
                woken.append(worker.healthy)
            tg.start_soon(one)
            await _until(lambda: worker._health_waiters)
            if then_cancel:
                tg.cancel_scope.cancel()
            else:
                worker.healthy = True

    anyio.run(wait, True, backend=backend)
    assert (worker._health_waiters, woken) == (set(), [])
    anyio.run(wait, False, backend=backend)
    assert (worker._health_waiters, woken) == (set(), [True])
