"""Routing policies on Router instances (no network): session affinity with
bounded load, cache-aware longest-prefix routing, P/D picks, and the prefix
tree's bounds."""

from __future__ import annotations

import math

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate.sdk._codec import GenerateRequest
from asgi_generate.config import Settings
from asgi_generate.workers.policies import build_policy
from asgi_generate.workers.policies.cache_aware import CacheAwarePolicy
from asgi_generate.workers.policies.session import SessionPolicy
from asgi_generate.sdk._token_ids import pack_token_ids
from asgi_generate.workers.prefix_tree import PrefixTree, token_key
from asgi_generate.workers.router import Router

URLS = [f"http://127.0.0.1:{30000 + i}" for i in range(4)]


def router(policy, urls=URLS, **kw) -> Router:
    r = Router([("sglang", u) for u in urls], policy=policy, **kw)
    for w in r.workers:
        w.healthy = True
    return r


def load(worker, n: int) -> None:
    worker.inflight = {object() for _ in range(n)}


def first_choice(key: bytes, urls=URLS) -> str:
    """The rendezvous winner, computed here from the definition."""
    return max(urls, key=lambda u: xxhash.xxh3_64_intdigest(u.encode() + b"\x00" + key))


def session_pick(r: Router, key: bytes | None):
    headers = {b"x-session-id": key} if key is not None else {}
    return r.pick("sglang", key=r.routing_key(GenerateRequest(stream=False), headers))


def test_same_session_key_many_turns_one_worker():
    r = router(SessionPolicy())
    keys = [f"session-{i}".encode() for i in range(64)]
    for _turn in range(8):
        for key in keys:
            assert session_pick(r, key).url == first_choice(key)
    spread = sorted(sum(first_choice(k) == u for k in keys) for u in URLS)
    assert sum(spread) == 64 and spread[0] > 0  # every worker gets sessions
    assert r.policy.stats() == {
        "policy": "session", "requests": 512, "keyless": 0, "headers": ["x-session-id", "x-smg-routing-key"],
        "epsilon": 1.0, "affinity_hits": 512, "spills": 0,
    }


def test_key_headers_in_order_and_configurable():
    p = SessionPolicy("X-Tenant, x-session-id")
    req = GenerateRequest(stream=False)
    assert p.routing_key(req, {b"x-session-id": b"s", b"x-tenant": b"t"}) == b"t"
    assert p.routing_key(req, {b"x-session-id": b"s", b"x-tenant": b""}) == b"s"
    assert p.routing_key(req, {b"x-smg-routing-key": b"k"}) is None
    assert SessionPolicy().routing_key(req, {b"x-smg-routing-key": b"k"}) == b"k"
    assert (p.requests, p.keyless) == (3, 1)


def test_no_key_goes_least_outstanding():
    r = router(SessionPolicy())
    for w, n in zip(r.workers, [3, 1, 0, 2]):
        load(w, n)
    assert session_pick(r, None) is r.workers[2]
    assert r.policy.stats()["keyless"] == 1 and r.policy.affinity == r.policy.spills == 0


def test_bounded_load_spills_exactly_when_the_cap_is_crossed():
    r = router(SessionPolicy(epsilon=0.5))
    key = b"spill-me"
    order = sorted(URLS, key=lambda u: xxhash.xxh3_64_intdigest(u.encode() + b"\x00" + key), reverse=True)
    by_url = {w.url: w for w in r.workers}
    first, second = by_url[order[0]], by_url[order[1]]
    for w in r.workers:
        load(w, 4)
    # The others hold 12: cap = ceil(1.5 * (12 + L + 1) / 4) is 8 for L = 7 and 8.
    load(first, 7)
    assert r.policy.cap(r.workers) == math.ceil(1.5 * 20 / 4) == 8
    assert session_pick(r, key) is first
    load(first, 8)
    assert r.policy.cap(r.workers) == 8
    assert session_pick(r, key) is second
    load(second, 8)  # more load in all raises the cap: ceil(1.5 * 25 / 4) = 10
    assert r.policy.cap(r.workers) == 10
    assert session_pick(r, key) is first
    load(first, 10)
    load(second, 11)  # total 29: cap ceil(1.5 * 30 / 4) = 12
    assert r.policy.cap(r.workers) == 12
    assert session_pick(r, key) is first
    load(first, 12)  # total 31, cap ceil(48 / 4) = 12: first is full, second (11) is not
    assert r.policy.cap(r.workers) == 12
    assert session_pick(r, key) is second
    assert (r.policy.affinity, r.policy.spills) == (3, 2)


def test_down_worker_sessions_move_and_come_back():
    r = router(SessionPolicy())
    keys = [f"k{i}".encode() for i in range(200)]
    before = {k: session_pick(r, k) for k in keys}
    gone = r.workers[2]
    gone.healthy = False
    during = {k: session_pick(r, k) for k in keys}
    for k in keys:
        if before[k] is gone:
            second = first_choice(k, [u for u in URLS if u != gone.url])
            assert during[k].url == second
        else:
            assert during[k] is before[k]
    assert sum(before[k] is gone for k in keys) > 0
    gone.healthy = True
    assert {k: session_pick(r, k) for k in keys} == before


