"""Weight routes (asgi_generate/ops/weights.py): the fleet's rank arithmetic,
vLLM's world size summed, a named worker, and the fleet transaction (200
only when every worker succeeded, else 502 with each worker's result)."""

from __future__ import annotations

import httpx
import orjson
import pytest

from support import post, start_frontend, start_sim, stats

pytestmark = pytest.mark.e2e

SKIPPED = "asgi-generate-skipped-workers"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return str(tmp_path_factory.mktemp("weights") / "groups.json")


@pytest.fixture(scope="module")
def fleet(registry):
    """SGLang simulators with tp 1 and 2, vLLM ones with tp 2 and 4."""
    shared = ["--weights-group-registry", registry]
    sims = [start_sim("sglang", extra=["--tp-size", "1", *shared]), start_sim("sglang", extra=["--tp-size", "2", *shared]),
            start_sim("vllm", extra=["--tp-size", "2", *shared]), start_sim("vllm", extra=["--tp-size", "4", *shared])]
    yield sims
    for s in sims:
        s.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def frontend(request, fleet):
    fe = start_frontend([f"sglang={s.url}" for s in fleet[:2]] + [f"vllm={s.url}" for s in fleet[2:]],
                        worker_class=request.param, extra=["--weight-update-timeout", "5"])
    yield fe
    fe.stop()


def _groups(sim) -> dict:
    return stats(sim)["weights"]["groups"]


def test_sglang_group_ranks_follow_each_workers_tp(frontend, fleet, registry):
    group = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "group_name": "g"}
    r = post(frontend.url, {**group, "world_size": 3}, "/init_weights_update_group")
    assert r.status_code == 400 and "is 4" in r.json()["error"]["message"]
    r = post(frontend.url, group, "/init_weights_update_group")
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["success"] is True and answer["world_size"] == 4
    assert answer["assignment"] == [{"worker": "w0", "rank_offset": 1, "ranks": 1},
                                    {"worker": "w1", "rank_offset": 2, "ranks": 2}]
    assert [(_groups(s)["g"]["rank_offset"], _groups(s)["g"]["world_size"]) for s in fleet[:2]] == [(1, 4), (2, 4)]
    members = orjson.loads(open(registry, "rb").read())["127.0.0.1:29500/g"]
    assert sorted((m["rank_offset"], m["ranks"]) for m in members) == [(1, 1), (2, 2)]
    update = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[4]], "group_name": "g", "weight_version": "s1"}
    assert post(frontend.url, update, "/update_weights_from_distributed").status_code == 200
    assert [httpx.get(s.url + "/get_model_info").json()["weight_version"] for s in fleet[:2]] == ["s1", "s1"]
    assert post(frontend.url, {"group_name": "g"}, "/destroy_weights_update_group").status_code == 200
    assert all("g" not in _groups(s) for s in fleet[:2])


def test_vllm_world_size_summed_and_transfer_engine_ranks(frontend, fleet):
    assert httpx.get(frontend.url + "/get_world_size").json() == {"world_size": 6}
    assert httpx.get(frontend.url + "/get_world_size?protocol=sglang").json() == {"world_size": 3}
    info = {"master_address": "127.0.0.1", "master_port": 29501, "rank_offset": 1, "world_size": 7}
    r = post(frontend.url, {"init_info": info}, "/init_weight_transfer_engine")
    assert r.status_code == 200, r.text
    assert [a["rank_offset"] for a in r.json()["assignment"]] == [1, 3]
    assert [_groups(s)["vllm"]["rank_offset"] for s in fleet[2:]] == [1, 3]
    for path, body in (("/start_weight_update", {}), ("/update_weights", {"update_info": {"names": ["w"]}}),
                       ("/finish_weight_update", {"weight_version": "v1"})):
        assert post(frontend.url, body, path).status_code == 200, path
    assert httpx.get(frontend.url + "/weight_info").json() == {"weight_version": "v1"}
    assert post(frontend.url, {}, "/shutdown_weight_transfer_engine").status_code == 200


def test_a_failed_load_is_502_naming_the_worker(frontend, fleet):
    info = {"master_address": "127.0.0.1", "master_port": 29502, "rank_offset": 1}
    assert post(frontend.url, {"init_info": info}, "/init_weight_transfer_engine").status_code == 200
    try:
        assert post(fleet[3].url, {"weight_updates": 1}, "/sim/faults").status_code == 200
        r = post(frontend.url, {"update_info": {}}, "/update_weights")
        assert r.status_code == 502
        assert [(x["worker"], x["status"]) for x in r.json()] == [("w2", 200), ("w3", 500)]
    finally:
        post(frontend.url, {}, "/shutdown_weight_transfer_engine")
    assert post(fleet[0].url, {"weight_updates": 1}, "/sim/faults").status_code == 200
    r = post(frontend.url, {"model_path": "/ckpt", "weight_version": "bad"}, "/update_weights_from_disk")
    assert r.status_code == 502
    assert [(x["worker"], x["status"], x["body"]["success"]) for x in r.json()] == [("w0", 400, False),
                                                                                    ("w1", 200, True)]


def test_one_named_worker(frontend, fleet):
    before = [stats(s)["admin_calls"].get("/update_weights_from_tensor", 0) for s in fleet[:2]]
    body = {"serialized_named_tensors": ["AA=="]}
    assert post(frontend.url, body, "/update_weights_from_tensor?worker=w1").status_code == 200
    assert post(frontend.url, body, "/update_weights_from_tensor", headers={"asgi-generate-worker": "w1"}
                ).status_code == 200
    after = [stats(s)["admin_calls"].get("/update_weights_from_tensor", 0) for s in fleet[:2]]
    assert [a - b for a, b in zip(after, before)] == [0, 2]
    assert post(frontend.url, body, "/update_weights_from_tensor?worker=w2").status_code == 404  # a vLLM worker
    r = post(frontend.url, {"new_version": "both"}, "/update_weight_version")
    assert r.status_code == 200
    assert [httpx.get(s.url + "/get_model_info").json()["weight_version"] for s in fleet[:2]] == ["both"] * 2
    assert [httpx.get(s.url + "/weight_info").json()["weight_version"] for s in fleet[2:]] == ["both"] * 2
