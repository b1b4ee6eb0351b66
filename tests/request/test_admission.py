"""Admission's queue against a fake clock: its order (classes, reserved
shares, promotion, deadlines), tenants' shares in work, groups admitted
whole, shedding with its exact status, reason and Retry-After, and the
slot given back on every ending."""

from __future__ import annotations

import math

import anyio
import pytest
import trio.testing
from hypothesis import given, settings, strategies as stg

from asgi_generate.request.admission import Ask, Queue, Refusal, Room

CLASSES = ("eval", "agent", "rollout", "bulk")


class Fleet:
    """A fleet of ``capacity`` sequences whose free room is what the queue holds not."""

    def __init__(self, capacity: int, ever: int | None = None) -> None:
        self.capacity = capacity
        self.ever = capacity if ever is None else ever
        self.queue: Queue | None = None

    def __call__(self) -> Room:
        held = sum(c.held for c in self.queue.classes)
        return Room(max(0, self.capacity - held), self.capacity, self.ever)


def make(capacity: int, **kw) -> tuple[Queue, Fleet]:
    fleet = Fleet(capacity, kw.pop("ever", None))
    q = Queue(CLASSES, fleet, **{"reserved_share": 0.0, **kw})
    fleet.queue = q
    return q, fleet


def ask(cls: str = "rollout", tenant: str = "t", seqs: int = 1, work: float = 10.0, **kw) -> Ask:
    return Ask("sglang", CLASSES.index(cls), tenant, seqs, work, **kw)


def test_strict_classes_then_arrival():
    q, _ = make(1)
    first = q.enqueue(ask("bulk"), 0.0)
    assert first.granted
    waiting = [q.enqueue(ask(cls), 1.0 + i) for i, cls in enumerate(("bulk", "rollout", "eval", "agent"))]
    assert not any(e.granted for e in waiting)
    order = []
    for t in range(4):
        q.release(first, None, 10.0 + t)
        first = next(e for e in waiting if e.granted and e not in order)
        order.append(first)
    assert [CLASSES[e.ask.cls] for e in order] == ["eval", "agent", "rollout", "bulk"]


def test_reserved_share_lets_a_lower_class_through():
    q, _ = make(10, reserved_share=0.2)
    held = [q.enqueue(ask("eval"), 0.0) for _ in range(10)]
    assert all(e.granted for e in held)
    evals = [q.enqueue(ask("eval"), 1.0) for _ in range(5)]
    bulk = q.enqueue(ask("bulk"), 2.0)
    q.release(held[0], None, 3.0)
    # bulk holds 0 < 0.2 x 10: its reserve goes first
    assert bulk.granted and not any(e.granted for e in evals)
    q.release(held[1], None, 4.0)
    assert evals[0].granted


def test_promotion_after_a_wait():
    q, _ = make(1, promote_after=10.0)
    running = q.enqueue(ask("eval"), 0.0)
    bulk = q.enqueue(ask("bulk"), 0.0)
    rollout = q.enqueue(ask("rollout"), 25.0)
    # at 31 s bulk waited 31 s: three classes up (rank 3 - 3 = 0) beats rollout (rank 2 - 0)
    q.release(running, None, 31.0)
    assert bulk.granted and not rollout.granted


def test_earliest_deadline_first_within_a_tenant():
    q, _ = make(1)
    running = q.enqueue(ask(), 0.0)
    late = q.enqueue(ask(deadline=100.0), 1.0)
    none = q.enqueue(ask(), 2.0)
    soon = q.enqueue(ask(deadline=50.0), 3.0)
    got = []
    for t in (4.0, 5.0, 6.0):
        q.release(running, None, t)
        running = next(e for e in (late, none, soon) if e.granted and e not in got)
        got.append(running)
    assert got == [soon, late, none]


def test_deadline_past_is_refused_at_once():
    q, _ = make(1)
    entry = q.enqueue(ask(deadline=5.0), 5.0)
    assert entry.refusal == Refusal(
        429, "deadline", "overloaded: shed from the rollout queue (deadline): its deadline passed before it could "
                         "start", 1)


