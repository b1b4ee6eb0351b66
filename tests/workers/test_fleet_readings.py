"""The fleet's state read from the engines (asgi_generate/workers/fleet_state.py):
its transitions, with readings given (no process, no socket)."""

from __future__ import annotations

import anyio
import pytest

from asgi_generate.protocols import PROTOCOLS
from asgi_generate.workers.fleet_state import PAUSE, WEIGHTS, FleetState, Reading
from fakes import CallPool, CannedAnswer
from asgi_generate.workers.router import Router


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    return request.param


def _fleet(n: int = 2, protocol: str = "sglang") -> tuple[Router, FleetState]:
    router = Router([(protocol, f"http://127.0.0.1:{9 + i}") for i in range(n)])
    for w in router.workers:
        w.healthy = True
        w.info = {"weight_version": "v0"}
    return router, router.fleet


def _readings(router: Router, *states: tuple[bool | None, str | None]) -> dict:
    return {w: Reading(*s) for w, s in zip(router.workers, states)}


def _apply(fleet: FleetState, router: Router, *states) -> None:
    fleet.apply("sglang", _readings(router, *states), fleet.mark("sglang"))


def test_a_pause_the_engines_report_begins_here_and_their_resume_ends_it():
    router, fleet = _fleet()
    pauses = router.pauses
    _apply(fleet, router, (False, "v0"), (False, "v0"))
    assert (pauses.paused("sglang"), pauses.epoch("sglang")) == (False, 0)
    _apply(fleet, router, (True, "v0"), (False, "v0"))  # one engine alone: not the fleet
    assert (pauses.paused("sglang"), pauses.epoch("sglang")) == (False, 0)
    _apply(fleet, router, (True, "v0"), (True, "v0"))  # every engine: the fleet is paused
    assert (pauses.paused("sglang"), pauses.epoch("sglang")) == (True, 1)
    _apply(fleet, router, (True, "v0"), (True, "v0"))  # still the same pause
    assert (pauses.paused("sglang"), pauses.epoch("sglang")) == (True, 1)
    _apply(fleet, router, (False, "v0"), (True, "v0"))  # one resumed: the resume has begun
    assert (pauses.paused("sglang"), pauses.epoch("sglang")) == (False, 1)
    assert (fleet.counts["pauses_learned"], fleet.counts["resumes_learned"]) == (1, 1)


@pytest.mark.anyio
async def test_one_engine_not_ready_is_no_pause_and_its_failing_probes_count():
    """SGLang's /ready answers 503 while an engine is unhealthy or shutting
    down too: read paused alone, it neither pauses the fleet here nor has
    its failed health probes excused as a paused fleet's."""
    router, fleet = _fleet(3)
    sick = router.workers[1]
    sick.probe_pool = CallPool(CannedAnswer(503, b""))
    for _ in range(router.health_failures):
        _apply(fleet, router, (False, "v0"), (True, "v0"), (False, "v0"))
        assert await router.probe(sick) is False
    assert (router.pauses.paused("sglang"), fleet.counts["pauses_learned"]) == (False, 0)
    assert ([w.healthy for w in router.workers], sick.last_error) == ([True, False, True], "health answered 503")


@pytest.mark.anyio
async def test_a_pause_ends_once_an_engine_reads_resumed_though_one_stays_not_ready():
    """Whoever took it (here, a sibling that told this process; the resume
    went through another process): once an engine reads resumed the pause
    is over, so one engine that stays not ready (SGLang's /ready 503 after
    the resume) cannot hold it open, its failing probes excused, for good."""
    router, fleet = _fleet(3)
    sick = router.workers[1]
    sick.probe_pool = CallPool(CannedAnswer(503, b""))
    message = {"kind": "call", "protocol": "sglang", "sender": 7, "number": 1, "deadline_s": 30.0, "pause": True}
    fleet.apply_call_message({**message, "open": True})
    fleet.apply_call_message({**message, "open": False})
    _apply(fleet, router, (True, "v0"), (True, "v0"), (True, "v0"))
    assert await router.probe(sick) is False
    assert (router.pauses.pausing("sglang"), sick.failures) == (True, 0)  # a paused fleet's: excused
    _apply(fleet, router, (False, "v1"), (True, "v1"), (False, "v1"))
    assert (router.pauses.paused("sglang"), fleet.counts["resumes_learned"]) == (False, 1)
    for _ in range(router.health_failures):
        assert await router.probe(sick) is False
    assert [w.healthy for w in router.workers] == [True, False, True]


