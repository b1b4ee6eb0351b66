"""Engine versions: read at registration, shown in ``/v1/models``, played by
the simulator, and answered per worker in a fleet of mixed vLLM versions."""

from __future__ import annotations

import httpx
import orjson
import pytest

from asgi_generate.protocols import PROTOCOLS
from asgi_generate.sdk._versions import VLLM_DEFAULT_VERSION, VLLM_VERSIONS, parse_version, vllm_behaviour
from support import start_frontend, start_sim, stats, wait_until, trace_lines

GEN = "/inference/v1/generate"
JSON = {"content-type": "application/json"}
OLD, NEW = VLLM_VERSIONS[0], VLLM_DEFAULT_VERSION


@pytest.mark.parametrize(
    "text, parsed",
    [("0.33.0", (0, 33, 0)), ("v0.18.2", (0, 18, 2)), ("0.34.0rc1+g1a2b", (0, 34, 0)), ("0.11.2.dev5", (0, 11, 2)),
     ("", None), ("dev", None), (None, None), (33, None)],
)
def test_parse_version(text, parsed):
    assert parse_version(text) == parsed


@pytest.mark.parametrize(
    "version, unary_engine_id, refuses_stop_strings, generate_schema, bounds_max_tokens",
    [("0.24.0", False, False, False, False), ("0.25.0", True, False, False, False), ("0.27.0", True, False, False, False),
     ("0.31.0", True, True, False, False), ("0.32.0", True, True, True, False), ("0.33.0", True, True, True, False),
     ("0.34.0.dev3+g1", True, True, True, True), ("1.0", True, True, True, True)],
)
def test_vllm_behaviour_by_version(version, unary_engine_id, refuses_stop_strings, generate_schema, bounds_max_tokens):
    b = vllm_behaviour(version)
    assert (b.version, b.unary_engine_id, b.refuses_stop_strings, b.generate_schema, b.stop_reason,
            b.bounds_max_tokens) == (version, unary_engine_id, refuses_stop_strings, generate_schema, generate_schema,
                                     bounds_max_tokens)


def test_unknown_version_gives_no_behaviour():
    assert vllm_behaviour(None) is None and vllm_behaviour("unknown") is None


def test_version_route_answer_is_read_strictly():
    read = PROTOCOLS["vllm"].read_version
    assert (read({"version": "0.33.0"}), read({"version": 33}), read([1]), read({})) == ("0.33.0", None, None, None)


@pytest.mark.parametrize(
    "version, message",
    [("latest", "not a vLLM version: 'latest'"), ("0.18.1", "the simulator plays vLLM 0.25.0 and later, not 0.18.1")],
)
def test_sim_refuses_a_vllm_version_it_cannot_play(capsys, version, message):
    from asgi_generate.server.cli import main

    assert main(["sim", "--protocol", "vllm", "--engine-version", version, "--port", "0"]) == 2
    assert capsys.readouterr().err == f"asgi-generate sim: {message}\n"


@pytest.fixture(scope="module")
def sims():
    """An older and a newer vLLM simulator, and an SGLang one told its version."""
    procs = [start_sim("vllm", extra=["--engine-version", OLD]), start_sim("vllm", extra=["--engine-version", NEW]),
             start_sim("sglang", extra=["--engine-version", "0.5.6"])]
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fleet(request, sims):
    """One frontend in front of both vLLM versions and the SGLang simulator."""
    old, new, sglang = sims
    proc = start_frontend([f"vllm={old.url}", f"vllm={new.url}", f"sglang={sglang.url}"],
                          worker_class=request.param)
    yield proc
    proc.stop()


@pytest.mark.e2e
def test_each_simulator_reports_the_version_it_plays(sims):
    old, new, sglang = sims
    assert httpx.get(old.url + "/version").json() == {"version": OLD}
    assert httpx.get(new.url + "/version").json() == {"version": NEW}
    assert httpx.get(sglang.url + "/get_server_info").json()["version"] == "0.5.6"


@pytest.mark.e2e
def test_models_shows_each_workers_engine_version(fleet):
    workers = httpx.get(fleet.url + "/v1/models").json()["workers"]
    assert [(w["protocol"], w["engine_version"]) for w in workers] == [
        ("vllm", OLD), ("vllm", NEW), ("sglang", "0.5.6")]