def test_deadline_sooner_than_the_class_wait_is_refused_at_once():
    q, _ = make(1)
    a = q.enqueue(ask(), 0.0)
    b = q.enqueue(ask(), 0.0)
    q.release(a, None, 10.0)  # b waited 10 s: the estimate moves to 2 s
    assert b.granted
    assert q.classes[2].wait_estimate == pytest.approx(2.0)
    c = q.enqueue(ask(deadline=11.5), 10.0)
    assert c.refusal.status == 429 and c.refusal.reason == "deadline" and c.refusal.retry_after == 2
    assert "cannot start before its deadline" in c.refusal.message
    d = q.enqueue(ask(deadline=13.0), 10.0)
    assert d.refusal is None and not d.granted


def test_deadline_passing_while_queued_sheds():
    q, _ = make(1)
    q.enqueue(ask(), 0.0)
    e = q.enqueue(ask(deadline=4.0), 1.0)
    assert q.expiry(e.unit) == 4.0
    q.expire(3.9)
    assert e.refusal is None
    q.expire(4.0)
    assert e.refusal.reason == "deadline" and e.refusal.status == 429
    assert q.classes[2].depth == 0


def test_shed_past_depth_bytes_and_wait():
    q, _ = make(1, depth=2, nbytes=100, wait=5.0)
    q.enqueue(ask(), 0.0)
    a = q.enqueue(ask(nbytes=60), 0.0)
    b = q.enqueue(ask(nbytes=50), 0.0)
    assert b.refusal == Refusal(429, "queue_bytes", "overloaded: shed from the rollout queue (queue_bytes): the "
                                                    "rollout queue is full (110 bytes)", 1)
    c = q.enqueue(ask(nbytes=10), 0.0)
    d = q.enqueue(ask(nbytes=10), 0.0)
    assert c.refusal is None
    assert d.refusal == Refusal(429, "queue_depth", "overloaded: shed from the rollout queue (queue_depth): the "
                                                    "rollout queue is full (2 requests)", 1)
    q.expire(5.0)
    assert a.refusal == c.refusal == Refusal(
        429, "wait", "overloaded: shed from the rollout queue (wait): no room within 5 s", 1)
    assert q.classes[2].shed == {"queue_bytes": 1, "queue_depth": 1, "wait": 2}
    assert q.classes[2].depth == 0 and q.classes[2].nbytes == 0


def test_retry_after_follows_the_class_wait():
    q, _ = make(1, depth=1)
    a = q.enqueue(ask(), 0.0)
    for t in range(5):  # each waits 20 s
        b = q.enqueue(ask(), 20.0 * t)
        q.release(a, None, 20.0 * (t + 1))
        a = b
    estimate = q.classes[2].wait_estimate
    q.enqueue(ask(), 100.0)
    full = q.enqueue(ask(), 100.0)
    assert full.refusal.retry_after == math.ceil(estimate) == 14


def test_never_fits_is_503_without_retry_after():
    q, _ = make(4, ever=8)
    e = q.enqueue(ask(seqs=9), 0.0)
    assert e.refusal == Refusal(503, "never", "no worker can ever take this request: 9 sequences exceed the "
                                              "fleet's limit of 8", None)
    q2, _ = make(0, ever=0)
    assert q2.enqueue(ask(), 0.0).refusal.message == ("no worker can ever take this request: no worker of this "
                                                      "protocol")


def test_release_is_idempotent_and_withdraw_frees_the_queue():
    q, _ = make(1)
    a = q.enqueue(ask(), 0.0)
    b = q.enqueue(ask(nbytes=7), 0.0)
    assert q.classes[2].nbytes == 7
    q.withdraw(b, 1.0)
    assert q.classes[2].depth == 0 and q.classes[2].nbytes == 0 and not b.granted
    q.release(a, None, 2.0)
    q.release(a, None, 2.0)
    assert q.classes[2].held == 0 and q.classes[2].held_requests == 0


def test_a_large_unit_is_not_passed_over():
    q, _ = make(4)
    small = q.enqueue(ask(seqs=2), 0.0)
    big = q.enqueue(ask(seqs=4), 1.0)
    later = q.enqueue(ask(seqs=1), 2.0)
    assert small.granted and not big.granted and not later.granted  # 2 free, but big is first
    q.release(small, None, 3.0)
    assert big.granted and not later.granted


