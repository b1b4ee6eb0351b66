"""The weight routes (asgi_generate/ops/weights.py) in process, over fake
workers (tests/fakes.py's CallPool): the rank arithmetic of a group's
set-up, the fleet's world size, and the version fence a failed load sets."""

from __future__ import annotations

import orjson
import pytest

from fakes import ADMIN_OK, CannedAnswer, FakeAdminContext, admin_call, admin_fleet


@pytest.fixture
def anyio_backend():
    return "asyncio"


def engine(size_field: str, size: int, init: CannedAnswer = ADMIN_OK):
    """A worker whose info answer gives its parallel size ``size``."""
    def answer(method, target, body):
        if target in (b"/get_server_info", b"/get_world_size"):
            return CannedAnswer(200, orjson.dumps({size_field: size}))
        return init
    return answer


@pytest.mark.anyio
async def test_each_sglang_worker_gets_the_ranks_after_the_previous_workers():
    router, pools = admin_fleet(engine("tp_size", 1), engine("tp_size", 2), engine("tp_size", 4))
    body = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "group_name": "g"}
    status, _, answer = await admin_call(FakeAdminContext(router), "POST", "/init_weights_update_group", orjson.dumps(body))
    assert status == 200
    assert orjson.loads(answer) == {"success": True, "world_size": 8, "assignment": [
        {"worker": "w0", "rank_offset": 1, "ranks": 1},
        {"worker": "w1", "rank_offset": 2, "ranks": 2},
        {"worker": "w2", "rank_offset": 4, "ranks": 4}]}
    sent = [orjson.loads(p.calls[-1][2]) for p in pools]
    assert [(s["rank_offset"], s["world_size"], s["group_name"]) for s in sent] == [(1, 8, "g"), (2, 8, "g"),
                                                                                    (4, 8, "g")]


@pytest.mark.anyio
async def test_a_vllm_group_gets_its_ranks_inside_init_info_and_a_wrong_world_size_is_refused():
    router, pools = admin_fleet(engine("world_size", 2), engine("world_size", 2), protocol="vllm")
    info = {"master_address": "127.0.0.1", "master_port": 29511, "rank_offset": 1, "world_size": 5}
    status, _, _ = await admin_call(FakeAdminContext(router), "POST", "/init_weight_transfer_engine",
                              orjson.dumps({"init_info": info}))
    assert status == 200
    assert [orjson.loads(p.calls[-1][2])["init_info"]["rank_offset"] for p in pools] == [1, 3]
    status, _, answer = await admin_call(FakeAdminContext(router), "POST", "/init_weight_transfer_engine",
                                   orjson.dumps({"init_info": {**info, "world_size": 4}}))
    assert (status, orjson.loads(answer)) == (400, {"error": {"message": (
        "world_size 4 is not the group's: rank_offset 1 plus the workers' parallel sizes (w0: 2, w1: 2) is 5")}})


@pytest.mark.anyio
async def test_the_world_size_is_the_fleets_sum_and_a_bad_offset_is_refused():
    router, _ = admin_fleet(engine("world_size", 2), engine("world_size", 4), protocol="vllm")
    status, _, answer = await admin_call(FakeAdminContext(router), "GET", "/get_world_size")
    assert (status, orjson.loads(answer)) == (200, {"world_size": 6})
    status, _, answer = await admin_call(FakeAdminContext(router), "POST", "/init_weight_transfer_engine",
                                   orjson.dumps({"init_info": {"rank_offset": -1}}))
    assert (status, orjson.loads(answer)) == (400, {"error": {"message": (
        "'rank_offset' (the first engine rank: the trainer's ranks are below it) must be an integer >= 0")}})


@pytest.mark.anyio
async def test_a_worker_that_fails_a_load_is_fenced_out_of_the_rotation():
    router, _ = admin_fleet(ADMIN_OK, CannedAnswer(400, b'{"success": false, "message": "bad tensor"}'))
    body = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[8]], "weight_version": "v2"}
    status, _, answer = await admin_call(FakeAdminContext(router), "POST", "/update_weights_from_distributed", orjson.dumps(body))
    assert status == 502
    assert [(r["worker"], r["status"]) for r in orjson.loads(answer)] == [("w0", 200), ("w1", 400)]
    assert (router.routable(router.workers[0]), router.routable(router.workers[1])) == (True, False)
    assert router.workers[1].fence is not None


@pytest.mark.anyio
async def test_a_bad_body_every_worker_refuses_fences_none():
    """A malformed weight call is refused by every engine with 400: no
    weights changed anywhere, so the rotation stays whole."""
    refused = CannedAnswer(400, b'{"error": {"message": "the body is not a JSON object"}}')
    router, _ = admin_fleet(refused, refused)
    status, _, answer = await admin_call(FakeAdminContext(router), "POST", "/update_weights_from_disk", b"{bad")
    assert status == 502
    assert [(r["worker"], r["status"]) for r in orjson.loads(answer)] == [("w0", 400), ("w1", 400)]
    assert [(router.routable(w), w.fence) for w in router.workers] == [(True, None), (True, None)]


@pytest.mark.anyio
async def test_a_fenced_worker_named_in_a_load_that_succeeds_is_back_with_no_fleet_version_set():
    """The retry docs/admin.md gives (``?worker=wN``): before any fleet call
    set a version, a fenced worker that loads again is back."""
    router, _ = admin_fleet(ADMIN_OK, ADMIN_OK)
    router.workers[1].fence = "failed /update_weights_from_disk: 400"
    status, _, _ = await admin_call(FakeAdminContext(router), "POST", "/update_weights_from_disk", orjson.dumps({"model_path": "/m"}),
                              query=b"worker=w1")
    assert status == 200
    assert [(router.routable(w), w.fence) for w in router.workers] == [(True, None), (True, None)]


@pytest.mark.anyio
@pytest.mark.parametrize("path,body,aborts", [
    ("/update_weight_version", b'{"new_version": "7"}', True),  # abort_all_requests defaults to true
    ("/update_weight_version", b'{"new_version": "7", "abort_all_requests": false}', False),
    ("/update_weights_from_disk", b'{"model_path": "/m"}', False),  # defaults to false
    ("/update_weights_from_disk", b'{"model_path": "/m", "abort_all_requests": true}', True),
    ("/update_weights_from_tensor", b'{"serialized_named_tensors": [], "abort_all_requests": true}', True),
    ("/update_weights_from_ipc", b'{"zmq_handles": {}, "abort_all_requests": true}', False),  # no such field
])
async def test_a_weight_call_that_aborts_is_a_fleet_transaction_while_it_runs(path, body, aborts):
    seen = []

    def answer(method, target, sent):
        seen.append(router.pauses.paused("sglang"))  # while the engine has the call
        return ADMIN_OK

    router, _ = admin_fleet(answer, answer)
    ctx = FakeAdminContext(router)
    epoch = router.pauses.epoch("sglang")
    assert (await admin_call(ctx, "POST", path, body))[0] == 200
    assert (seen, router.pauses.epoch("sglang"), router.pauses.paused("sglang")) == \
        ([aborts, aborts], epoch + aborts, False)
