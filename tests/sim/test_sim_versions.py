"""The simulator's record of vLLM versions (sim/versions.py) and the
codec's (sdk/versions.py) agree on every fact both keep: the versions the
simulator plays, how version strings read, and each shared behaviour at
every release the record names and the one before it. A fact changed on one
side only fails here."""

from __future__ import annotations

import dataclasses

import pytest

from asgi_generate.sdk import versions as codec
from asgi_generate.sim import versions as sim

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
