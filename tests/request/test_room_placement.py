"""Room-aware placement and the load readings' pace, in process (fake
clocks, fake pools): with admission on, the router sends a granted request
to a worker whose engine has room for it (admission's per-worker room:
the engine's other requests at its last reading plus this process's
sequences there now, under the limit; a stale or missing reading is full),
the policy choosing among those, and falls back to the policy's own pick
when no worker alone has room; the readings run at the idle pace while
nothing waits and the room is loose, at the fast pace otherwise, a stale
bound that follows the pace in force, and one GET feeds the kv-aware
policy's reader too."""

from __future__ import annotations

from types import SimpleNamespace

import anyio

from asgi_generate.config import Settings
from asgi_generate.protocols import PROTOCOLS
from asgi_generate.request.admission import Ask
from asgi_generate.request.gate import Admission
from asgi_generate.request.saturation import Saturation
from asgi_generate.workers.engine_load import EngineLoad
from asgi_generate.workers.policies import Policy
from asgi_generate.workers.policies.kv_aware import KVAwarePolicy
from asgi_generate.workers.router import Router
from fakes import CallPool, CannedAnswer


def _router(n: int, policy: Policy | None = None, **kw) -> Router:
    router = Router([("sglang", f"http://127.0.0.1:{9100 + i}") for i in range(n)], policy=policy, **kw)
    for w in router.workers:
        w.healthy = True
    return router


class _Leg:
    """A leg riding a worker, as admission counts its sequences."""

    def __init__(self, entries: list[int] | None = None) -> None:
        self.attempt = SimpleNamespace(entries=entries)


_leg = _Leg


class _Prefers(Policy):
    """A policy that always wants the worker ``favourite`` (sibling
    placement: its cache holds the prompt), else the least outstanding."""

    name = "prefers"

    def __init__(self, favourite: str) -> None:
        super().__init__()
        self.favourite = favourite

    def _key(self, request, headers):
        return "k"

    def choose(self, candidates, key, least):
        return next((w for w in candidates if w.id == self.favourite), least(candidates))


def test_a_pick_goes_to_a_worker_with_room_the_policy_choosing_among_them():
    router = _router(3, _Prefers("w0"))
    room = {"w0": 0, "w1": 1, "w2": 3}
    router.room = lambda w: room[w.id]
    key = router.routing_key(None, {})
    assert router.pick("sglang", key=key).id in ("w1", "w2")  # the policy's favourite is full
    assert router.pick("sglang", key=key, need=2).id == "w2"  # only w2 has room for 2 sequences
    room["w0"] = 1
    assert router.pick("sglang", key=key).id == "w0"  # room again: the policy's choice (its cache)
    assert router.roomless_picks == 0
    router.room = None  # admission off: the policy alone
    room["w0"] = 0
    assert router.pick("sglang", key=key).id == "w0"


def test_no_worker_with_room_alone_falls_back_to_the_policys_pick():
    router = _router(2, _Prefers("w1"))
    router.room = lambda w: 1  # one free sequence each: 2 in aggregate
    key = router.routing_key(None, {})
    assert router.pick("sglang", key=key, need=2).id == "w1"  # an n=2 request: the policy's pick
    assert router.roomless_picks == 1
    assert router.pick("sglang", exclude=[router.workers[1]], key=key, need=2).id == "w0"


def test_keyless_picks_are_least_outstanding_among_workers_with_room():
    router = _router(3)
    router.workers[1].inflight.add(_leg())
    router.room = lambda w: 0 if w.id == "w0" else 2
    assert [router.pick("sglang").id for _ in range(2)] == ["w2", "w2"]


def test_pd_pairs_place_the_decode_leg_by_room_the_prefill_by_the_policy():
    router = Router([], prefill=[("sglang", "http://127.0.0.1:9200"), ("sglang", "http://127.0.0.1:9201")],
                    decode=[("sglang", "http://127.0.0.1:9202"), ("sglang", "http://127.0.0.1:9203")],
                    policy=_Prefers("w0"))
    for w in router.workers:
        w.healthy = True
    router.room = lambda w: 0 if w.id in ("w0", "w2") else 1  # prefill workers hold nothing: not asked
    prefill, decode = router.plan("sglang", key=router.routing_key(None, {}))
    assert (prefill.id, decode.id) == ("w0", "w3")


