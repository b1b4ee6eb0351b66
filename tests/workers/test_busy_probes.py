"""Slow is not dead (workers/probes.py, ops/fanout.py), in process: a
worker busy with a call the frontend sent (in flight, or a pause it took
until the route ending it answered 200) is not taken out by a health probe
that fails or gets no answer; a refused or broken connection still takes it
out; the fan-out keeps that state, and a resume reaches a paused worker
that is down."""

from __future__ import annotations

import orjson
import pytest

from asgi_generate.exceptions import ConnectFailed, Unanswered
from asgi_generate.workers.router import Router
from fakes import ADMIN_OK, STALL, CallPool, CannedAnswer, FakeAdminContext, admin_call, admin_fleet

pytestmark = pytest.mark.anyio

UNHEALTHY = CannedAnswer(503, b"")


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    return request.param


class Riding:
    """A request riding a worker: what the probe told it."""

    route_key = attempt = None

    def __init__(self) -> None:
        self.lost: list[str] = []

    def worker_lost(self, worker, reason: str) -> None:
        self.lost.append(reason)


def _up(health) -> tuple[Router, Riding]:
    """A router with one up worker whose health route answers ``health``;
    one failed probe would take it out."""
    router = Router([("sglang", "http://127.0.0.1:9")], health_timeout=0.05, health_failures=1)
    (w,) = router.workers
    w.healthy, w.probe_pool = True, CallPool(health)
    riding = Riding()
    w.inflight.add(riding)
    return router, riding


@pytest.mark.parametrize("health", [UNHEALTHY, STALL], ids=["failing", "silent"])
@pytest.mark.parametrize("busy", ["call", "paused", "fleet_paused"])
async def test_a_probe_failing_while_the_worker_is_busy_counts_for_nothing(health, busy):
    router, riding = _up(health)
    (w,) = router.workers
    if busy == "call":
        w.calls = 1
    elif busy == "paused":
        w.paused.add("/continue_generation")
    else:  # another process's pause, read from the engines
        router.pauses.begin("sglang")
    assert await router.probe(w) is False
    assert (w.healthy, w.failures, w.times_down, w.last_error, riding.lost) == (True, 0, 0, None, [])
    w.calls, w.paused = 0, set()  # the call answered, the resume too: probes count again
    router.pauses.end("sglang")
    assert await router.probe(w) is False
    reason = "health answered 503" if health is UNHEALTHY else "health probe got no answer within 0.05 s"
    assert (w.healthy, w.failures, w.times_down, w.last_error, riding.lost) == (False, 1, 1, reason, [reason])


@pytest.mark.parametrize("gone", [ConnectFailed("connection refused"), Unanswered("connection closed")],
                         ids=["refused", "broken"])
async def test_a_busy_worker_whose_connection_is_refused_or_broken_is_lost_at_once(gone):
    router, riding = _up(gone)
    (w,) = router.workers
    w.calls = 1
    assert await router.probe(w) is False
    assert (w.healthy, w.times_down, riding.lost) == (False, 1, [str(gone)])


async def test_a_call_is_counted_while_in_flight_and_a_pause_until_its_resume_answered():
    seen = []

    def answer(method, path, body):
        seen.append((path, router.workers[0].calls, sorted(router.workers[0].paused)))
        return ADMIN_OK

    router, _ = admin_fleet(answer)
    ctx = FakeAdminContext(router)
    (w,) = router.workers
    assert (await admin_call(ctx, "POST", "/update_weights_from_disk", b'{"model_path": "/m"}'))[0] == 200
    assert (await admin_call(ctx, "POST", "/pause_generation", b'{"mode": "in_place"}'))[0] == 200
    assert (w.calls, w.paused) == (0, {"/continue_generation"})
    assert (await admin_call(ctx, "POST", "/release_memory_occupation", b"{}"))[0] == 200
    assert (await admin_call(ctx, "POST", "/resume_memory_occupation", b"{}"))[0] == 200
    assert w.paused == {"/continue_generation"}  # still paused: only its own route ends a pause
    assert (await admin_call(ctx, "POST", "/continue_generation", b"{}"))[0] == 200
    assert (w.calls, w.paused) == (0, set())
    assert seen == [
        (b"/update_weights_from_disk", 1, []),
        (b"/pause_generation", 1, ["/continue_generation"]),  # counted from the moment it is sent
        (b"/release_memory_occupation", 1, ["/continue_generation", "/resume_memory_occupation"]),
        (b"/resume_memory_occupation", 1, ["/continue_generation", "/resume_memory_occupation"]),
        (b"/continue_generation", 1, ["/continue_generation"]),
    ]


async def test_a_pause_the_engine_refused_is_undone_and_one_unanswered_is_kept():
    router, _ = admin_fleet(CannedAnswer(400, b'{"error": {"message": "bad mode"}}'), STALL)
    ctx = FakeAdminContext(router, admin_timeout=0.05)
    status, _, body = await admin_call(ctx, "POST", "/pause_generation", b'{"mode": "nap"}')
    assert status == 502
    assert [(r["worker"], r["status"]) for r in orjson.loads(body)] == [("w0", 400), ("w1", None)]
    assert [w.paused for w in router.workers] == [set(), {"/continue_generation"}]  # w1 may have taken it
    assert [w.calls for w in router.workers] == [0, 0]


@pytest.mark.parametrize("protocol, pause, resume, answer", [
    ("sglang", "/pause_generation", "/continue_generation",
     {"message": "Generation continued successfully.", "status": "ok"}),
    ("vllm", "/pause", "/resume", {"status": "resumed"}),
])
async def test_a_resume_reaches_every_paused_worker_down_or_not_and_names_one_it_could_not_reach(
        protocol, pause, resume, answer):
    ok = CannedAnswer(200, orjson.dumps(answer))
    router, pools = admin_fleet(ok, ok, ok, ok, protocol=protocol)
    ctx = FakeAdminContext(router)
    router.mark_down(router.workers[3], "connection refused")  # down before the pause: not paused by it
    assert (await admin_call(ctx, "POST", pause, b"{}"))[0] == 200
    w0, w1, w2, w3 = router.workers
    router.mark_down(w1, "health probe connection closed")  # an unrelated fault
    router.mark_down(w2, "connection refused")
    pools[2].answer = ConnectFailed("connection refused")  # w2 is gone
    status, headers, body = await admin_call(ctx, "POST", resume, b"{}")
    assert status == 502
    assert orjson.loads(body) == [
        {"worker": "w0", "status": 200, "body": answer},
        {"worker": "w1", "status": 200, "body": answer},
        {"worker": "w3", "status": None, "skipped": True, "body": "down: connection refused"},
        {"worker": "w2", "status": None, "skipped": True, "body": "down: connection refused"},
    ]
    assert headers[b"asgi-generate-skipped-workers"] == b"w3, w2"
    assert [len(p.calls) for p in pools] == [2, 2, 2, 0]
    assert [sorted(w.paused) for w in router.workers] == [[], [], [resume], []]
    # Named, a down worker still paused is called; one not paused is not.
    assert (await admin_call(ctx, "POST", resume, b"{}", query=b"worker=w2"))[0] == 503
    assert len(pools[2].calls) == 3
    status, _, body = await admin_call(ctx, "POST", resume, b"{}", query=b"worker=w1")
    assert (status, orjson.loads(body)) == (503, {"error": {
        "message": "worker 'w1' is down: health probe connection closed"}})