def test_readings_across_this_process_own_call_change_nothing():
    router, fleet = _fleet()
    pauses = router.pauses
    stale = fleet.mark("sglang")  # a reading starts
    with fleet.local_call("sglang", PAUSE):
        pauses.begin("sglang")  # the admin route's own pause
        _apply(fleet, router, (False, "v0"), (False, "v0"))  # read while the call is out: ignored
        assert pauses.paused("sglang")
    fleet.apply("sglang", _readings(router, (False, "v0"), (False, "v0")), stale)  # begun before: stale
    assert pauses.paused("sglang")
    # A fresh reading after the call was answered: the engines say resumed
    # (another process took the resume), though this one never read the pause.
    _apply(fleet, router, (False, "v0"), (False, "v0"))
    assert not pauses.paused("sglang") and pauses.epoch("sglang") == 1


def test_a_paused_reading_after_this_process_resumed_begins_no_new_pause():
    """SGLang's /ready may answer 503 a moment after the resume (its status
    is unhealthy until a /health passes): the same pause, not a new one."""
    router, fleet = _fleet()
    pauses = router.pauses
    with fleet.local_call("sglang", PAUSE):
        pauses.begin("sglang")
    _apply(fleet, router, (True, "v0"), (True, "v0"))  # read paused: the same pause, no new epoch
    assert pauses.epoch("sglang") == 1
    with fleet.local_call("sglang", PAUSE):
        pauses.end("sglang")
    _apply(fleet, router, (True, "v0"), (False, "v0"))
    assert (pauses.paused("sglang"), pauses.epoch("sglang")) == (False, 1)
    _apply(fleet, router, (False, "v0"), (False, "v0"))
    _apply(fleet, router, (True, "v0"), (True, "v0"))  # once read resumed, a pause again is a new one
    assert (pauses.paused("sglang"), pauses.epoch("sglang")) == (True, 2)


def test_a_failed_reading_changes_nothing_and_marks_no_worker_down():
    router, fleet = _fleet()
    _apply(fleet, router, (True, "v0"), (True, "v0"))
    _apply(fleet, router, (None, None), (None, None))
    assert router.pauses.paused("sglang") and all(w.healthy for w in router.workers)
    assert [w.weight_version for w in router.workers] == ["v0", "v0"] and fleet.counts["failed"] == 2


def test_the_fleet_version_follows_the_version_the_engines_moved_to():
    router, fleet = _fleet(4)
    w0, w1, w2, w3 = router.workers
    _apply(fleet, router, (False, "v0"), (False, "v0"), (False, "v0"), (False, "v0"))
    assert router.fleet_versions == {}  # the first reading: no move seen
    _apply(fleet, router, (False, "v1"), (False, "v0"), (False, "v0"), (False, "v0"))
    assert router.fleet_versions == {"sglang": "v1"} and w0.weight_version == "v1"
    assert [router.routable(w) for w in router.workers] == [True, False, False, False]
    # Two updates between readings, w3's second one failed: the version most hold.
    _apply(fleet, router, (False, "v3"), (False, "v3"), (False, "v3"), (False, "v2"))
    assert router.fleet_versions == {"sglang": "v3"}
    assert [router.routable(w) for w in router.workers] == [True, True, True, False]
    assert [w.weight_version for w in router.workers] == ["v3", "v3", "v3", "v2"]
    assert router.routable(w0, "v3") and not router.routable(w0, "v4")
    assert fleet.counts["versions_learned"] == 2


def test_a_tie_between_new_versions_goes_to_the_greatest():
    router, fleet = _fleet(2)
    _apply(fleet, router, (False, "v0"), (False, "v0"))
    _apply(fleet, router, (False, "v10"), (False, "v9"))
    assert router.fleet_versions == {"sglang": "v10"}


def test_a_tie_with_a_restarted_engine_goes_to_the_trainer_s_version():
    """An engine restarted between readings is back at its initial version,
    below the version the other engine was updated to."""
    router, fleet = _fleet(2)
    _apply(fleet, router, (False, "7"), (False, "7"))
    _apply(fleet, router, (False, "default"), (False, "8"))
    assert router.fleet_versions == {"sglang": "8"}
    assert [router.routable(w) for w in router.workers] == [False, True]


