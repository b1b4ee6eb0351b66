"""The index all workers share (workers/kv_index.py ``SharedBlocks``, the C
``mask_*`` loops): one walk gives every worker the overlap a walk of its
own set gives, whatever the events, predictions and resets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate.sdk._codec import GenerateRequest
from asgi_generate.hashes import mask_drop, mask_missing, mask_remove, mask_set, mask_walk
from asgi_generate.workers.block_hash import ROOT, block_hashes
from asgi_generate.workers.kv_events import Cleared, Removed, Stored
from asgi_generate.workers.kv_index import MAX_WORKERS, KVIndex, SharedBlocks
from asgi_generate.workers.policies.kv_aware import KVAwarePolicy

KEYS = st.integers(0, 11)


def walk(keys: list, held: set, predicted: dict) -> tuple[int, int]:
    """The reference: how many leading ``keys`` one worker holds or has
    predicted, and how many of those are predicted only (the walk stops at
    the first key in neither)."""
    n = guessed = 0
    for key in keys:
        if key not in held:
            if key not in predicted:
                break
            guessed += 1
        n += 1
    return n, guessed


def test_mask_loops_exact_values():
    held = {1: 0b11, 2: 0b01}
    assert mask_set([1, 2, 3], held, 0b10) == 2 and held == {1: 0b11, 2: 0b11, 3: 0b10}
    keys = {"x3": 3, "x1": 1}
    assert mask_remove(["x3", "x9", "x1"], keys, held, 0b10) == 2 and keys == {} and held == {1: 0b01, 2: 0b11}
    keys = {"a": 2, "b": 1, "c": 7}
    assert mask_remove(["a", "x", "c"], keys, held, 0b01) == 1 and keys == {"b": 1} and held == {1: 0b01, 2: 0b10}
    assert mask_drop({1: 0b11, 2: 0b01, 3: 0b10}, 0b01) == 2
    dropped = {1: 0b11, 2: 0b01, 3: 0b10}
    mask_drop(dropped, 0b01)
    assert dropped == {1: 0b10, 3: 0b10}
    assert mask_missing([1, 2, 3, 1], held, 0b01) == [2, 3]
    assert mask_missing([1, 2, 3, 1], held, 0b01, 2) == [3]
    # Worker 0 holds 1, 2; worker 1 holds 2 and has 1 and 3 predicted; worker 2 nothing.
    overlaps, guessed = mask_walk([1, 2, 3, 4], {1: 0b01, 2: 0b11}, 0b111, [(1, {1: 5.0, 3: 5.0})])
    assert overlaps[:3] == [2, 3, 0] and guessed[:3] == [0, 2, 0] and set(overlaps[3:]) == {0}


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(KEYS, max_size=12),
    workers=st.lists(st.tuples(st.sets(KEYS), st.sets(KEYS)), min_size=1, max_size=6),
    active=st.integers(0, 63),
)
def test_one_walk_is_each_workers_own_walk(keys, workers, active):
    """Property: for random per-worker held sets and predictions, the
    shared walk's overlap and predicted-only count of each active worker
    equal ``walk`` of that worker's own set and dict."""
    held: dict[int, int] = {}
    for slot, (have, _) in enumerate(workers):
        mask_set(list(have), held, 1 << slot)
    predicted = [(slot, dict.fromkeys(guess, 1.0)) for slot, (_, guess) in enumerate(workers)]
    overlaps, guessed = mask_walk(keys, held, active, predicted)
    for slot, (have, guess) in enumerate(workers):
        want = walk(keys, have, dict.fromkeys(guess, 1.0)) if active >> slot & 1 else (0, 0)
        assert (overlaps[slot], guessed[slot]) == want, slot


class _OwnSet:
    """One worker's index as it was before the indexes were shared: a set
    of held keys and a dict of predictions (the reference)."""

    def __init__(self, ttl: float) -> None:
        self.ttl, self.keys, self.held, self.predicted, self.expiry = ttl, {}, set(), {}, []

    def apply(self, event) -> None:
        if isinstance(event, Stored):
            parent = None
            if event.parent is not None:
                parent = self.keys.get(event.parent)
                if parent is None:
                    return
            ours = block_hashes(ROOT, event.token_ids, 1, parent)[: len(event.hashes)]
            self.keys.update(zip(event.hashes, ours))
            self.held.update(ours)
            for key in self.predicted.keys() & ours:
                del self.predicted[key]
        elif isinstance(event, Removed):
            self.held.difference_update([self.keys.pop(h, None) for h in event.hashes])
        else:  # Cleared
            for part in (self.keys, self.held, self.predicted, self.expiry):
                part.clear()

    def predict(self, keys, now) -> None:
        new = [key for key in keys if key not in self.held]
        self.predicted.update(dict.fromkeys(new, now + self.ttl))
        self.expiry.append((now + self.ttl, new))

    def overlap(self, keys, now) -> tuple[int, int]:
        while self.expiry and self.expiry[0][0] <= now:
            until, old = self.expiry.pop(0)
            for key in old:
                if self.predicted.get(key) == until:
                    del self.predicted[key]
        return walk(keys, self.held, self.predicted)


TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=4)
OPS = st.one_of(
    st.tuples(st.just("stored"), st.integers(0, 2), st.integers(0, 30), st.one_of(st.none(), st.integers(0, 30)),
              TOKENS),
    st.tuples(st.just("removed"), st.integers(0, 2), st.lists(st.integers(0, 30), max_size=4)),
    st.tuples(st.just("cleared"), st.integers(0, 2)),
    st.tuples(st.just("predict"), st.integers(0, 2), TOKENS),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(OPS, st.integers(0, 2)), max_size=25), probes=st.lists(TOKENS, min_size=1, max_size=4))
def test_shared_indexes_walk_as_the_old_per_worker_sets(ops, probes):
    """Property: three workers' indexes over one ``SharedBlocks``, fed
    random stored (chained by engine parent hashes, orphans included),
    removed, cleared events and predictions with expiry, give after every
    step each worker's overlap, blocks held and predictions pending equal
    to the per-worker sets and walk they replaced."""
    shared = SharedBlocks()
    indexes = [KVIndex(1000, ttl=2.0, shared=shared) for _ in range(3)]
    refs = [_OwnSet(2.0) for _ in range(3)]
    now = 0.0
    for (op, worker, *rest), tick in ops:
        now += tick
        index, ref = indexes[worker], refs[worker]
        if op == "stored":
            first, parent, tokens = rest
            event = Stored(list(range(first, first + len(tokens))), parent, tokens, 1, None)
        elif op == "removed":
            event = Removed(rest[0])
        elif op == "cleared":
            event = Cleared()
        else:
            keys = block_hashes(ROOT, rest[0], 1)
            index.predict(keys, now)
            ref.predict(keys, now)
            continue
        index.apply([event])
        ref.apply(event)
        for probe in probes:
            keys = block_hashes(ROOT, probe, 1)
            together = shared.overlaps(keys, indexes, now)
            for i in range(3):
                assert together[indexes[i]] == refs[i].overlap(keys, now), (i, probe)
                assert indexes[i].blocks == len(refs[i].held) and indexes[i].pending == len(refs[i].predicted)


def test_prediction_skipping_the_held_run_predicts_the_same():
    """``predict(keys, now, held)`` skips the leading run the walk found
    held: the same predictions as looking at every key."""
    ids = list(range(40))
    keys = block_hashes(ROOT, ids, 1)
    a, b = KVIndex(1000, ttl=5.0), KVIndex(1000, ttl=5.0)
    for index in (a, b):
        index.apply([Stored(list(range(16)), None, ids[:16], 1, None)])
    assert a.overlap(keys, 0.0) == (16, 0)
    a.predict(keys, 0.0, 16)
    b.predict(keys, 0.0)
    assert a._predicted == b._predicted and len(a._predicted) == 24 and a.predicted == b.predicted == 24


def test_past_64_workers_a_second_shared_index_and_one_walk_each():
    """A fleet larger than a mask: the 65th worker starts a second
    ``SharedBlocks``; each worker still gets its own overlap."""

    class W:
        def __init__(self, i):
            self.id, self.url, self.outstanding, self.inflight = f"w{i}", f"http://h{i}", 0, ()

    policy = KVAwarePolicy()
    policy.clock = lambda: 1.0
    workers = [W(i) for i in range(MAX_WORKERS + 2)]
    ids = list(range(64))
    for i, w in enumerate(workers):
        kv = policy._kv(w)
        kv.subscriber = object()
        kv.index.block_size = 1
        if i in (3, MAX_WORKERS + 1):  # one holder in each shared index, the second holds more
            n = 32 if i == 3 else 48
            kv.index.apply([Stored(list(range(n)), None, ids[:n], 1, None)])
    assert policy._kv(workers[0]).index.shared is not policy._kv(workers[-1]).index.shared
    key = policy.routing_key(GenerateRequest(stream=False, input_ids=ids), {})
    overlaps = policy._overlaps(key, [policy._kv(w) for w in workers], 1.0)
    assert {i: overlaps[policy._kv(w).index] for i, w in enumerate(workers) if overlaps[policy._kv(w).index][0]} == {
        3: (32, 0), MAX_WORKERS + 1: (48, 0)}
    assert policy.choose(workers, key, min) is workers[-1]
