"""The fleet's shared prefix tree (workers/fleet_tree.py) against one
PrefixTree per worker: the same answers while nothing is evicted, and each
worker within its bounds when things are."""

from __future__ import annotations

import random
from types import SimpleNamespace
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate.workers import fleet_tree
from asgi_generate.workers.fleet_tree import FleetTree
from asgi_generate.workers.policies.cache_aware import CacheAwarePolicy
from asgi_generate.workers.prefix_tree import PrefixTree, token_key

WIDS = ("w0", "w1", "w2", "w3")


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4096 for i in range(n)]


BASES = [prompt(60, s) for s in range(6)]

# (op, worker, base, cut, tail): learn / forget / held, over prompts sharing prefixes.
OPS = st.lists(
    st.tuples(st.sampled_from(("learn", "learn", "learn", "forget", "held")), st.sampled_from(WIDS),
              st.integers(0, 5), st.integers(0, 60), st.lists(st.integers(0, 3), max_size=20)),
    min_size=1, max_size=80,
)


def _key(base: int, cut: int, tail: list[int]) -> str:
    return token_key(BASES[base][:cut] + tail)


def _reference_held(trees: dict[str, PrefixTree], key: str) -> dict[str, int]:
    return {wid: m for wid, t in trees.items() if (m := t.match(key)) > 1}