@pytest.mark.anyio
async def test_an_abort_with_no_pause_known_asks_the_engine_and_held_streams_wait_for_the_resume():
    router, fleet = _fleet()
    said = {"paused": True}

    async def read(worker, timeout=5.0, versions=True):
        return Reading(said["paused"], "v0" if versions else None)

    fleet._read = read
    stale = fleet.mark("sglang")  # a periodic reading started before the abort came
    assert await fleet.confirm_pause(router.workers[0]) is True
    assert router.pauses.epoch("sglang") == 1
    assert await fleet.confirm_pause(router.workers[1]) is False  # known now: not asked again
    fleet.apply("sglang", _readings(router, (False, "v0"), (False, "v0")), stale)  # stale: ignored
    assert router.pauses.paused("sglang")
    held: list = []

    async def hold() -> None:
        held.append(await router.pauses.hold("sglang", 10, 30.0))

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold)
        with anyio.fail_after(10):
            while router.pauses.held != 1:
                await anyio.sleep(0.01)
        said["paused"] = False
        await fleet.read()  # the engines resumed
    assert held == [None] and router.pauses.counts["resumed"] == 1


@pytest.mark.anyio
async def test_an_abort_while_the_engine_is_not_paused_begins_nothing():
    router, fleet = _fleet()

    async def read(worker, timeout=5.0, versions=True):
        return Reading(False, None)

    fleet._read = read
    assert await fleet.confirm_pause(router.workers[0]) is False
    assert router.pauses.epoch("sglang") == 0


@pytest.mark.anyio
async def test_an_abort_after_a_whole_transaction_ended_is_held_and_resumes_at_once():
    # Another process paused, loaded v1 and resumed before this reading: the
    # engine is not paused, but serves another version than the stream's.
    router, fleet = _fleet()
    asked = []

    async def read(worker, timeout=5.0, versions=True):
        asked.append(versions)
        return Reading(False, "v1" if versions else None)

    fleet._read = read
    assert await fleet.confirm_pause(router.workers[0], "v0") is True
    assert asked == [True]
    assert (router.pauses.epoch("sglang"), router.pauses.paused("sglang")) == (1, False)
    assert fleet.counts["transactions_learned"] == 1
    assert router.pauses.aborted_since("sglang", 0)
    # The same version, or none known: an abort of its own, nothing begins.
    assert await fleet.confirm_pause(router.workers[1], "v1") is False
    assert await fleet.confirm_pause(router.workers[1]) is False
    assert asked == [True, True, False]
    assert (router.pauses.epoch("sglang"), fleet.counts["transactions_learned"]) == (1, 1)


@pytest.mark.anyio
async def test_the_reader_reads_every_up_worker_and_sleeps_its_interval():
    router, fleet = _fleet(3)
    router.workers[2].healthy = False  # down: its state is unknown, not read
    asked: list[str] = []

    async def read(worker, timeout=5.0, versions=True):
        asked.append(worker.id)
        return Reading(False, "v0")

    fleet._read, fleet.interval = read, 60.0
    async with anyio.create_task_group() as tg:
        await tg.start(fleet.run)
        with anyio.fail_after(10):
            while fleet.counts["readings"] < 1:
                await anyio.sleep(0.01)
        await anyio.sleep(0.1)
        tg.cancel_scope.cancel()
    assert sorted(asked) == ["w0", "w1"] and fleet.counts["readings"] == 1


def test_a_sibling_fence_message_applies_by_url_and_role():
    a, fa = _fleet(3)
    b, fb = _fleet(3)
    b.workers[0].fence = "failed long ago"
    a.weights_loaded("sglang", a.workers[:2], {a.workers[2]: "failed /update_weights_from_disk: 400"}, "v5",
                     True, True)
    message = fa.fence_message("sglang")
    fb.apply_fence_message(message)
    assert b.fleet_versions == {"sglang": "v5"}
    assert [(w.fence, w.weight_version, w.failed_updates) for w in b.workers] == [
        (None, "v5", 0), (None, "v5", 0), ("failed /update_weights_from_disk: 400", "v0", 1)]
    assert [b.routable(w) for w in b.workers] == [True, True, False]
    a.clear_fence(a.workers[2], "v5")
    fb.apply_fence_message(fa.fence_message("sglang"))
    assert b.workers[2].fence is None and b.routable(b.workers[2])


