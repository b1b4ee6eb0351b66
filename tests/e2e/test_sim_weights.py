"""The simulator's weight routes (asgi_generate/sim/weights.py): each engine's
request shapes and refusals, a weight version that changes answers
deterministically, the fleet's rank registry, pause modes, the failure hook."""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest

from support import generating, post, sampled, sse, start_sim, stats

pytestmark = pytest.mark.e2e

PROMPT = [11, 12, 13]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return str(tmp_path_factory.mktemp("weights") / "groups.json")


@pytest.fixture(scope="module")
def fleet(registry):
    """An SGLang simulator with tp 2 and a vLLM one with tp 4, sharing a registry."""
    sims = [start_sim("sglang", extra=["--tp-size", "2", "--weights-group-registry", registry]),
            start_sim("vllm", extra=["--tp-size", "4", "--weights-group-registry", registry])]
    yield sims
    for s in sims:
        s.stop()


def _tokens(sim, version_body: dict | None = None) -> list[int]:
    if sim.name.endswith("vllm"):
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "ignore_eos": True}}
        return post(sim.url, body, "/inference/v1/generate").json()["choices"][0]["token_ids"]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    return post(sim.url, body).json()["output_ids"]


def test_sglang_group_update_and_version(fleet, registry):
    sg = fleet[0]
    assert httpx.get(sg.url + "/get_server_info").json()["tp_size"] == 2
    assert _tokens(sg) == sampled(PROMPT, 0, 6, True)
    r = post(sg.url, {"master_address": "127.0.0.1", "master_port": 1}, "/init_weights_update_group")
    # SGLang answers a validation error 400 (its RequestValidationError handler), naming each missing field.
    assert (r.status_code, r.json()["type"]) == (400, "Bad Request")
    assert r.json()["message"].startswith("3 validation errors:\n")
    assert all(f"'loc': ('body', 'function-after[build_struct(), InitWeightsUpdateGroupReqInput]', '{f}'), "
               "'msg': 'Field required'" in r.json()["message"] for f in ("rank_offset", "world_size"))
    group = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 7}
    r = post(sg.url, {**group, "rank_offset": 6}, "/init_weights_update_group")
    assert r.status_code == 400 and "not within world_size 7" in r.json()["message"]
    r = post(sg.url, {**group, "rank_offset": 1}, "/init_weights_update_group")
    assert r.status_code == 200 and r.json()["success"] is True
    r = post(sg.url, {**group, "rank_offset": 3}, "/init_weights_update_group")
    assert r.status_code == 400 and "already initialized" in r.json()["message"]
    groups = orjson.loads(open(registry, "rb").read())
    assert [(m["rank_offset"], m["ranks"]) for m in groups["127.0.0.1:29500/weight_update_group"]] == [(1, 2)]
    update = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 2]], "weight_version": "v1"}
    r = post(sg.url, {**update, "group_name": "other"}, "/update_weights_from_distributed")
    assert r.status_code == 400 and "not initialized" in r.json()["message"]
    r = post(sg.url, {**update, "dtypes": []}, "/update_weights_from_distributed")
    assert r.status_code == 400
    assert post(sg.url, update, "/update_weights_from_distributed").status_code == 200
    assert httpx.get(sg.url + "/get_model_info").json()["weight_version"] == "v1"
    assert _tokens(sg) == sampled(PROMPT, 0, 6, True, version="v1") != sampled(PROMPT, 0, 6, True)
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    assert post(sg.url, body).json()["meta_info"]["weight_version"] == "v1"
    r = post(sg.url, {"new_version": "v2"}, "/update_weight_version")
    assert r.json() == {"success": True, "message": "Weight version updated to v2", "new_version": "v2"}
    assert _tokens(sg) == sampled(PROMPT, 0, 6, True, version="v2")
    assert post(sg.url, {"serialized_named_tensors": ["AA=="]}, "/update_weights_from_tensor").status_code == 200
    assert post(sg.url, {}, "/update_weights_from_ipc").status_code == 400
    assert post(sg.url, {}, "/end_weight_update").status_code == 400
    assert post(sg.url, {}, "/begin_weight_update").status_code == 200
    assert post(sg.url, {}, "/end_weight_update").status_code == 200
    w = post(sg.url, {"name": "lm_head.weight"}, "/get_weights_by_name").json()
    assert isinstance(w, list) and w == post(sg.url, {"name": "lm_head.weight"}, "/get_weights_by_name").json()
    assert post(sg.url, {}, "/weights_checker").json()["success"] is True
    assert post(sg.url, {}, "/destroy_weights_update_group").status_code == 200
    assert post(sg.url, {}, "/destroy_weights_update_group").status_code == 400
    assert "127.0.0.1:29500/weight_update_group" not in orjson.loads(open(registry, "rb").read())


