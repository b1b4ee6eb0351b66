"""The simulator's record of vLLM versions (sim/versions.py) and the
codec's (sdk/_versions.py) agree on every fact both keep: the versions the
simulator plays, how version strings read, and each shared behaviour at
every release the record names and the one before it. A fact changed on one
side only fails here."""

from __future__ import annotations

import dataclasses

import anyio
import orjson
import pytest

from asgi_generate.sdk import _versions as codec
from asgi_generate.sim import versions as sim
from asgi_generate.sim.app import SimApp
from support import asgi_json, asgi_request

SHARED = sorted({f.name for f in dataclasses.fields(sim.VLLMPlayed)}
                & {f.name for f in dataclasses.fields(codec.VLLMBehaviour)} - {"version"})


def _around_each_change() -> list[str]:
    """Each release a change names, the release before it, the played
    versions and a development build past the newest."""
    out = set(sim.VLLM_VERSIONS) | {"0.25.0", "1.0", "0.34.0.dev3+g1"}
    for change in sim.VLLM_CHANGES:
        major, minor = change.since[:2]
        out |= {f"{major}.{minor}.0", f"{major}.{minor - 1}.9"}
    return sorted(v for v in out if sim.parse_version(v) >= sim.VLLM_OLDEST_PLAYED)


def test_the_shared_facts_are_the_behaviours_the_simulator_plays():
    # Every behaviour the codec's table keeps is one the simulator records.
    assert SHARED == sorted({f.name for f in dataclasses.fields(codec.VLLMBehaviour)} - {"version"})
    assert {c.name for c in sim.VLLM_CHANGES} == {f.name for f in dataclasses.fields(sim.VLLMPlayed)} - {"version"}


@pytest.mark.parametrize("version", _around_each_change())
def test_both_tables_agree_at_each_release(version):
    played, read = sim.vllm_played(version), codec.vllm_behaviour(version)
    assert {n: getattr(played, n) for n in SHARED} == {n: getattr(read, n) for n in SHARED}


def test_same_versions_played_and_read_alike():
    assert (sim.VLLM_VERSIONS, sim.VLLM_DEFAULT_VERSION, sim.VLLM_OLDEST_PLAYED) == (
        codec.VLLM_VERSIONS, codec.VLLM_DEFAULT_VERSION, codec.VLLM_OLDEST_PLAYED)
    for text in ("0.33.0", "v0.18.2", "0.34.0rc1+g1a2b", "0.11.2.dev5", " 0.30.1 ", "", "dev", None, 33):
        assert sim.parse_version(text) == codec.parse_version(text)


def test_changes_in_release_order_each_citing_its_source():
    assert [c.since for c in sim.VLLM_CHANGES] == sorted(c.since for c in sim.VLLM_CHANGES)
    assert all(c.source and len(c.since) == 3 for c in sim.VLLM_CHANGES)


@pytest.mark.parametrize("version, message", [
    ("latest", "not a vLLM version: 'latest'"), ("0.24.9", "the simulator plays vLLM 0.25.0 and later, not 0.24.9")])
def test_versions_it_cannot_play(version, message):
    with pytest.raises(ValueError) as err:
        sim.vllm_played(version)
    assert str(err.value) == message


def _status(app, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    async def run():
        status, _, raw = await asgi_request(app, method, path, orjson.dumps(body) if body is not None else b"")
        return status, raw
    return anyio.run(run)


@pytest.mark.parametrize("version, served", [("0.30.0", False), ("0.31.0", True), ("0.33.0", True)])
def test_kv_event_sources_served_from_0_31(version, served):
    # vllm/entrypoints/serve/instrumentator/basic.py has the route from 0.31.0 on.
    status, raw = _status(SimApp("vllm", engine_version=version), "GET", "/kv_event_sources")
    assert (status, raw) == ((200, b"{}") if served else (404, b'{"detail":"Not Found"}'))


@pytest.mark.parametrize("version, relayed", [("0.30.0", False), ("0.31.0", True)])
def test_a_consumer_reports_its_producers_hit_from_0_31(version, relayed):
    # v1/engine/output_processor.py RequestState.from_new_request: from 0.31 a
    # consumer given remote_prefill_cached_tokens reports it as cached_tokens,
    # whether it read the KV or not (in process it cannot reach the producer's
    # side channel, so it prefills the prompt itself: before 0.31, from its
    # own empty cache).
    prompt = list(range(100, 140))
    producer = SimApp("vllm", engine_version=version, kv_role="producer", enable_prompt_tokens_details=True)
    consumer = SimApp("vllm", engine_version=version, kv_role="consumer", enable_prompt_tokens_details=True)

    async def run() -> tuple[int, int]:
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1},
                "kv_transfer_params": {"do_remote_decode": True}}
        await asgi_json(producer, "POST", "/inference/v1/generate", body)  # caches the prompt's 2 blocks
        first = await asgi_json(producer, "POST", "/inference/v1/generate", body)
        params = first["kv_transfer_params"]
        second = await asgi_json(consumer, "POST", "/inference/v1/generate",
                                 {"token_ids": prompt, "sampling_params": {"max_tokens": 2}, "kv_transfer_params": params})
        return params.get("remote_prefill_cached_tokens"), second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert anyio.run(run) == ((32, 32) if relayed else (None, 0))
