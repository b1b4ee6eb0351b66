"""kv-aware's choice equals the module docstring's, read by a plain scan of
every candidate (:func:`_reference`), on random fleets: workers scored by
events at block sizes 1, 2 and 4 (stored blocks, salted or not, removals,
a block size changed by a restart) and by their trees; predictions within
and past their ttl; load readings, outstanding requests, samples per
request, running legs; every weight nonzero or not; salted requests, text
prompts, ``n`` samples; candidate subsets in rotated orders; workers that
start and stop publishing between requests; fleets past 64 workers (a
second shared index) and workers sharing a URL (equal tie-break hashes,
the first candidate wins)."""

from __future__ import annotations

import random

import pytest
import xxhash

from asgi_generate.sdk._codec import BatchItem, GenerateRequest
from asgi_generate.workers.block_hash import block_hashes
from asgi_generate.workers.engine_load import EngineLoad
from asgi_generate.workers.kv_events import Removed, Stored
from asgi_generate.workers.policies.kv_aware import KVAwarePolicy

PREFIXES = [list(range(1000 * p, 1000 * p + 24)) for p in range(3)]


class _Worker:
    """A candidate as the router hands it to the policy."""

    def __init__(self, i: int, url: str) -> None:
        self.id, self.url, self.outstanding = f"w{i}", url, 0
        self.inflight: list = []


class _Attempt:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens


class _Leg:
    """A leg running on a worker: its request's routing key and the output
    tokens it produced."""

    def __init__(self, key, tokens: int) -> None:
        self.route_key, self.attempt = key, _Attempt(tokens)


def _reference(policy: KVAwarePolicy, candidates: list[_Worker], key, now: float) -> _Worker:
    """The module docstring's choice, by a full scan: each candidate's cost
    (events-scored: the leading blocks its engine holds or it has
    predicted unexpired; tree-scored: its tree's match), then the lowest
    (cost, cached tokens, requests), then the highest rendezvous hash of
    the tied, the first of equals."""
    prompt = len(key.tree) - 1
    rows = []
    for w in candidates:
        kv = policy._kv(w)
        index = kv.index
        if key.ids is not None and kv.subscriber is not None and index.block_size:
            size = index.block_size
            live = {k for k, until in index._predicted.items() if until > now}
            blocks = guessed = 0
            for k in block_hashes(key.seed, key.ids, size):
                if index.shared.held.get(k, 0) & index.bit:
                    blocks += 1
                elif k in live:
                    blocks += 1
                    guessed += 1
                else:
                    break
            held, queued, cached = blocks * size, (len(live) - guessed) * size, (index.blocks + len(live)) * size
        else:
            held = max(policy.fallback.held(key.tree, [w]).get(w.id, 1) - 1, 0)
            queued, cached = 0, policy.fallback.cached_tokens(w.id)
        requests = w.outstanding * kv.per_request + kv.others
        cost = policy.overlap_weight * (prompt - held) + policy.queued_weight * queued + policy.load_weight * requests
        if policy.active_weight:
            cost += policy.active_weight * policy.active(w, kv)
        rows.append(((cost, cached, requests), w))
    low = min(k for k, _ in rows)
    tied = [w for k, w in rows if k == low]
    tail = key.tree[max(1, len(key.tree) - 64):].encode("utf-32-le", "surrogatepass")
    return max(tied, key=lambda w: xxhash.xxh3_64_intdigest(tail, seed=xxhash.xxh3_64_intdigest(w.url.encode())))