def test_registry_refuses_overlapping_ranks_across_engines(fleet, registry):
    sg, vl = fleet
    group = {"master_address": "127.0.0.1", "master_port": 29600, "world_size": 7}
    assert post(sg.url, {**group, "rank_offset": 1}, "/init_weights_update_group").status_code == 200
    info = {"master_address": "127.0.0.1", "master_port": 29600, "rank_offset": 4, "world_size": 7}
    r = post(vl.url, {"init_info": info}, "/init_weight_transfer_engine")
    assert r.status_code == 500  # ranks 4..7 leave the world of 7
    assert post(vl.url, {"init_info": {**info, "rank_offset": 3}}, "/init_weight_transfer_engine").status_code == 200
    post(vl.url, {}, "/shutdown_weight_transfer_engine")
    other = start_sim("sglang", extra=["--tp-size", "2", "--weights-group-registry", registry])
    try:
        r = post(other.url, {**group, "rank_offset": 2}, "/init_weights_update_group")
        assert r.status_code == 400 and "overlap ranks 1..2" in r.json()["message"]
        r = post(other.url, {**group, "world_size": 9, "rank_offset": 3}, "/init_weights_update_group")
        assert r.status_code == 400 and "world_size 9 differs" in r.json()["message"]
        assert post(other.url, {**group, "rank_offset": 3}, "/init_weights_update_group").status_code == 200
        members = orjson.loads(open(registry, "rb").read())["127.0.0.1:29600/weight_update_group"]
        assert sorted((m["rank_offset"], m["ranks"]) for m in members) == [(1, 2), (3, 2)]
    finally:
        other.stop()
    post(sg.url, {}, "/destroy_weights_update_group")


def test_vllm_weight_routes(fleet):
    vl = fleet[1]
    assert httpx.get(vl.url + "/get_world_size").json() == {"world_size": 4}
    assert httpx.get(vl.url + "/weight_info").json() == {"weight_version": "default"}
    # vLLM's validation handler answers a missing body field 400, as for /generate.
    r = post(vl.url, {}, "/init_weight_transfer_engine")
    assert (r.status_code, r.json()["error"]["param"]) == (400, "body.init_info")
    assert post(vl.url, {"update_info": {}}, "/update_weights").status_code == 500  # no transfer engine
    info = {"master_address": "127.0.0.1", "master_port": 29700, "rank_offset": 1, "world_size": 5}
    assert post(vl.url, {"init_info": info}, "/init_weight_transfer_engine").json() == {
        "message": "Weight transfer initialized"}
    assert post(vl.url, {}, "/start_weight_update").json() == {"message": "Weight update started"}
    assert post(vl.url, {"update_info": {"names": ["w"]}}, "/update_weights").json() == {"message": "Weights updated"}
    assert post(vl.url, {"weight_version": "v1"}, "/finish_weight_update").status_code == 200
    assert httpx.get(vl.url + "/weight_info").json() == {"weight_version": "v1"}
    assert _tokens(vl) == sampled(PROMPT, 0, 6, True, version="v1")
    assert post(vl.url, {"new_version": "v2"}, "/update_weight_version").json() == {"success": True,
                                                                                  "new_version": "v2"}
    base = post(vl.url, {"action": "checksum"}, "/weight_checker").json()["checksums"]
    assert post(vl.url, {"action": "compare", "baseline": base}, "/weight_checker").json()["match"] is True
    assert post(vl.url, {"action": "nope"}, "/weight_checker").status_code == 400
    # The failure hook: the next load fails, then loads work again.
    assert post(vl.url, {"weight_updates": 1}, "/sim/faults").status_code == 200
    assert post(vl.url, {"update_info": {}}, "/update_weights").status_code == 500
    assert post(vl.url, {"update_info": {}}, "/update_weights").status_code == 200
    assert stats(vl)["weights"]["failed_updates"] == 1
    post(vl.url, {}, "/shutdown_weight_transfer_engine")