# -- tenants ---------------------------------------------------------------------------


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def served(weights: dict[str, float] | None, loads: dict[str, int], work: dict[str, float],
           steps: int = 400) -> dict[str, float]:
    """Run a fleet of 8 slots for ``steps`` ticks, each request holding its
    slot one tick; each tick every tenant sends ``loads[t]`` requests (its
    backlog capped at 40): both want more than half the fleet. The work
    each tenant got admitted after the first 20 ticks."""
    q, _ = make(8, weights=weights or {}, depth=10_000)
    waiting: dict = {}  # in arrival order: the run is deterministic
    running: list = []
    got = dict.fromkeys(loads, 0.0)
    backlog = dict.fromkeys(loads, 0)
    for step in range(steps):
        now = float(step)
        for e in running:
            q.release(e, None, now)
        running = [e for e in waiting if e.granted]
        for e in running:
            del waiting[e]
            backlog[e.ask.tenant] -= 1
            if step >= 20:
                got[e.ask.tenant] += e.ask.work
        for tenant, n in loads.items():
            for _ in range(min(n, 40 - backlog[tenant])):
                waiting[q.enqueue(ask(tenant=tenant, work=work[tenant]), now)] = None
                backlog[tenant] += 1
    return got


def test_equal_tenants_share_by_work_not_by_requests():
    # heavy sends ten times light's load; both more than the fleet's half
    got = served(None, {"heavy": 50, "light": 5}, {"heavy": 100.0, "light": 100.0})
    assert jain(list(got.values())) >= 0.95
    # unequal requests: light's cost 4x heavy's; the shares are equal in work
    got = served(None, {"heavy": 50, "light": 5}, {"heavy": 50.0, "light": 200.0})
    assert jain(list(got.values())) >= 0.95


def test_weights_set_the_shares():
    got = served({"a": 3.0}, {"a": 10, "b": 10}, {"a": 100.0, "b": 100.0})
    assert got["a"] / got["b"] == pytest.approx(3.0, rel=0.05)


def test_actual_work_corrects_the_counter():
    q, _ = make(1)
    a = q.enqueue(ask(tenant="x", work=100.0), 0.0)
    q.release(a, 400.0, 1.0)
    assert q.classes[2].counters["x"] == 400.0


def test_idle_tenant_comes_back_lifted():
    q, _ = make(1)
    first = q.enqueue(ask(tenant="a", work=100.0), 0.0)
    for t in range(5):
        e = q.enqueue(ask(tenant="a", work=100.0), float(t))
        q.release(first, None, float(t) + 0.5)
        first = e
    assert q.classes[2].counters["a"] == 600.0  # six admitted
    q.enqueue(ask(tenant="a", work=100.0), 10.0)
    q.enqueue(ask(tenant="b", work=100.0), 10.0)
    # b starts at a's counter, not 0: it cannot claim the whole past
    assert q.classes[2].counters["b"] == 600.0


def test_tenants_past_the_bound_share_one_name():
    q, _ = make(1, max_tenants=2)
    for name in ("a", "b"):
        q.enqueue(ask(tenant=name), 0.0)
    assert q.tenant_of(2, "c") == "other"
    assert q.tenant_of(2, "a") == "a"


# -- groups ----------------------------------------------------------------------------


def test_group_waits_for_all_members_then_goes_whole():
    q, _ = make(8)
    members = [q.enqueue(ask(group="g", group_size=4, seqs=2), float(i)) for i in range(3)]
    assert not any(e.granted for e in members)
    members.append(q.enqueue(ask(group="g", group_size=4, seqs=2), 3.0))
    assert all(e.granted for e in members)
    assert q.classes[2].held == 8


def test_group_without_room_waits_whole():
    q, _ = make(4)
    blocker = q.enqueue(ask(seqs=1), 0.0)
    members = [q.enqueue(ask(group="g", group_size=2, seqs=2), 0.0) for _ in range(2)]
    assert not any(e.granted for e in members)  # 4 needed, 3 free
    q.release(blocker, None, 1.0)
    assert all(e.granted for e in members)


