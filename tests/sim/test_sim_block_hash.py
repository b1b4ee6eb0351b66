"""The simulator's block hashes are the engines' own: known answers computed
by the engines' released code (vLLM 0.33.0's ``vllm/utils/hashing.py``
``sha256`` chained as ``kv_cache_utils.hash_block_tokens`` chains it, and
SGLang 0.5.23's ``mem_cache/cpp_utils/hash_binding.cpp`` built and called
as ``get_native_hash``), so a change of the simulator's hashing that the
engines did not make shows here."""

from __future__ import annotations

import pytest

from asgi_generate.sim.block_hash import EMPTY, SGLangPageHashes, VLLMBlockHashes, block_hasher

IDS = list(range(100, 132))


def test_vllm_sha256_chain_and_salt_in_the_first_block(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    v = VLLMBlockHashes()
    assert v.keys(IDS, 16, (None,)) == [15126711022707342677, 3356471519746799895]
    assert v.keys(IDS, 16, ("s",)) == [6765879563850017867, 15522025195317776736]
    assert v.keys(IDS[:31], 16, ()) == [15126711022707342677]  # full blocks only
    assert v.published(15126711022707342677) == 15126711022707342677


def test_vllm_seed_is_pythonhashseed_when_set(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert VLLMBlockHashes().keys(IDS, 16, ())[0] == 11861665817516400925


def test_sglang_page_chain_salt_and_extra_key():
    s = SGLangPageHashes()
    assert s.keys(IDS[:4], 2, (None, None)) == [2295188235906049820, -2323196654361190328]
    assert s.keys(IDS[:4], 2, (None, "s")) == [-4066461984346787511, -2449131337419677984]
    # An extra_key (no LoRA adapter) publishes the plain hashes; the cache keeps it apart.
    keys = s.keys(IDS[:4], 2, ("k", None))
    assert keys == [("k", 2295188235906049820), ("k", -2323196654361190328)]
    assert [s.published(k) for k in keys] == [2295188235906049820, -2323196654361190328]
    assert s.keys(IDS[:5], 2, ()) == s.keys(IDS[:4], 2, ())


@pytest.mark.parametrize("protocol, kind", [("vllm", VLLMBlockHashes), ("sglang", SGLangPageHashes)])
def test_block_hasher_per_protocol(protocol, kind):
    assert type(block_hasher(protocol)) is kind


@pytest.mark.parametrize("hasher, block, namespaces", [
    (SGLangPageHashes(), 1, [(), (None, "x"), ("k", None)]), (SGLangPageHashes(), 3, [()]),
    (VLLMBlockHashes(), 16, [(), ("x",)])])
def test_a_chain_goes_on_from_where_it_stopped(hasher, block, namespaces):
    # The engine hashes a job's prompt prefix, then the prompt, then prompt
    # and output, each time going on from the chain it has.
    ids = list(range(1000, 1100))
    for ns in namespaces:
        chain = hasher.extend(EMPTY, ids[:37], block, ns)
        chain = hasher.extend(chain, ids[:37], block, ns)
        assert hasher.extend(chain, ids, block, ns).keys == hasher.keys(ids, block, ns)