def _served_by(sims, before: list[int]) -> int:
    after = [stats(s)["received"] for s in sims[:2]]
    moved = [i for i in range(2) if after[i] != before[i]]
    assert len(moved) == 1 and after[moved[0]] == before[moved[0]] + 1
    return moved[0]


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True])
def test_mixed_fleet_answers_each_request_as_the_serving_version_does(fleet, sims, stream):
    # Requests alternate between the two vLLM workers (least outstanding,
    # ties round-robin); each answer has the schema of the worker that served it.
    body = {"token_ids": [1, 2, 3, 400], "stream": stream,
            "sampling_params": {"max_tokens": 5, "logprobs": 1, "stop_token_ids": [978]}}
    seen = set()
    for _ in range(4):
        before = [stats(s)["received"] for s in sims[:2]]
        if stream:
            with httpx.stream("POST", fleet.url + GEN, content=orjson.dumps(body), headers=JSON, timeout=30) as r:
                raw = b"".join(r.iter_bytes())
            chunks = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
            choices = [c["choices"][0] for c in chunks]
            last = choices[-1]
        else:
            r = httpx.post(fleet.url + GEN, content=orjson.dumps(body), headers=JSON, timeout=30)
            choices = [last := r.json()["choices"][0]]
        assert r.status_code == 200
        which = _served_by(sims, before)
        seen.add(which)
        entries = [e for c in choices for e in c["logprobs"]["content"]]
        assert last["finish_reason"] == "stop" and len(entries) == 3
        if which == 0:
            assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in entries)
            assert "stop_reason" not in last
        else:
            assert all(set(e) == {"token_id", "logprob", "rank", "top_logprobs"} for e in entries)
            assert last["stop_reason"] == 978
    assert seen == {0, 1}


@pytest.mark.e2e
def test_trace_matched_from_the_newer_version_only(tmp_path, sims):
    # The codec reads stop_reason (the record's matched stop) only from a
    # worker whose reported version sends it.
    old, new, _ = sims
    front = start_frontend([f"vllm={old.url}", f"vllm={new.url}"], extra=["--trace-file", str(tmp_path / "t.jsonl")])
    try:
        body = {"token_ids": [1, 2, 3, 400], "sampling_params": {"max_tokens": 5, "stop_token_ids": [978]}}
        for _ in range(2):
            assert httpx.post(front.url + GEN, content=orjson.dumps(body), headers=JSON, timeout=30).status_code == 200
        def lines():
            found = trace_lines(str(tmp_path / "t.*.jsonl"))
            return found if len(found) >= 2 else None

        records = wait_until(lines)
    finally:
        front.stop()
    by_worker = {}
    for line in records:
        rec = orjson.loads(line)
        by_worker[rec["attempts"][0]["worker_id"]] = rec
    assert set(by_worker) == {"w0", "w1"}
    assert by_worker["w0"]["finish"] == {"finish_reason": "stop", "backend_finish_reason": "stop"}
    assert by_worker["w1"]["finish"] == {"finish_reason": "stop", "backend_finish_reason": "stop", "matched": 978}


@pytest.mark.e2e
@pytest.mark.parametrize("version, shown", [(OLD, False), (NEW, True)])
def test_an_aborted_stream_shows_its_finish_only_from_0_32(version, shown):
    # vLLM before 0.32 skips an output without tokens (the abort's finish is
    # dropped); from 0.32 it sends the finishing output anyway.
    from support import RawClient

    sim = start_sim("vllm", itl_ms=20, extra=["--engine-version", version])
    try:
        client = RawClient(sim.url)
        try:
            body = {"token_ids": [1, 2, 3, 400], "request_id": "ab", "stream": True,
                    "sampling_params": {"max_tokens": 500, "ignore_eos": True}}
            client.send(orjson.dumps(body), path=GEN)
            first = client.events(2)
            assert len(first) == 2
            r = httpx.post(sim.url + "/abort_requests", content=orjson.dumps({"request_ids": ["generate-tokens-ab"]}),
                           headers=JSON, timeout=10)
            assert r.status_code == 200
            rest = first + client.events(10000)
        finally:
            client.close()
    finally:
        sim.stop()
    assert rest[-1] == b"[DONE]"
    last = orjson.loads(rest[-2])["choices"][0]
    if shown:
        assert (last["finish_reason"], last["token_ids"], last["stop_reason"]) == ("abort", [], None)
    else:
        assert last["finish_reason"] is None and len(last["token_ids"]) == 1