def test_group_incomplete_at_its_wait_is_shed_whole():
    q, _ = make(8, wait=5.0)
    members = [q.enqueue(ask(group="g", group_size=3), 0.0) for _ in range(2)]
    q.expire(5.0)
    assert [e.refusal for e in members] == [Refusal(
        429, "group_incomplete", "overloaded: shed from the rollout queue (group_incomplete): its group had 2 of 3 "
                                 "members after 5 s", 1)] * 2


def test_a_member_shed_for_depth_sheds_its_group():
    q, _ = make(8, depth=2)
    members = [q.enqueue(ask(group="g", group_size=3), 0.0) for _ in range(3)]
    assert [e.refusal.reason for e in members] == ["queue_depth"] * 3
    assert q.classes[2].depth == 0


def test_group_larger_than_the_fleet_is_503_for_every_member_at_once():
    q, _ = make(4)
    a = q.enqueue(ask(group="g", group_size=2, seqs=3), 0.0)
    assert a.refusal is None and not a.granted  # 3 + at least 1 to come fits in 4
    b = q.enqueue(ask(group="g", group_size=2, seqs=3), 0.0)
    never = Refusal(503, "never", "group g of 2 members holds at least 6 sequences, over the fleet's limit of 4",
                    None)
    assert a.refusal == b.refusal == never
    assert q.classes[2].depth == 0 and q.classes[2].shed == {"never": 2} and not q.groups


def test_group_of_more_members_than_the_fleet_holds_is_503_at_its_first_member():
    q, _ = make(4, wait=5.0)
    first = q.enqueue(ask(group="g", group_size=5), 0.0)
    assert first.refusal == Refusal(503, "never", "group g of 5 members holds at least 5 sequences, over the "
                                                  "fleet's limit of 4", None)
    assert q.classes[2].depth == 0 and not q.groups
    # a later member of the same group is refused alike, not left waiting for the group's wait
    assert q.enqueue(ask(group="g", group_size=5), 1.0).refusal.status == 503
    # a group that does fit still forms
    fits = q.enqueue(ask(group="h", group_size=4), 2.0)
    assert fits.refusal is None and not fits.granted