def _walk(tree: FleetTree):
    stack = list(tree._root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _path_after_insert(tree: FleetTree, key: str) -> int:
    """The nodes on ``key``'s path once it is inserted, read before: a key
    going past what the tree matches of it adds one (its leaf; a split
    node only takes the place of the one it splits)."""
    path = tree._path(key)
    matched = path[-1][1] if path else 0
    return len(path) + (matched < len(key))


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_without_eviction_it_answers_as_one_prefix_tree_per_worker(ops):
    """Through the cache-aware policy's API (what kv-aware's fallback uses):
    held lengths and cached tokens exactly as one PrefixTree per worker."""
    policy = CacheAwarePolicy()
    workers = {wid: SimpleNamespace(id=wid) for wid in WIDS}
    trees: dict[str, PrefixTree] = {}
    everyone = list(workers.values())
    for op, wid, base, cut, tail in ops:
        key = _key(base, cut, tail)
        if op == "learn":
            policy.learn(workers[wid], key)
            trees.setdefault(wid, PrefixTree(1 << 20, 1 << 16)).insert(key)
        elif op == "forget":
            policy.forget(workers[wid])
            trees.pop(wid, None)
        expected = _reference_held(trees, key)
        assert policy.held(key, everyone) == expected
        assert policy.held(key, everyone[:2]) == {w: m for w, m in expected.items() if w in WIDS[:2]}
        best = max(expected.values(), default=0)
        matched, holders = policy.tree.deepest(key, frozenset(WIDS))
        if best:
            assert (matched, holders) == (best, {w for w, m in expected.items() if m == best})
        else:  # at most the kind marker held: no prompt
            assert matched <= 1
        for w in WIDS:
            assert policy.cached_tokens(w) == (trees[w].tokens if w in trees else 0)
        assert sorted(policy.stats()["trees"]) == sorted(trees)
        assert all(s["evicted_tokens"] == 0 for s in policy.stats()["trees"].values())
    # Every node in the tree is held, and by workers holding its parent.
    tree = policy.tree
    for node in _walk(tree):
        assert node.holder_ids() and node.edge
        if node.parent is not tree._root:
            assert set(node.holder_ids()) <= set(node.parent.holder_ids())


@settings(max_examples=200, deadline=None)
@given(st.integers(8, 120), st.integers(2, 30), OPS)
def test_with_small_bounds_each_worker_stays_within_them(max_tokens, max_nodes, ops):
    """Each worker's tokens and nodes never pass its bounds and its counts
    are what it holds; it never holds more of a key than an unbounded tree
    of its own would; the key learned last is held whole by its worker
    whenever its path fits the node bound."""
    tree = FleetTree(max_tokens, max_nodes)
    unbounded: dict[str, PrefixTree] = {}
    ids = frozenset(WIDS)
    for op, wid, base, cut, tail in ops:
        key = _key(base, cut, tail)
        if op == "learn":
            fits = _path_after_insert(tree, key[:max_tokens]) <= max_nodes
            tree.insert(wid, key)
            unbounded.setdefault(wid, PrefixTree(1 << 20, 1 << 16)).insert(key)
            if fits:
                assert tree.held(key, frozenset([wid])) == ({wid: min(len(key), max_tokens)}
                                                            if min(len(key), max_tokens) > 1 else {})
        elif op == "forget":
            tree.forget(wid)
            unbounded.pop(wid, None)
        for w, held in tree.held(key, ids).items():
            assert held <= unbounded[w].match(key)
        nodes = list(_walk(tree))
        for w, s in tree.stats().items():
            assert s["tokens"] <= max_tokens and s["nodes"] <= max_nodes
            mine = [n for n in nodes if w in n.holder_ids()]
            assert (s["tokens"], s["nodes"]) == (sum(len(n.edge) for n in mine), len(mine))
            kids = tree._holders[w].kids  # children held, as eviction reads them
            assert all(n.kids_of(kids) == sum(w in c.holder_ids() for c in n.children.values()) for n in mine)
        for node in nodes:
            assert node.holder_ids() and node.edge
            if node.parent is not tree._root:
                assert set(node.holder_ids()) <= set(node.parent.holder_ids())


def test_eviction_is_each_worker_s_own_lru():
    t = FleetTree(max_tokens=21, max_nodes=100)
    a, b, c = token_key(prompt(10, 1)), token_key(prompt(10, 2)), token_key(prompt(10, 3))
    t.insert("w0", a)  # 11 characters (marker + 10)
    t.insert("w0", b)  # shares the marker: 21
    t.insert("w1", b)  # w1 holds b too: w0's eviction leaves w1's share alone
    assert t.stats() == {"w0": {"tokens": 21, "nodes": 3, "evicted_tokens": 0},
                         "w1": {"tokens": 11, "nodes": 2, "evicted_tokens": 0}}
    t.insert("w0", a)  # a is now w0's most recent
    t.insert("w0", c)  # 31 > 21: w0's b leaf goes
    ids = frozenset(("w0", "w1"))
    assert (t.held(a, ids), t.held(b, ids), t.held(c, ids)) == ({"w0": 11}, {"w1": 11}, {"w0": 11})
    assert t.stats()["w0"] == {"tokens": 21, "nodes": 3, "evicted_tokens": 10}
    t.forget("w0")
    assert t.stats() == {"w1": {"tokens": 11, "nodes": 2, "evicted_tokens": 0}}
    assert (t.held(a, ids), t.held(b, ids)) == ({}, {"w1": 11})


def test_deepest_among_many_holders_follows_membership_changes():
    """Holders among candidates are kept for nodes many workers hold; a
    worker leaving or joining such a node is seen at once."""
    t = FleetTree(1 << 20, 1 << 16)
    system = prompt(100, 1)
    wids = [f"w{i}" for i in range(40)]
    for w in wids:
        t.insert(w, token_key(system + prompt(5, 100 + int(w[1:]))))
    ids = frozenset(wids)
    key = token_key(system + prompt(5, 999))
    assert t.deepest(key, ids) == (101, ids)
    assert t.deepest(key, ids) == (101, ids)  # kept
    t.forget("w7")
    assert t.deepest(key, ids) == (101, ids - {"w7"})
    t.insert("w7", token_key(system))
    assert t.deepest(key, ids) == (101, ids)
    assert t.deepest(key, frozenset(wids[:3])) == (101, frozenset(wids[:3]))


MANY = [f"w{i}" for i in range(24)]


@pytest.mark.parametrize("seed", range(12))
def test_deepest_over_many_holders_is_the_longest_held(seed):
    """Few prompts learned by many workers: with more holders per node than
    the tree keeps holders among candidates for (MEMO_HOLDERS), and
    eviction and forgetting changing them: deepest() is the longest match
    among the candidates and exactly those holding it, for the same
    candidate set asked again and again and for others."""
    rng = random.Random(seed)
    tree = FleetTree(rng.randint(30, 200), 1 << 16)
    ops = [(rng.choice(("learn", "learn", "learn", "forget")), rng.choice(MANY), rng.randint(0, 2),
            rng.choice((20, 40, 60)), [rng.randint(0, 3) for _ in range(rng.randint(0, 2))]) for _ in range(200)]
    sets = [frozenset(MANY), frozenset(MANY[:20]), frozenset(MANY[::2])]
    with patch.object(fleet_tree, "MEMO_HOLDERS", 2):  # kept for every node two or more hold
        _deepest_is_the_longest_held(tree, sets, ops)


def _deepest_is_the_longest_held(tree: FleetTree, sets: list[frozenset[str]], ops) -> None:
    seen: list[str] = []
    for op, wid, base, cut, tail in ops:
        key = _key(base, cut, tail)
        if op == "learn":
            tree.insert(wid, key)
        else:
            tree.forget(wid)
        seen = [k for k in seen if k != key][-7:] + [key]
        for probe, ids in ((k, ids) for k in seen for ids in sets):
            held = tree.held(probe, ids)
            best = max(held.values(), default=0)
            matched, holders = tree.deepest(probe, ids)
            if best:
                assert (matched, holders) == (best, {w for w, m in held.items() if m == best})
            else:
                assert matched <= 1
