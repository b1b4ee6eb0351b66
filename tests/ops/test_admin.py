"""The admin routes (asgi_generate/ops/admin.py, fanout.py) in process: the
starlette router called as an ASGI app, over a real router whose workers
are fake connection pools answering from a script (no socket, no process):
the admin token, the fan-out to every worker that is up, a named worker,
the combined answer, skipped workers, pauses and cache resets."""

from __future__ import annotations

import orjson
import pytest

from asgi_generate.ops.fanout import SKIPPED_HEADER, WORKER_HEADER, target
from asgi_generate.exceptions import ConnectFailed, Unanswered
from starlette.requests import Request

from fakes import ADMIN_OK, CallPool, CannedAnswer, FakeAdminContext, admin_call, admin_fleet


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_a_call_goes_to_every_worker_that_is_up_and_answers_the_first_ones_answer():
    router, pools = admin_fleet(ADMIN_OK, CannedAnswer(200, b'{"success": true, "w": 1}'), None)
    status, headers, body = await admin_call(FakeAdminContext(router), "POST", "/flush_cache", b"{}")
    assert (status, body) == (200, b'{"success": true}')
    assert headers[SKIPPED_HEADER.encode()] == b"w2"
    assert [p.calls for p in pools] == [[(b"POST", b"/flush_cache", b"{}")]] * 2 + [[]]


@pytest.mark.anyio
async def test_one_worker_failing_makes_a_502_listing_every_worker():
    router, _ = admin_fleet(ADMIN_OK, CannedAnswer(500, b'{"error": "oom"}'), ConnectFailed("connection refused"))
    status, headers, body = await admin_call(FakeAdminContext(router), "POST", "/flush_cache")
    assert status == 502
    assert orjson.loads(body) == [
        {"worker": "w0", "status": 200, "body": {"success": True}},
        {"worker": "w1", "status": 500, "body": {"error": "oom"}},
        {"worker": "w2", "status": None, "skipped": True, "body": "down: connection refused"},
    ]
    assert headers[SKIPPED_HEADER.encode()] == b"w2"
    assert not router.workers[2].healthy  # a refused call marks it down, as a request's leg would


@pytest.mark.anyio
async def test_an_unanswered_call_to_a_worker_that_then_refuses_is_a_skip_and_to_a_live_one_a_failure():
    # w1 was killed as the call went out on a reused connection: its new
    # connection is refused. w2 closed the connection too but still answers
    # its health read: it may have taken the call.
    router, pools = admin_fleet(ADMIN_OK, Unanswered("connection closed before the response head"),
                          Unanswered("connection closed before the response head"))
    router.workers[1].probe_pool = CallPool(ConnectFailed("connection refused"))
    router.workers[2].probe_pool = CallPool(ADMIN_OK)
    status, headers, body = await admin_call(FakeAdminContext(router), "POST", "/flush_cache")
    assert status == 502
    assert orjson.loads(body) == [
        {"worker": "w0", "status": 200, "body": {"success": True}},
        {"worker": "w2", "status": None, "body": "connection closed before the response head"},
        {"worker": "w1", "status": None, "skipped": True, "body": "down: connection closed before the response head"},
    ]
    assert headers[SKIPPED_HEADER.encode()] == b"w1"
    assert [w.healthy for w in router.workers] == [True, False, True]
    assert router.workers[1].probe_pool.calls == [(b"GET", b"/health", b"")]


@pytest.mark.anyio
async def test_every_worker_down_is_a_503_naming_each():
    router, _ = admin_fleet(None, None)
    status, _, body = await admin_call(FakeAdminContext(router), "POST", "/pause_generation")
    assert (status, orjson.loads(body)) == (503, {"error": {
        "message": "no worker of protocol 'sglang' is up: w0 (connection refused), w1 (connection refused)"}})