def _admission(clock, **settings) -> tuple[Admission, Router]:
    router = _router(2)
    adm = Admission(Settings(admission=True, admission_worker_requests=4, **settings), lambda: router, clock)
    adm.saturation.clock = clock
    adm.attach(router)
    return adm, router


def test_a_workers_room_is_its_limit_less_the_others_and_this_process_sequences():
    now = [50.0]
    adm, router = _admission(lambda: now[0])
    w0, w1 = router.workers
    assert (adm.free_on(w0), adm.free_on(w1)) == (0, 0)  # no reading yet: full, never empty
    w0.inflight.add(_leg())
    adm.saturation.take(w0, EngineLoad(3, 0), own=1)  # 2 others', 1 ours
    adm.saturation.take(w1, EngineLoad(0, 0), own=0)
    assert (adm.free_on(w0), adm.free_on(w1)) == (1, 4)
    w0.inflight.add(_leg([0, 1]))  # an n=2 request of ours since: 3 of ours there now
    assert adm.free_on(w0) == 0
    assert router.pick("sglang").id == "w1"
    now[0] = 50.0 + 0.1 + 1.0 + 0.001  # overdue by the stale bound past the fast pace
    assert adm.free_on(w1) == 0


def test_the_stale_bound_follows_the_pace_a_reading_was_taken_at():
    now = [10.0]
    sat = Saturation(4, stale=1.0, clock=lambda: now[0], interval=0.1, idle_interval=2.0)
    w = SimpleNamespace(id="w0", role="aggregated")
    sat.take(w, EngineLoad(1, 0), own=0, pace=2.0)  # taken at the idle pace: the next due in 2 s
    now[0] = 12.9
    assert sat.free_on(w, 0) == 3
    now[0] = 13.01  # overdue by more than 1 s: full
    assert sat.free_on(w, 0) == 0
    sat.take(w, EngineLoad(1, 0), own=0, pace=0.1)
    now[0] += 1.05
    assert sat.free_on(w, 0) == 3
    now[0] += 0.1
    assert sat.free_on(w, 0) == 0


def test_the_room_is_in_demand_while_requests_wait_or_less_than_half_is_free():
    now = [0.0]
    adm, router = _admission(lambda: now[0])
    for w in router.workers:
        adm.saturation.take(w, EngineLoad(0, 0), own=0)
    q = adm.queue("sglang")
    assert not adm.busy("sglang")  # 8 free of 8
    entries = [q.enqueue(Ask("sglang", 2, "t"), now[0]) for _ in range(5)]
    assert all(e.granted for e in entries) and adm.busy("sglang")  # 3 free of 8: under half
    q.release(entries[0], None, now[0])
    assert not adm.busy("sglang")  # 4 free of 8
    adm.saturation.take(router.workers[0], EngineLoad(4, 0), own=0)  # another process filled w0
    assert adm.busy("sglang")
    adm.saturation.take(router.workers[0], EngineLoad(0, 0), own=0)
    waiting = [q.enqueue(Ask("sglang", 2, "t", seqs=3), now[0]) for _ in range(2)]
    assert waiting[0].granted and not waiting[1].granted and adm.busy("sglang")


class _Share:
    """A policy's reader of the same route (a LoadShare) that records what it is handed."""

    interval = 0.01

    def __init__(self) -> None:
        self.wants = False
        self.got: list = []

    def due(self, now):
        return self.wants

    def until_due(self, now):
        return self.interval if self.wants else 3600.0

    def notify(self, event):
        self.woken = event

    def begin(self):
        return 7

    def end(self, load, why, begun):
        self.got.append((load, why, begun))

    def down(self):
        self.got.append("down")


