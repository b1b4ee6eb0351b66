"""The version fence (asgi_generate/workers/router.py, ops/weights.py): each
worker's weight version tracked and shown; after a fleet update new requests
reach only workers at the fleet's version; a worker that failed its update is
fenced until it reaches the version or an operator clears it; a minimum
version header; each attempt's weight version in the record."""

from __future__ import annotations

import httpx
import pytest

from support import post, start_frontend, start_sim, stats, trace_records, wait_until

pytestmark = pytest.mark.e2e

BODY = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3}}
MIN = "asgi-generate-min-weight-version"


@pytest.fixture(params=["trio", "asyncio"])
def fenced(request, tmp_path):
    sims = [start_sim() for _ in range(3)]
    base = str(tmp_path / "t")
    fe = start_frontend([f"sglang={s.url}" for s in sims], worker_class=request.param,
                        extra=["--trace-file", base + ".jsonl"])
    yield sims, fe, base
    fe.stop()
    for s in sims:
        s.stop()


def _workers(fe) -> dict:
    return httpx.get(fe.url + "/stats").json()["workers"]


def _received(sims) -> list[int]:
    return [stats(s)["received"] for s in sims]


def test_a_failed_update_fences_its_worker_until_it_reaches_the_version(fenced):
    sims, fe, base = fenced
    models = httpx.get(fe.url + "/v1/models").json()["workers"]
    assert [w["weight_version"] for w in models] == ["default"] * 3
    post(sims[2].url, {"weight_updates": 1}, "/sim/faults")
    r = post(fe.url, {"model_path": "/ckpt/1", "weight_version": "v1"}, "/update_weights_from_disk")
    assert r.status_code == 502
    assert [(x["worker"], x["status"]) for x in r.json()] == [("w0", 200), ("w1", 200), ("w2", 400)]
    workers = _workers(fe)
    assert [workers[w]["weight_version"] for w in ("w0", "w1", "w2")] == ["v1", "v1", "default"]
    assert workers["w2"]["fence"].startswith("failed /update_weights_from_disk: 400")
    assert [workers[w]["in_rotation"] for w in ("w0", "w1", "w2")] == [True, True, False]
    assert httpx.get(fe.url + "/stats").json()["fleet_weight_versions"] == {"sglang": "v1"}
    metrics = httpx.get(fe.url + "/metrics").text
    assert f'asgi_generate_worker_fenced{{protocol="sglang",role="aggregated",url="{sims[2].url}",worker="w2"}} 1.0' \
        in metrics
    assert 'weight_version="v1"' in metrics
    before = _received(sims)
    for _ in range(6):
        r = post(fe.url, BODY)
        assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "v1"
    after = _received(sims)
    assert after[2] == before[2] and after[0] > before[0] and after[1] > before[1]
    # A minimum version no worker has: 503 with the reason.
    r = post(fe.url, BODY, headers={MIN: "v2"})
    assert r.status_code == 503
    assert "at weight version 'v2' or later" in r.text, r.text
    assert post(fe.url, BODY, headers={MIN: "v1"}).status_code == 200
    # The fleet relabelled without w2 loading anything: still fenced.
    assert post(fe.url, {"new_version": "v1", "abort_all_requests": False}, "/update_weight_version").status_code == 200
    assert _workers(fe)["w2"]["fence"] is not None
    # A retry named to it loads the version: back in the rotation.
    r = post(fe.url, {"model_path": "/ckpt/1", "weight_version": "v1"}, "/update_weights_from_disk?worker=w2")
    assert r.status_code == 200
    assert _workers(fe)["w2"]["in_rotation"] is True
    wait_until(lambda: len(trace_records(base + ".*.jsonl")) >= 7)
    versions = {a.get("weight_version") for rec in trace_records(base + ".*.jsonl") for a in rec["attempts"]}
    assert versions == {"v1"}


def test_an_operator_clears_a_fence(fenced):
    sims, fe, _ = fenced
    post(sims[0].url, {"weight_updates": 1}, "/sim/faults")
    r = post(fe.url, {"model_path": "/ckpt/2", "weight_version": "v2"}, "/update_weights_from_disk")
    assert r.status_code == 502
    assert _workers(fe)["w0"]["in_rotation"] is False
    # Fixed by hand, outside the frontend:
    assert post(sims[0].url, {"model_path": "/ckpt/2", "weight_version": "v2"}, "/update_weights_from_disk"
                ).status_code == 200
    r = post(fe.url, {}, "/clear_weight_fence?worker=w0")
    assert r.json() == {"worker": "w0", "weight_version": "v2", "in_rotation": True}
    assert post(fe.url, {}, "/clear_weight_fence?worker=w9").status_code == 404


def test_engines_at_their_initial_version_meet_no_numeric_floor(fenced):
    """A fresh or restarted engine reports ``default``: below any version a
    trainer sets, so a numeric floor gets 503 with the reason."""
    sims, fe, _ = fenced
    seen = "(w0: default, w1: default, w2: default)"
    for floor in ("1", "8", "1.2.3", "99999999999999999999999999", "v1", "defaulu", "default.1"):
        r = post(fe.url, BODY, headers={MIN: floor})
        assert r.status_code == 503, floor
        assert r.json()["message"] == (f"no healthy worker for protocol 'sglang' at weight version {floor!r} "
                                       f"or later {seen}")
    assert post(fe.url, BODY, headers={MIN: "default"}).status_code == 200
    assert post(fe.url, {"new_version": "8", "abort_all_requests": False}, "/update_weight_version").status_code == 200
    assert post(fe.url, BODY, headers={MIN: "8"}).status_code == 200
    assert post(fe.url, BODY, headers={MIN: "9"}).status_code == 503