def test_two_routers_from_the_same_config_agree_on_every_key():
    s = Settings(policy="session")
    a = router(build_policy(s))
    b = router(build_policy(s), urls=list(reversed(URLS)))  # listed in another order
    for i in range(500):
        key = f"agent-{i}".encode()
        assert session_pick(a, key).url == session_pick(b, key).url


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4096 for i in range(n)]


def cache_pick(r: Router, ids: list[int]):
    return r.pick("sglang", key=r.routing_key(GenerateRequest(stream=False, input_ids=ids), {}))


def test_cache_aware_longest_prefix_wins():
    r = router(CacheAwarePolicy())
    long_a, short_b = prompt(1000, 1), prompt(1000, 1)[:300] + prompt(700, 2)
    wa = cache_pick(r, long_a)
    load(wa, 1)  # the others are idle, and least outstanding would avoid it
    wb = cache_pick(r, short_b)  # shares 300 of 1000 (30%): not above the threshold
    assert wb is not wa and r.policy.misses == 2
    turn2 = long_a + prompt(200, 3)  # the conversation so far plus a new turn
    assert cache_pick(r, turn2) is wa
    # A request sharing 900 tokens with A and 300 with B lands on A.
    assert cache_pick(r, long_a[:900] + prompt(100, 4)) is wa
    assert (r.policy.hits, r.policy.misses, r.policy.imbalanced) == (2, 2, 0)
    assert r.policy.held(token_key(turn2), [wa]) == {wa.id: 1201}


def test_cache_aware_ties_and_text_prompts():
    r = router(CacheAwarePolicy())
    text = "You are a helpful agent. " * 20
    first = r.pick("sglang", key=r.routing_key(GenerateRequest(stream=False, prompt_text=text), {}))
    again = r.pick("sglang", key=r.routing_key(GenerateRequest(stream=False, prompt_text=text + "Hi"), {}))
    assert again is first
    # Token ids 89, 111, ... spell no text: a token prompt never matches text.
    ids = [ord(c) for c in text]
    for w in r.workers:
        if w is not first:
            load(w, 0)
    load(first, 1)
    assert cache_pick(r, ids) is not first
    assert r.policy.stats()["affinity_hits"] == 1


def test_cache_aware_imbalance_falls_back_to_least_outstanding():
    r = router(CacheAwarePolicy(balance_abs_threshold=64, balance_rel_threshold=1.5))
    ids = prompt(500, 9)
    home = cache_pick(r, ids)
    load(home, 64)  # 64 - 0 is not above 64: still balanced
    assert cache_pick(r, ids) is home
    load(home, 65)
    other = cache_pick(r, ids)
    assert other is not home and other.outstanding == 0
    assert (r.policy.hits, r.policy.misses, r.policy.imbalanced) == (1, 1, 1)
    # The fallback's worker learned the prompt: it now matches there too.
    assert r.policy.held(token_key(ids), [other]) == {other.id: 501}


def test_a_lost_worker_s_tree_is_forgotten():
    r = router(CacheAwarePolicy())
    ids = prompt(100, 5)
    home = cache_pick(r, ids)
    assert list(r.policy.stats()["trees"]) == [home.id]
    r.worker_lost(home, "probe failed")
    assert r.policy.stats()["trees"] == {} and not home.healthy
    home.healthy = True
    load(home, 1)
    assert cache_pick(r, ids) is not home  # a miss now: least outstanding


def test_keyless_requests_leave_the_policy_alone():
    r = router(CacheAwarePolicy())
    req = GenerateRequest(stream=False)  # embeddings: no ids, no text
    assert r.routing_key(req, {}) is None
    assert r.pick("sglang") is r.workers[0] and r.pick("sglang") is r.workers[1]  # round-robin ties
    assert r.policy.stats() == {"policy": "cache-aware", "requests": 1, "keyless": 1, "affinity_hits": 0,
                                "misses": 0, "imbalanced": 0, "trees": {}}


def test_pd_policy_picks_prefill_decode_least_outstanding():
    prefill = [("sglang", u) for u in URLS[:2]]
    decode = [("sglang", u.replace("300", "310")) for u in URLS[:2]]
    r = Router([], prefill=prefill, decode=decode, policy=SessionPolicy())
    for w in r.workers:
        w.healthy = True
    key = b"pd-session"
    p_home = first_choice(key, URLS[:2])
    load(r.workers[2], 3)  # decode w2 busy
    for _ in range(3):
        p, d = r.plan("sglang", key=key)
        assert (p.url, d) == (p_home, r.workers[3])
    assert r.policy.affinity == 3