OPS = stg.lists(
    stg.one_of(
        stg.tuples(stg.just("member"), stg.integers(0, 3), stg.integers(1, 3)),
        stg.tuples(stg.just("single"), stg.integers(1, 4), stg.just(0)),
        stg.tuples(stg.just("release"), stg.integers(0, 50), stg.just(0)),
        stg.tuples(stg.just("withdraw"), stg.integers(0, 50), stg.just(0)),
        stg.tuples(stg.just("tick"), stg.integers(1, 4), stg.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(OPS, stg.integers(2, 10))
def test_no_group_is_ever_partly_admitted(ops, capacity):
    q, _ = make(capacity, wait=6.0)
    entries = []
    now = 0.0
    sizes = {0: 2, 1: 3, 2: 4, 3: 2}
    for op, a, b in ops:
        if op == "member":
            entries.append(q.enqueue(ask(group=f"g{a}", group_size=sizes[a], seqs=b), now))
        elif op == "single":
            entries.append(q.enqueue(ask(seqs=a), now))
        elif op == "release" and entries:
            q.release(entries[a % len(entries)], None, now)
        elif op == "withdraw" and entries:
            q.withdraw(entries[a % len(entries)], now)
        elif op == "tick":
            now += a
            q.expire(now)
        held = sum(e.ask.seqs for e in entries if e.granted and not e.released)
        assert sum(c.held for c in q.classes) == held <= capacity
        units = {}
        for e in entries:
            if e.unit is not None:
                units.setdefault(id(e.unit), (e.unit, []))[1].append(e)
        for unit, members in units.values():
            if unit.size > 1 and any(e.granted for e in members):
                granted = [e for e in members if e.granted]
                # every member the unit holds was granted together, and it held its full size
                assert len(granted) == unit.size == len(unit.entries)
                assert all(e in granted for e in unit.entries)


# -- the async face ---------------------------------------------------------------------


@pytest.fixture
def anyio_backend():
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


@pytest.mark.anyio
async def test_admit_waits_sheds_at_wait_and_withdraws_when_cancelled():
    from asgi_generate.config import Settings
    from asgi_generate.request.gate import Admission

    class Router:
        workers = []
        pauses = type("P", (), {"paused": staticmethod(lambda p: False)})()

    adm = Admission(Settings(admission=True, admission_queue_wait=5.0), lambda: Router, clock=trio.current_time)
    q = adm.queue("sglang")
    fleet = Fleet(1)
    fleet.queue = q
    q.room = fleet
    first = await adm.admit(ask())
    assert first.granted
    t0 = trio.current_time()
    shed = await adm.admit(ask())
    assert shed.refusal.reason == "wait" and trio.current_time() - t0 == pytest.approx(5.0)
    with anyio.move_on_after(1.0):
        await adm.admit(ask(nbytes=9))
    assert q.classes[2].depth == 0 and q.classes[2].nbytes == 0
    async with anyio.create_task_group() as tg:
        got = []

        async def wait_one():
            got.append(await adm.admit(ask()))

        tg.start_soon(wait_one)
        await anyio.sleep(2.0)
        q.release(first, None, trio.current_time())
    assert got[0].granted and got[0].waited == pytest.approx(2.0)


@pytest.mark.parametrize("settings, message", [
    ({"admission_default_class": "x"}, "--admission-default-class (ASGI_GENERATE_ADMISSION_DEFAULT_CLASS) 'x' is "
                                       "not one of eval, agent, rollout, bulk"),
    ({"admission_tenant_weights": "a=0"}, "--admission-tenant-weights (ASGI_GENERATE_ADMISSION_TENANT_WEIGHTS): "
                                          "'a=0' is not TENANT=WEIGHT with a positive weight"),
    ({"admission_engine_priority": "vip=1"}, "--admission-engine-priority (ASGI_GENERATE_ADMISSION_ENGINE_PRIORITY): "
                                             "'vip=1' is not CLASS=INTEGER with a class of eval, agent, rollout, bulk"),
    ({"admission_classes": "a,a", "admission_default_class": "a"},
     "--admission-classes (ASGI_GENERATE_ADMISSION_CLASSES) must name distinct classes"),
])
def test_settings_are_checked_at_start(settings, message):
    from asgi_generate.config import Settings

    with pytest.raises(ValueError) as err:
        Settings(**settings).check()
    assert str(err.value) == message


def test_headers_make_the_ask():
    from asgi_generate.config import Settings
    from asgi_generate.request.gate import Admission
    from asgi_generate.sdk._codec import GenerateRequest, RequestError
    from asgi_generate.tracing.state import RequestState

    adm = Admission(Settings(admission=True, admission_engine_priority="eval=-5"), lambda: None)
    st = RequestState("0" * 32, "sglang", "/generate", "POST")
    st.headers = {b"x-priority-class": b"eval", b"authorization": b"Bearer secret", b"x-group-id": b"step7",
                  b"x-group-size": b"8", b"x-deadline-ms": b"1500"}
    st.input_length, st.body_bytes = 100, 400
    got = adm.ask("sglang", GenerateRequest(stream=False, max_new_tokens=50), st)
    assert got == Ask("sglang", 0, "token-2bb80d537b1d", 1, 200.0, 400, st.t_received + 1.5, "step7", 8, 100)
    assert (st.priority_class, st.tenant, st.group_id) == ("eval", "token-2bb80d537b1d", "step7")
    assert adm.engine_fields(st) == {"priority": -5}
    st.headers = {b"x-group-id": b"g"}
    with pytest.raises(RequestError) as err:
        adm.ask("sglang", GenerateRequest(stream=False), st)
    assert (err.value.status, err.value.message) == (400, "x-group-id needs x-group-size between 1 and 1024")
    st.headers = {b"x-deadline-ms": b"soon"}
    with pytest.raises(RequestError) as err:
        adm.ask("sglang", GenerateRequest(stream=False), st)
    assert err.value.message == "x-deadline-ms must be a number of milliseconds, at least 0"


def test_the_room_counts_stale_and_full_engines_as_full():
    from types import SimpleNamespace

    from asgi_generate.request.saturation import Saturation
    from asgi_generate.workers.engine_load import EngineLoad

    now = [100.0]
    sat = Saturation(10, waiting_tokens=500, stale=1.0, clock=lambda: now[0], kv_usage=0.9)
    workers = [SimpleNamespace(id=f"w{i}", role=role) for i, role in enumerate(
        ("aggregated", "aggregated", "decode", "prefill", "aggregated", "aggregated", "aggregated"))]
    up = lambda w: w.id != "w5"  # noqa: E731
    sat.take(workers[0], EngineLoad(7, 0, 0.2), own=3)   # others 4: room 6
    sat.take(workers[1], EngineLoad(2, 0, None), own=0)  # room 8
    sat.take(workers[2], EngineLoad(12, 0, 0.5), own=0)  # over its limit: room 0
    sat.take(workers[3], EngineLoad(0, 0), own=0)        # prefill: not counted
    sat.take(workers[4], EngineLoad(0, 600), own=0)      # waiting tokens: full
    sat.take(workers[6], EngineLoad(0, 0, 0.95), own=0)  # KV usage: full
    assert sat.room(workers, up, paused=False, held=5, per_request=1.0) == Room(9, 50, 60)
    assert sat.room(workers, up, paused=True, held=0, per_request=1.0) == Room(0, 50, 60)
    now[0] = 101.5  # every reading stale: full, never empty
    assert sat.room(workers, up, paused=False, held=0, per_request=1.0).free == 0
    sat.take(workers[1], None, 0)
    assert "w1" not in sat.readings


def test_the_engines_load_readers_read_kv_usage():
    from asgi_generate_sglang.engine import read_loads
    from asgi_generate_vllm.engine import read_metrics

    body = orjson_dumps({"loads": [
        {"num_running_reqs": 3, "num_waiting_reqs": 2, "num_waiting_uncached_tokens": 40, "token_usage": 0.25},
        {"num_running_reqs": 1, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0, "token_usage": 0.5}]})
    assert read_loads(body) == (6, 40, 0.5)
    text = (b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 4.0\n"
            b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\"} 1.0\n")
    assert read_metrics(text) == (5, 0, None)
    text += b"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.75\n"
    assert read_metrics(text) == (5, 0, 0.75)


def orjson_dumps(obj) -> bytes:
    import orjson

    return orjson.dumps(obj)


def _preemptible_fleet(capacity: int, *classes: str):
    from types import SimpleNamespace

    from asgi_generate.config import Settings
    from asgi_generate.request.gate import Admission

    adm = Admission(Settings(admission=True, admission_preemption=True, admission_max_parked=3), lambda: None)
    q = adm.queue("sglang")
    fleet = Fleet(capacity)
    fleet.queue = q
    q.room = fleet
    held = []
    for cls in classes:
        entry = q.enqueue(ask(cls), 0.0)
        assert entry.granted
        st = SimpleNamespace(stream=True, headers={b"x-preemptible": b"1"}, attempts=[], cached_tokens=None)
        held.append(adm.parking(entry, st, None))
    return adm, q, held


def test_preemption_chooses_lower_classes_lowest_and_latest_first():
    from types import SimpleNamespace

    adm, q, (agent, rollout, bulk1, bulk2) = _preemptible_fleet(4, "agent", "rollout", "bulk", "bulk")
    plain = SimpleNamespace(stream=True, headers={}, attempts=[])
    assert adm.parking(agent.entry, plain, None) is None  # not opted in
    q.enqueue(ask("eval", seqs=2), 1.0)  # waits for 2 sequences: both bulk streams go, the latest first
    assert adm._victims == [bulk2, bulk1]
    assert [p.preempting for p in (agent, rollout, bulk1, bulk2)] == [False, False, True, True]
    q.pump(2.0)  # what is being freed makes room already: no one more
    assert adm._victims == [bulk2, bulk1]


def test_preemption_spares_the_waiting_class_and_higher_ones():
    adm, q, (agent, rollout) = _preemptible_fleet(2, "agent", "rollout")
    q.enqueue(ask("rollout"), 1.0)
    q.enqueue(ask("agent"), 1.0)
    assert adm._victims == [rollout]  # the agent unit preempts the rollout stream, never the agent one