def _reading_worker(requests: int = 0):
    body = b'{"loads": [{"num_running_reqs": %d, "num_waiting_reqs": 0}]}' % requests
    return SimpleNamespace(id="w0", role="aggregated", healthy=True, protocol=PROTOCOLS["sglang"],
                           pool=CallPool(CannedAnswer(200, body)), inflight=set())


async def _until(check, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not check():
            await anyio.sleep(0.005)


def test_readings_run_at_the_idle_pace_until_demand_then_at_the_fast_pace():
    """Idle (nothing waits, the room loose), the reader reads once and then
    waits out its 60 s idle pace; a hurry (a request must wait) makes it
    read at once, and while busy it reads every 10 ms."""
    sat = Saturation(4, interval=0.01, idle_interval=60.0)
    worker = _reading_worker()
    busy = [False]

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sat.read, worker, lambda: 0, lambda: None, lambda: busy[0])
            await _until(lambda: sat.count == 1 and sat.idle)
            await anyio.sleep(0.2)
            assert (len(worker.pool.calls), sat.count, sat.fast) == (1, 1, 0)
            busy[0] = True
            sat.hurry()
            await _until(lambda: sat.count >= 4)
            assert sat.fast == sat.count - 1 and len(worker.pool.calls) == sat.count
            # Every reading the same (no other process's request there): the
            # pace doubles from 10 ms, so 0.3 s holds at most 6 more, not 30.
            count = sat.count
            await anyio.sleep(0.3)
            assert sat.count - count <= 6
            busy[0] = False
            await _until(lambda: sat.idle)
            count = sat.count
            await anyio.sleep(0.2)
            assert sat.count == count
            tg.cancel_scope.cancel()

    anyio.run(run)


def test_one_get_feeds_the_policys_reader_too():
    """With the kv-aware policy's reader sharing the route, every reading
    admission takes is handed to it (with what its ``begin`` returned), and
    a turn the policy wants is read even at admission's idle pace: one GET
    each, never two."""
    sat = Saturation(4, interval=0.01, idle_interval=60.0)
    worker = _reading_worker(3)
    share = _Share()

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sat.read, worker, lambda: 0, lambda: None, lambda: False, share)
            await _until(lambda: sat.count == 1)
            await anyio.sleep(0.1)
            assert share.got == [(EngineLoad(3, 0, None), None, 7)] and len(worker.pool.calls) == 1
            share.wants = True
            share.woken.set()  # what the policy's notify does when a request is routed there
            await _until(lambda: sat.count >= 3)
            assert len(worker.pool.calls) == sat.count == len(share.got)
            tg.cancel_scope.cancel()

    anyio.run(run)


def test_the_kv_aware_policy_hands_its_readings_to_admissions_reader():
    """Asked for a share before its service starts, the policy does not run
    its own reader for that worker; the share keeps its bookkeeping: a
    reading of 5 requests while this replica had 2 there counts 3 others'."""
    policy = KVAwarePolicy(load_interval=0.1)
    worker = SimpleNamespace(id="w0", url="http://127.0.0.1:9300", outstanding=2, inflight=[])
    share = policy.load_share(worker)
    assert "w0" in policy.loads_shared and share.interval == 0.1
    kv = policy._kv(worker)
    assert share.due(0.0)  # no reading yet
    share.end(EngineLoad(5, 0), None, share.begin())
    assert (kv.engine, kv.others, kv.readings) == (EngineLoad(5, 0), 3, 1)
    share.end(None, "GET /v1/loads: boom", share.begin())
    assert (kv.engine, kv.why_own) == (None, "GET /v1/loads: boom")
    assert KVAwarePolicy(load_interval=0).load_share(worker) is None
    assert Policy().load_share(worker) is None


def test_the_fast_pace_backs_off_while_readings_change_nothing():
    sat = Saturation(4, interval=0.1, idle_interval=1.0)
    assert [sat._pace(True, calm) for calm in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert sat._pace(False, 0) == 1.0
    assert Saturation(4, interval=0.1, idle_interval=0)._pace(False, 0) == 0.1  # 0: always the fast pace