def test_sglang_failure_hook(fleet):
    sg = fleet[0]
    assert post(sg.url, {"weight_updates": 1}, "/sim/faults").status_code == 200
    r = post(sg.url, {"model_path": "/ckpt", "weight_version": "bad"}, "/update_weights_from_disk")
    assert r.status_code == 400 and r.json()["success"] is False
    assert httpx.get(sg.url + "/get_model_info").json()["weight_version"] != "bad"


@pytest.mark.parametrize("mode,refused", [("abort", True), ("wait", True), ("keep", False)])
def test_vllm_pause_modes_refuse_or_queue_new_requests(fleet, mode, refused):
    vl = fleet[1]
    assert post(vl.url, {}, f"/pause?mode={mode}").json() == {"status": "paused"}
    try:
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
        if refused:
            assert post(vl.url, body, "/inference/v1/generate").status_code == 503
        else:
            with pytest.raises(httpx.ReadTimeout):  # queued until /resume
                post(vl.url, body, "/inference/v1/generate", timeout=0.3)
    finally:
        assert post(vl.url, {}, "/resume").json() == {"status": "resumed"}
    assert post(vl.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}},
                "/inference/v1/generate").status_code == 200


def test_new_weights_apply_mid_stream():
    """A stream held by an in-place pause continues on the weights loaded meanwhile."""
    sg = start_sim("sglang", itl_ms=20)
    try:
        out: list = []
        body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
        t = threading.Thread(target=lambda: out.append(sse(sg.url, body)))
        t.start()
        generating(sg)
        post(sg.url, {"mode": "in_place"}, "/pause_generation")
        post(sg.url, {"new_version": "v9", "abort_all_requests": False}, "/update_weight_version")
        post(sg.url, {}, "/continue_generation")
        t.join(10)
        chunks = [orjson.loads(c) for c in out[0][1] if c != b"[DONE]"]
        ids = chunks[-1]["output_ids"]
        assert chunks[-1]["meta_info"]["weight_version"] == "v9"
        k = next(i for i in range(len(ids) + 1) if ids[:i] != sampled(PROMPT, 0, i, True)[:i]) - 1 \
            if ids != sampled(PROMPT, 0, 30, True) else len(ids)
        assert 0 < k < 30
        assert ids[k:] == sampled(PROMPT + ids[:k], 0, 30 - k, True, version="v9")
    finally:
        sg.stop()


def test_vllm_reports_the_weight_versions_of_each_token_on_the_finished_choice():
    """vLLM 0.33 (``output_processor.py`` ``_weight_version_spans``): the
    finished choice carries ``weight_versions`` spans over its output
    tokens, split where the weights changed mid-stream; a unary answer's
    one span covers it."""
    vl = start_sim("vllm", itl_ms=20)
    try:
        out: list = []
        body = {"token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": 30, "ignore_eos": True}}
        t = threading.Thread(target=lambda: out.append(sse(vl.url, body, "/inference/v1/generate")))
        t.start()
        generating(vl, tokens=2)
        assert post(vl.url, b"", "/pause?mode=keep").status_code == 200
        assert post(vl.url, {"new_version": "v9"}, "/update_weight_version").status_code == 200
        assert post(vl.url, b"", "/resume").status_code == 200
        t.join(10)
        choices = [ch for c in out[0][1] if c != b"[DONE]" for ch in orjson.loads(c)["choices"]]
        ids = [i for ch in choices for i in ch["token_ids"]]
        assert [ch["weight_versions"] for ch in choices[:-1]] == [None] * (len(choices) - 1)
        first, second = choices[-1]["weight_versions"]
        k = first["end"]
        assert (first, second) == ({"version": "default", "start": 0, "end": k}, {"version": "v9", "start": k, "end": 30})
        assert ids[:k] == sampled(PROMPT, 0, k, True)
        assert ids[k:] == sampled(PROMPT + ids[:k], 0, 30 - k, True, version="v9")
        unary = post(vl.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "ignore_eos": True}},
                     "/inference/v1/generate").json()["choices"][0]
        assert unary["weight_versions"] == [{"version": "v9", "start": 0, "end": 6}]
    finally:
        vl.stop()
