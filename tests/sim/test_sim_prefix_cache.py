"""The simulator's prefix cache: on by default, keyed as each engine keys it
(SGLang ``extra_key`` and ``cache_salt``, vLLM ``cache_salt``), evicting
least recently used blocks (vLLM) or radix nodes (SGLang). In process: the
engine and its protocols driven through the ASGI app."""

from __future__ import annotations

import anyio
import pytest

from asgi_generate.sim.app import SimApp
from asgi_generate.sim.prefix_cache import DEFAULT_CACHE_TOKENS, PrefixCache
from asgi_generate.sim.block_hash import SGLangPageHashes, VLLMBlockHashes
from support import asgi_json


def _sglang_hits(app: SimApp, bodies: list[dict]) -> list[int]:
    async def run() -> list[int]:
        return [(await asgi_json(app, "POST", "/generate", b))["meta_info"]["cached_tokens"] for b in bodies]
    return anyio.run(run)


PROMPT = list(range(100, 140))


def _sg(**extra) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}, **extra}


def test_on_by_default():
    app = SimApp("sglang")
    assert app.engine.cache is not None and app.engine.cache.capacity == DEFAULT_CACHE_TOKENS
    assert _sglang_hits(app, [_sg(), _sg()]) == [0, 39]
    assert SimApp("sglang", cache_tokens=0).engine.cache is None


def test_sglang_keys_by_extra_key_and_cache_salt():
    app = SimApp("sglang")
    hits = _sglang_hits(app, [
        _sg(), _sg(cache_salt="s"), _sg(cache_salt="s"), _sg(extra_key="k"), _sg(extra_key="k", cache_salt="s"),
        _sg(extra_key="k"), _sg(cache_salt=""), _sg(extra_key="", cache_salt=""),
    ])
    # A fresh salt or key misses its unsalted twin; "" is no key at all.
    assert hits == [0, 0, 39, 0, 0, 39, 39, 39]


def test_vllm_keys_by_cache_salt_and_counts_whole_blocks():
    app = SimApp("vllm", enable_prompt_tokens_details=True)
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}}

    async def run() -> list[int]:
        got = []
        for b in (body, {**body, "cache_salt": "s"}, {**body, "cache_salt": "s"}, body):
            details = (await asgi_json(app, "POST", "/inference/v1/generate", b))["usage"]["prompt_tokens_details"]
            got.append(details["cached_tokens"] if details else 0)
        return got
    assert anyio.run(run) == [0, 0, 32, 32]


def test_namespaces_never_share_a_block():
    sglang = SGLangPageHashes()
    firsts = {sglang.keys([7, 8], 1, ns)[0] for ns in [(None, None), ("a", None), (None, "a"), ("a", "bc"), ("ab", "c")]}
    assert len(firsts) == 5 and sglang.keys([7], 1, ()) == sglang.keys([7], 1, (None, None))
    vllm = VLLMBlockHashes()
    assert vllm.keys([7, 8], 2, (None,)) == vllm.keys([7, 8], 2, ()) != vllm.keys([7, 8], 2, ("a",))


@pytest.mark.parametrize("whole_runs, left", [(False, [0, 1]), (True, [])])
def test_eviction_tail_first_block_or_radix_node(whole_runs, left):
    cache = PrefixCache(8, 2, whole_runs)
    a, b = list(range(8)), list(range(50, 54))
    ha, hb = VLLMBlockHashes().keys(a, 2, ()), VLLMBlockHashes().keys(b, 2, ())
    assert cache.insert(ha) == (0, [])
    assert cache.insert(ha[:2]) == (2, [])  # touches a's first half only: nothing new
    held, removed = cache.insert(hb)  # two blocks over: a's tail goes first
    assert held == 0 and removed[0] == ha[-1] and cache.tokens <= 8
    assert cache.match(ha) == len(left) and cache.match(hb) == 2
    assert removed == ha[len(left):][::-1]