@pytest.mark.parametrize("status, body, paused", [
    (200, b"", False), (503, b"", True), (500, b"", None), (404, b"", None)])
def test_sglang_ready_read_as_paused(status, body, paused):
    assert PROTOCOLS["sglang"].pause_reader(status, body) is paused


@pytest.mark.parametrize("status, body, paused", [
    (200, b'{"is_paused": true}', True), (200, b'{"is_paused": false}', False), (200, b"[]", None),
    (200, b"not json", None), (500, b'{"error": "x"}', None)])
def test_vllm_is_paused_read(status, body, paused):
    assert PROTOCOLS["vllm"].pause_reader(status, body) is paused


def test_this_process_weight_call_stales_versions_but_not_the_pause_state():
    router, fleet = _fleet()
    _apply(fleet, router, (False, "v0"), (False, "v0"))
    stale = fleet.mark("sglang")
    with fleet.local_call("sglang", WEIGHTS):
        router.weights_loaded("sglang", router.workers, {}, "v1", True, True)
        fleet.apply("sglang", _readings(router, (True, "v0"), (True, "v0")), stale)
    # The old versions read before the call answered are not the workers':
    # the pause the same reading shows is the engines'.
    assert [w.weight_version for w in router.workers] == ["v1", "v1"] and router.fleet_versions == {"sglang": "v1"}
    assert router.pauses.paused("sglang")


@pytest.mark.anyio
async def test_while_paused_the_versions_are_read_every_interval_and_once_resumed():
    router, fleet = _fleet(2)
    said = {"paused": True, "version": "v0"}
    asked: list[bool] = []

    async def read(worker, timeout=5.0, versions=True):
        asked.append(versions)
        return Reading(said["paused"], said["version"] if versions else None)

    fleet._read, fleet.interval = read, 60.0
    await fleet.read()
    assert router.pauses.paused("sglang") and asked == [True, True]
    said["version"] = "v1"
    await fleet.read()  # paused: versions not read
    assert asked[2:] == [False, False] and router.workers[0].weight_version == "v0"
    said["paused"] = False
    await fleet.read()  # the resume, then the versions it resumes on
    assert asked[4:] == [False, False, True, True]
    assert not router.pauses.paused("sglang") and router.fleet_versions == {"sglang": "v1"}
    fleet.interval = 0.0  # an interval passed: the versions are read while paused too
    said["paused"], said["version"] = True, "v2"
    await fleet.read()
    assert asked[8:] == [True, True] and router.pauses.paused("sglang") and router.fleet_versions == {"sglang": "v2"}


@pytest.mark.anyio
async def test_a_version_an_answer_showed_wakes_the_reader_at_once():
    """A chunk's weight version other than its worker's known one reads
    the fleet now, not an interval later."""
    router, fleet = _fleet(2)
    engine = {"w0": "v0", "w1": "v0"}

    async def read(worker, timeout=5.0, versions=True):
        return Reading(False, engine[worker.id])

    fleet._read, fleet.interval = read, 3600.0
    async with anyio.create_task_group() as tg:
        await tg.start(fleet.run)
        with anyio.fail_after(10):
            while fleet.counts["readings"] < 1:
                await anyio.sleep(0.01)
        engine.update(w0="v1", w1="v1")  # behind this process's back
        fleet.version_reported(router.workers[0])
        with anyio.fail_after(10):
            while fleet.counts["readings"] < 2:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert fleet.counts["version_triggers"] == 1
    assert [w.weight_version for w in router.workers] == ["v1", "v1"] and router.fleet_versions == {"sglang": "v1"}


@pytest.mark.anyio
async def test_a_siblings_aborting_call_is_open_here_until_it_says_answered():
    """A weight call that aborts without pausing, taken by a sibling: its
    aborts are the fleet's here too (held), until its closing message, or
    past its deadline when that never comes."""
    router, fleet = _fleet(1)
    pauses = router.pauses
    mark = pauses.mark("sglang")
    message = {"kind": "call", "protocol": "sglang", "sender": 7, "number": 1, "deadline_s": 30.0}
    fleet.apply_call_message({**message, "open": True})
    fleet.apply_call_message({**message, "open": True})  # told twice: one call
    assert pauses.paused("sglang") and pauses.aborted_since("sglang", mark) and not pauses.pausing("sglang")
    fleet.apply_call_message({**message, "open": False})
    assert not pauses.paused("sglang") and fleet.counts["call_messages"] == 3
    fleet.apply_call_message({**message, "number": 2, "deadline_s": 0.0, "open": True})
    assert pauses.paused("sglang")
    fleet._sibling_calls[(7, 2)] = ("sglang", False, anyio.current_time() - 1)  # its close never came
    fleet._expire_sibling_calls()
    assert not pauses.paused("sglang") and fleet._sibling_calls == {}