class _Fleet:
    """A random fleet, its policy, and the random changes between requests."""

    def __init__(self, rng: random.Random, size: int) -> None:
        self.rng = rng
        self.now = 0.0
        self.engine_hash = 0
        self.policy = KVAwarePolicy(
            overlap_weight=rng.choice([1.25, 1.0, 0.5, 3]), queued_weight=rng.choice([0.0, 0.0, 1.0, 0.25]),
            load_weight=rng.choice([128.0, 128.0, 1.0, 0.0, 16]), active_weight=rng.choice([0.0, 0.0, 0.05, 1.0]),
            ttl=rng.choice([0.0, 1.0, 5.0]))
        self.policy.clock = lambda: self.now
        urls = max(1, rng.choice([size, size, size - 2, size // 2]))  # fewer URLs than workers: some shared
        self.workers = [_Worker(i, f"http://127.0.0.1:{9000 + i % urls}") for i in range(size)]
        self.sizes = {}
        # A quiet fleet (most workers empty and idle) ties often.
        quiet = rng.random() < 0.4
        for w in self.workers:
            kv = self.policy._kv(w)
            if rng.random() < 0.8:
                kv.subscriber = object()
                kv.index.block_size = self.sizes[w.id] = rng.choice([2, 4]) if quiet else rng.choice([1, 2, 4, 4])
            if quiet and rng.random() < 0.8:
                continue
            for _ in range(rng.randrange(3)):
                self.store(w)
            if rng.random() < 0.3:
                self.policy.fallback.learn(w, self.policy.routing_key(self.request(), {}).tree)
            self.load(w)

    def ids(self) -> list[int]:
        rng = self.rng
        tail = [rng.randrange(50, 60) for _ in range(rng.randrange(0, 9))]
        return rng.choice(PREFIXES)[: rng.randrange(0, 25)] + tail

    def request(self) -> GenerateRequest:
        rng = self.rng
        roll = rng.random()
        if roll < 0.1:
            return GenerateRequest(stream=False, prompt_text=rng.choice(["hello", "hello there", "bye"]))
        ids = self.ids() or [7]
        salt = rng.choice([None, None, "s"])
        if roll < 0.2:
            items = [BatchItem(None, ids, None, 0) for _ in range(rng.randrange(2, 5))]
            return GenerateRequest(stream=False, items=items, cache_salt=salt)
        return GenerateRequest(stream=False, input_ids=ids, cache_salt=salt)

    def store(self, w: _Worker) -> None:
        """An event batch for ``w``'s engine: a stored prompt at its block size."""
        rng = self.rng
        size = self.sizes.get(w.id) or rng.choice([1, 2])
        tokens = self.ids()
        n = len(tokens) // size
        if not n:
            return
        hashes = list(range(self.engine_hash, self.engine_hash + n))
        self.engine_hash += n
        self.policy._kv(w).index.apply([Stored(hashes, None, tokens[: n * size], size, rng.choice([None, None, "s"]))])
        if rng.random() < 0.2:
            self.policy._kv(w).index.apply([Removed(hashes[rng.randrange(n):])])

    def load(self, w: _Worker) -> None:
        rng = self.rng
        kv = self.policy._kv(w)
        w.outstanding = rng.choice([0, 0, 1, 2, 5])
        kv.per_request = rng.choice([1.0, 1, 2, 1.6, 8])
        kv.read(EngineLoad(rng.randrange(0, 8), 0) if rng.random() < 0.6 else None, rng.randrange(0, 3))
        w.inflight = [_Leg(self.policy.routing_key(self.request(), {}), rng.randrange(0, 40))
                      for _ in range(rng.choice([0, 0, 1, 2]))]

    def change(self) -> None:
        """What may happen between two requests."""
        rng = self.rng
        self.now += rng.choice([0.0, 0.5, 1.0, 3.0])
        for _ in range(rng.choice([0, 0, 1, 2])):
            w = rng.choice(self.workers)
            roll = rng.random()
            if roll < 0.4:
                self.store(w)
            elif roll < 0.7:
                self.load(w)
            elif roll < 0.8:
                kv = self.policy._kv(w)
                kv.subscriber = None if kv.subscriber is not None else object()
            elif roll < 0.9 and w.id in self.sizes:  # the engine restarted at another block size
                self.sizes[w.id] = rng.choice([1, 2, 4])
                self.store(w)
            else:
                self.policy.forget(w)

    def candidates(self) -> list[_Worker]:
        rng = self.rng
        pool = self.workers if rng.random() < 0.6 else rng.sample(self.workers, rng.randrange(1, len(self.workers) + 1))
        start = rng.randrange(len(pool))
        return pool[start:] + pool[:start]


@pytest.mark.parametrize("seed", range(60))
def test_choose_picks_what_a_full_scan_of_the_docstring_picks(seed):
    rng = random.Random(seed)
    fleet = _Fleet(rng, rng.choice([1, 2, 3, 5, 8, 16, 40, 70]))
    for _ in range(25):
        fleet.change()
        candidates = fleet.candidates()
        key = fleet.policy.routing_key(fleet.request(), {})
        want = _reference(fleet.policy, candidates, key, fleet.now)
        got = fleet.policy.choose(candidates, key, min)
        assert got is want, (seed, got.id, want.id)
        if rng.random() < 0.3:  # it runs there
            got.outstanding += 1
            got.inflight.append(_Leg(key, 0))