@pytest.mark.anyio
async def test_a_named_worker_alone_is_called_and_the_parameter_is_not_sent_on():
    router, pools = admin_fleet(ADMIN_OK, ADMIN_OK)
    status, _, _ = await admin_call(FakeAdminContext(router), "GET", "/flush_cache", query=b"worker=w1&x=1")
    assert status == 200
    assert [p.calls for p in pools] == [[], [(b"GET", b"/flush_cache?x=1", b"")]]
    assert (await admin_call(FakeAdminContext(router), "GET", "/flush_cache", headers=[(WORKER_HEADER.encode(), b"w0")]))[0] == 200
    assert len(pools[0].calls) == 1
    status, _, body = await admin_call(FakeAdminContext(router), "GET", "/flush_cache", query=b"worker=w7")
    assert (status, orjson.loads(body)) == (404, {"error": {"message": "no worker 'w7' of protocol 'sglang'"}})


@pytest.mark.anyio
async def test_the_admin_token_is_required_when_set():
    router, pools = admin_fleet(ADMIN_OK)
    ctx = FakeAdminContext(router, admin_token="s3cret")
    status, headers, _ = await admin_call(ctx, "POST", "/flush_cache")
    assert (status, headers[b"www-authenticate"], pools[0].calls) == (401, b"Bearer", [])
    assert (await admin_call(ctx, "POST", "/flush_cache", headers=[(b"authorization", b"Bearer wrong")]))[0] == 401
    assert (await admin_call(ctx, "POST", "/flush_cache", headers=[(b"authorization", b"bearer s3cret")]))[0] == 200


@pytest.mark.anyio
async def test_an_aborting_pause_begins_before_the_call_and_a_resume_ends_it():
    router, _ = admin_fleet(ADMIN_OK)
    ctx = FakeAdminContext(router)
    epoch = router.pauses.epoch("sglang")
    assert (await admin_call(ctx, "POST", "/pause_generation", b'{"mode": "retract"}'))[0] == 200
    assert router.pauses.epoch("sglang") == epoch  # not an aborting pause
    assert (await admin_call(ctx, "POST", "/pause_generation", b"{}"))[0] == 200
    assert (router.pauses.epoch("sglang"), router.pauses.paused("sglang")) == (epoch + 1, True)
    assert (await admin_call(ctx, "POST", "/continue_generation"))[0] == 200
    assert (router.pauses.epoch("sglang"), router.pauses.paused("sglang")) == (epoch + 1, False)


@pytest.mark.anyio
async def test_the_siblings_are_told_of_an_aborting_pause_before_the_engines_get_it():
    """``serve --workers N``: the sibling processes begin the pause before
    any engine aborts a stream of theirs, and hear when the fan-out was
    answered; a pause that aborts nothing and a resume are not told (the
    engines hold both)."""
    router, pools = admin_fleet(ADMIN_OK, ADMIN_OK)
    told = []

    async def share(message: dict) -> None:
        told.append((message["open"], message["pause"], [len(p.calls) for p in pools]))

    router.fleet.share = share
    ctx = FakeAdminContext(router)
    assert (await admin_call(ctx, "POST", "/pause_generation", b'{"mode": "retract"}'))[0] == 200
    assert (await admin_call(ctx, "POST", "/pause_generation", b'{"mode": "abort"}'))[0] == 200
    assert (await admin_call(ctx, "POST", "/continue_generation"))[0] == 200
    assert told == [(True, True, [1, 1]), (False, True, [2, 2])]


@pytest.mark.anyio
async def test_info_is_the_first_healthy_sglang_workers_answer_verbatim():
    info = CannedAnswer(200, b'{"model_path": "m", "is_generation": true}')
    router, pools = admin_fleet(None, info)
    status, _, body = await admin_call(FakeAdminContext(router), "GET", "/get_model_info")
    assert (status, body, pools[1].calls) == (200, info.body, [(b"GET", b"/get_model_info", b"")])
    status, _, body = await admin_call(FakeAdminContext(admin_fleet(None)[0]), "GET", "/server_info")
    assert (status, orjson.loads(body)) == (503, {"error": {"message": "no healthy worker for protocol 'sglang'"}})


def test_target_drops_only_the_worker_parameter():
    def request(query: bytes) -> Request:
        return Request({"type": "http", "method": "GET", "path": "/pause", "query_string": query, "headers": []})

    assert target(request(b"mode=abort&worker=w1")) == b"/pause?mode=abort"
    assert target(request(b"worker=w1")) == b"/pause"
    assert target(request(b"mode=keep&clear_cache=")) == b"/pause?mode=keep&clear_cache="