@pytest.mark.anyio
async def test_a_siblings_aborting_pause_begins_here_before_the_engines_abort_and_the_readings_end_it():
    """A pause with abort taken by a sibling: begun here on its opening
    message (so the aborts it causes are held even when the trainer's
    resume comes before this process reads an engine); readings taken
    before its fan-out was answered see the engines not yet paused and are
    stale; once it closed, the engines' resume read here ends it."""
    router, fleet = _fleet(2)
    pauses = router.pauses
    mark, before = pauses.mark("sglang"), fleet.mark("sglang")
    message = {"kind": "call", "protocol": "sglang", "sender": 7, "number": 1, "deadline_s": 30.0, "pause": True}
    fleet.apply_call_message({**message, "open": True})
    fleet.apply_call_message({**message, "open": True})  # told twice: one pause
    assert (pauses.pausing("sglang"), pauses.aborted_since("sglang", mark), pauses.epoch("sglang")) == (True, True, 1)
    _apply(fleet, router, (False, "v0"), (False, "v0"))  # the engines not paused yet: stale
    fleet.apply("sglang", _readings(router, (False, "v0"), (False, "v0")), before)  # begun before: stale
    assert pauses.pausing("sglang")
    during = fleet.mark("sglang")
    fleet.apply_call_message({**message, "open": False})
    fleet.apply("sglang", _readings(router, (False, "v0"), (False, "v0")), during)  # read across the close: stale
    assert pauses.pausing("sglang") and fleet.counts["resumes_learned"] == 0
    _apply(fleet, router, (True, "v0"), (True, "v0"))  # the engines paused: the same pause
    assert (pauses.pausing("sglang"), pauses.epoch("sglang"), fleet.counts["pauses_learned"]) == (True, 1, 0)
    _apply(fleet, router, (False, "v1"), (False, "v1"))  # resumed on new weights
    assert (pauses.paused("sglang"), fleet.counts["resumes_learned"], fleet.counts["call_messages"]) == (False, 1, 3)
    assert [w.weight_version for w in router.workers] == ["v1", "v1"]


@pytest.mark.anyio
async def test_a_siblings_pause_whose_close_never_came_leaves_the_pause_to_the_readings():
    router, fleet = _fleet(1)
    message = {"kind": "call", "protocol": "sglang", "sender": 7, "number": 1, "deadline_s": 0.0, "pause": True}
    fleet.apply_call_message({**message, "open": True})
    fleet._sibling_calls[(7, 1)] = ("sglang", True, anyio.current_time() - 1)  # the sibling died
    fleet._expire_sibling_calls()
    assert fleet._sibling_calls == {} and router.pauses.pausing("sglang")
    _apply(fleet, router, (False, "v0"))  # no longer stale: the engine is not paused
    assert not router.pauses.paused("sglang")


@pytest.mark.anyio
async def test_without_readings_a_siblings_pause_is_open_here_only_until_its_fan_out_was_answered():
    """``--fleet-state-interval 0``: no reading would ever end a pause a
    sibling told of (the trainer's resume may reach another process), so
    it is open here as its aborting call is, until its closing message:
    the aborts it causes are held, and go on once its fan-out was answered."""
    router = Router([("sglang", "http://127.0.0.1:9")], fleet_interval=0)
    fleet, pauses = router.fleet, router.pauses
    mark = pauses.mark("sglang")
    message = {"kind": "call", "protocol": "sglang", "sender": 7, "number": 1, "deadline_s": 30.0, "pause": True}
    fleet.apply_call_message({**message, "open": True})
    assert (pauses.paused("sglang"), pauses.aborted_since("sglang", mark), pauses.pausing("sglang")) == (True, True, False)
    fleet.apply_call_message({**message, "open": False})
    assert (pauses.paused("sglang"), fleet._sibling_calls) == (False, {})