def test_tree_eviction_is_lru():
    t = PrefixTree(max_tokens=21, max_nodes=100)
    a, b, c = token_key(prompt(10, 1)), token_key(prompt(10, 2)), token_key(prompt(10, 3))
    t.insert(a)  # 11 characters (marker + 10)
    t.insert(b)  # shares the marker: 21
    assert (t.tokens, t.nodes) == (21, 3)
    t.insert(a)  # a is now the most recent
    t.insert(c)  # 31 > 21: b's leaf goes
    assert (t.match(a), t.match(b), t.match(c)) == (11, 1, 11)
    assert (t.tokens, t.evicted_tokens) == (21, 10)
    t.clear()
    assert (t.tokens, t.nodes, t.match(a)) == (0, 0, 0)


def test_token_keys_one_character_per_id():
    assert token_key([0, 65, 0xD800, 0x10FFFF]) == "\x01\x00A\ud800\U0010ffff"
    assert token_key([0x110000 + 65, 1 << 40]) == "\x01A\U00010000"  # past the code points: folded


def test_token_keys_read_the_codecs_packed_prompt():
    ids = [0, 65, 0xD800, 0x10FFFF, 151643]
    packed = pack_token_ids(ids)
    assert token_key(packed.u32) == token_key(ids) == "\x01\x00A\ud800\U0010ffff\U0002505b"
    request = GenerateRequest(stream=False, input_ids=ids, input_ids_packed=packed)
    assert CacheAwarePolicy().routing_key(request, {}) == token_key(ids)


def _walk(t: PrefixTree):
    return list(t._walk())


def _lcp(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(
    st.integers(8, 200), st.integers(2, 40),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 60), st.lists(st.integers(0, 3), max_size=30)),
             min_size=1, max_size=120),
)
def test_tree_stays_within_its_bounds(max_tokens, max_nodes, ops):
    """Random workload of prompts sharing prefixes (a base picked from a few,
    cut, then a random tail): the tree never holds more than its bounds, its
    counts are what it holds, and a match never claims more than some
    inserted key shares."""
    bases = [prompt(60, s) for s in range(6)]
    t = PrefixTree(max_tokens, max_nodes)
    inserted: list[str] = []
    evicted = False
    for base, cut, tail in ops:
        key = token_key(bases[base][:cut] + tail)
        before = t.evicted_tokens
        t.insert(key)
        evicted |= t.evicted_tokens > before
        inserted.append(key[:max_tokens])
        nodes = _walk(t)
        assert t.tokens <= max_tokens and t.nodes <= max_nodes
        assert t.tokens == sum(len(n.edge) for n in nodes) and t.nodes == len(nodes)
        assert all(n.edge for n in nodes)
        for probe in inserted[-3:]:
            best = max(_lcp(probe, k) for k in inserted)
            assert t.match(probe) <= best
            if not evicted:
                assert t.match(probe) == best


def test_router_least_outstanding_then_round_robin():
    r = Router([("sglang", "http://127.0.0.1:1"), ("sglang", "http://127.0.0.1:2"),
                ("sglang", "http://127.0.0.1:3"), ("vllm", "http://127.0.0.1:4")])
    for w in r.workers:
        w.healthy = True
    assert [r.pick("sglang").id for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    r.workers[1].inflight.add(object())
    r.workers[2].inflight.add(object())
    assert [r.pick("sglang").id for _ in range(2)] == ["w0", "w0"]
    r.workers[0].healthy = False
    assert r.pick("sglang").id == "w1"
    assert r.pick("sglang", exclude=[r.workers[1], r.workers[2]]) is None
    assert r.pick("vllm").id == "w3"
    assert r.pick("other") is None


def test_router_pick_looks_at_no_worker_per_request_and_picks_as_a_whole_walk():
    import random

    r = router(None, urls=[f"http://127.0.0.1:{30000 + i}" for i in range(256)])
    looked: list[str] = []
    admits = r.routable
    r.routable = lambda w, floor=None: looked.append(w.id) or admits(w, floor)
    # 256 idle workers: the first in round-robin order is taken; each worker's
    # routability is read once, for the candidate list kept between picks.
    assert [r.pick("sglang").id for _ in range(3)] == ["w0", "w1", "w2"]
    assert looked == [f"w{i}" for i in range(256)]
    # Against the whole walk (the fewest outstanding, first in round-robin order),
    # over random loads, health and exclusions.
    rng = random.Random(7)
    group = r._groups[("sglang", "aggregated")]
    for _ in range(500):
        for w in r.workers:
            load(w, rng.choice((0, 1, 1, 2, 3)) if rng.random() < 0.5 else rng.choice((1, 2, 3)))
            w.healthy = rng.random() < 0.9
        exclude = rng.sample(r.workers, rng.choice((0, 1, 5)))
        start = r._next.get(("sglang", "aggregated"), 0)
        walk = [group[(start + i) % len(group)] for i in range(len(group))]
        eligible = [w for w in walk if w.healthy and w not in exclude]
        expected = min(eligible, key=lambda w: w.outstanding) if eligible else None
        assert r.pick("sglang", exclude=exclude) is expected
