"""kv-aware scoring, in process: the cost of each worker (the prompt tokens
it does not hold x ``overlap_weight``, the prefill queued there x
``queued_weight``, its requests x ``load_weight``) and the tie-breaks, with
exact costs worked out in each test. A worker's index is fed a
``BlockStored`` of 16-token blocks, as an engine's events do."""

from __future__ import annotations

from array import array

import xxhash

from asgi_generate.sdk._codec import BatchItem, GenerateRequest
from asgi_generate.workers.block_hash import ROOT, block_hashes
from asgi_generate.workers.kv_events import Stored
from asgi_generate.workers.policies.kv_aware import KVAwarePolicy

BLOCK = 16
SYSTEM = list(range(1000, 2024))  # a 1,024-token system prefix (64 blocks)
NOW = 100.0


class _Worker:
    """A candidate as the router hands it to the policy."""

    def __init__(self, i: int, outstanding: int = 0) -> None:
        self.id, self.url, self.outstanding = f"w{i}", f"http://127.0.0.1:{9000 + i}", outstanding
        self.inflight: list = []


def _policy(workers: list[_Worker], holding: dict[str, list[int]] | None = None, **weights: float) -> KVAwarePolicy:
    """A policy whose workers all publish events; ``holding`` maps a worker
    id to the tokens its engine says it stores."""
    policy = KVAwarePolicy(**weights)
    policy.clock = lambda: NOW
    for w in workers:
        kv = policy._kv(w)
        kv.subscriber = object()  # events arrive: the index, not the tree, scores it
        kv.index.block_size = BLOCK
        ids = (holding or {}).get(w.id)
        if ids:
            kv.index.apply([Stored(list(range(len(ids) // BLOCK)), None, ids, BLOCK, None)])
    return policy


def _pick(policy: KVAwarePolicy, workers: list[_Worker], request: GenerateRequest) -> str:
    key = policy.routing_key(request, {})
    return policy.choose(workers, key, lambda c: min(c, key=lambda w: w.outstanding)).id


def _prompt(ids: list[int]) -> GenerateRequest:
    return GenerateRequest(stream=False, input_ids=ids)


def test_a_held_prefix_outweighs_the_load_at_which_a_copy_elsewhere_breaks_even():
    """A 1,152-token prompt whose 1,024-token prefix w0 holds, w0 busy, w1
    idle: w0 costs 1.25 x 128 + 128 x its requests, w1 1.25 x 1,152 =
    1,440. At 8 requests (a GRPO group's siblings) w0 costs 1,184 and keeps
    the prompt; at weight 1 the two tied (1,152) and the tie went to the
    emptier cache, w1: a second copy of the prefix."""
    prompt = _prompt(SYSTEM + list(range(5000, 5128)))
    for outstanding, weight, expected in ((8, 1.25, "w0"), (9, 1.25, "w0"), (10, 1.25, "w1"), (8, 1.0, "w1"),
                                          (7, 1.0, "w0")):
        workers = [_Worker(0, outstanding), _Worker(1)]
        policy = _policy(workers, {"w0": SYSTEM}, overlap_weight=weight)
        assert (outstanding, weight, _pick(policy, workers, prompt)) == (outstanding, weight, expected)
    assert KVAwarePolicy().overlap_weight == 1.25


def test_the_queued_prefill_counts_at_its_own_weight():
    """w0 holds the prefix and has 2,048 tokens of another prompt routed
    and not yet stored (128 predicted blocks). Not counted (the default),
    w0 costs 1.25 x 128 = 160 and keeps the prompt; at weight 1 it costs
    160 + 2,048 = 2,208 against w1's 1,440."""
    prompt = _prompt(SYSTEM + list(range(5000, 5128)))
    queued = block_hashes(ROOT, list(range(7000, 9048)), BLOCK)
    picks = {}
    for weight in (0.0, 1.0):
        workers = [_Worker(0), _Worker(1)]
        policy = _policy(workers, {"w0": SYSTEM}, queued_weight=weight)
        policy._kv(workers[0]).index.predict(queued, NOW)
        assert policy._kv(workers[0]).index.pending == 128
        picks[weight] = _pick(policy, workers, prompt)
    assert picks == {0.0: "w0", 1.0: "w1"}
    assert KVAwarePolicy().queued_weight == 0.0


def test_a_workers_first_request_of_n_samples_counts_n():
    """The samples per request start at the first request's ``n`` (8), not
    at 1 moved a fifth of the way (2.4); later requests move the average."""
    workers = [_Worker(0), _Worker(1)]
    policy = _policy(workers)
    ids = SYSTEM + list(range(5000, 5128))
    group = GenerateRequest(stream=False, items=[BatchItem(None, ids, None, 0) for _ in range(8)])
    chosen = _pick(policy, workers, group)
    kv = policy.workers[chosen]
    assert (kv.per_request, kv.requests(1)) == (8, 8)
    single = [w for w in workers if w.id == chosen]
    _pick(policy, single, _prompt(ids))
    assert kv.per_request == 8 + 0.2 * (1 - 8)


def test_ties_hash_the_prompts_end_so_groups_sharing_a_system_prefix_spread():
    """Sixteen GRPO groups (the system prefix, then 128 tokens each) on four
    idle, empty workers: every cost ties, and each group is a replica's
    first request. Hashed on the prompt's first 64 tokens (the system
    prefix) all went to one worker in every replica; hashed on its last 64
    they spread over all four, and the same prompt picks the same worker
    in every replica."""
    groups = [SYSTEM + list(range(5000 + 128 * g, 5128 + 128 * g)) for g in range(16)]
    workers = [_Worker(i) for i in range(4)]
    picks = [_pick(_policy(workers), workers, _prompt(g)) for g in groups]
    assert picks == [_pick(_policy(workers), workers, _prompt(g)) for g in groups]

    def highest(ids: list[int]) -> str:  # XXH3-64 of the last 64 tokens, seeded by the URL's
        tail = array("I", ids[-64:]).tobytes()
        return max(workers, key=lambda w: xxhash.xxh3_64_intdigest(tail, seed=xxhash.xxh3_64_intdigest(
            w.url.encode()))).id

    assert picks == [highest(g) for g in groups]
    assert len(set(picks)) == 4


class _Leg:
    """A leg riding a worker (its ``inflight``): the request's routing key
    and the output tokens it produced so far."""

    def __init__(self, key: object, generated: int = 0) -> None:
        self.route_key = key

        class _Attempt:
            tokens = generated

        self.attempt = _Attempt()


def _run(policy: KVAwarePolicy, worker: _Worker, ids: list[int], generated: int = 0, n: int = 1) -> None:
    """A request of ``ids`` (``n`` samples) running on ``worker``, routed by
    ``policy`` (its routing key on the leg)."""
    request = (_prompt(ids) if n == 1 else
               GenerateRequest(stream=False, items=[BatchItem(None, ids, None, 0) for _ in range(n)]))
    worker.inflight.append(_Leg(policy.routing_key(request, {}), generated))
    worker.outstanding += 1


def test_the_active_tokens_of_running_requests_weigh_on_their_worker():
    """w0 and w1 both hold the system prefix and each runs one request:
    w0 an 8,000-token prompt that has generated 32 tokens, w1 a 100-token
    one. A new 1,152-token prompt costs 1.25 x 128 + 128 x 1 = 288 on each
    before the running requests' tokens count: a tie, which goes to the
    emptier cache, w0 (w1 also holds 2,048 tokens of another prompt). At
    active weight 0.05, w0 costs 288 + 0.05 x 8,032 = 689.6 and w1
    288 + 0.05 x 100 = 293: w1."""
    prompt = _prompt(SYSTEM + list(range(5000, 5128)))
    picks = {}
    for weight in (0.0, 0.05):
        workers = [_Worker(0), _Worker(1)]
        policy = _policy(workers, {"w0": SYSTEM, "w1": SYSTEM + list(range(7000, 9048))}, active_weight=weight)
        _run(policy, workers[0], list(range(20_000, 28_000)), generated=32)
        _run(policy, workers[1], list(range(30_000, 30_100)))
        assert [policy.active(w, policy._kv(w)) for w in workers] == [8032, 100]
        picks[weight] = _pick(policy, workers, prompt)
    assert picks == {0.0: "w0", 0.05: "w1"}
    assert KVAwarePolicy().active_weight == 0.0


def test_a_new_group_leaves_the_worker_its_last_group_fills_and_pays_the_prefix_once():
    """A GRPO group of 8 x 1,152 tokens runs on w0, which holds the system
    prefix; w1 is idle and empty. The next group's prompt costs, on w0,
    1.25 x 128 + 128 x 8 = 1,184 by requests alone, under w1's
    1.25 x 1,152 = 1,440: it piled onto w0. With the group's tokens at
    weight 0.05 (8 x 1,152 = 9,216 tokens, +460.8) w0 costs 1,644.8: the
    group goes to w1."""
    group = SYSTEM + list(range(5000, 5128))
    prompt = _prompt(SYSTEM + list(range(6000, 6128)))
    picks = {}
    for weight in (0.0, 0.05):
        workers = [_Worker(0), _Worker(1)]
        policy = _policy(workers, {"w0": SYSTEM}, active_weight=weight)
        for _ in range(8):
            _run(policy, workers[0], group)
        assert policy.active(workers[0], policy._kv(workers[0])) == 9216
        picks[weight] = _pick(policy, workers, prompt)
    assert picks == {0.0: "w0", 0.05: "w1"}


def test_n_samples_hold_their_prompt_once_per_sample_and_other_replicas_count_by_their_reading():
    """A running request of ``n`` = 8 samples of a 1,152-token prompt holds
    8 x 1,152 = 9,216 tokens, as 8 separate requests do. The other
    replicas' requests (the engine's reading less this replica's own) each
    count the prompt tokens per sample of the requests this replica routed
    (a moving average, seeded by the first: 1,152)."""
    from asgi_generate.workers.engine_load import EngineLoad

    workers = [_Worker(0), _Worker(1)]
    policy = _policy(workers, active_weight=0.05)
    ids = SYSTEM + list(range(5000, 5128))
    _pick(policy, workers, GenerateRequest(stream=False, items=[BatchItem(None, ids, None, 0) for _ in range(8)]))
    assert policy.tokens_per_sequence == 1152
    _run(policy, workers[0], ids, n=8)
    kv0, kv1 = policy._kv(workers[0]), policy._kv(workers[1])
    kv1.read(EngineLoad(3, 0), 0)
    assert (policy.active(workers[0], kv0), kv1.others, policy.active(workers[1], kv1)) == (9216, 3, 3 * 1152)


def test_the_rendezvous_hash_is_taken_of_the_tied_workers_only(monkeypatch):
    """256 workers, w7 holding the prefix: it costs least, so no worker's
    tie-break hash is taken (it was taken for all 256 on every request).
    With w7 and w9 holding it alike, only those two are hashed, and the one
    with the higher hash of the prompt's end wins, as before."""
    from asgi_generate.workers.policies import kv_aware

    hashed: list[str] = []
    real = kv_aware.rendezvous  # the URLs of the tied, as bytes, hashed at once
    monkeypatch.setattr(kv_aware, "rendezvous",
                        lambda urls, tail: hashed.extend(u.decode() for u in urls) or real(urls, tail))
    prompt = _prompt(SYSTEM + list(range(5000, 5128)))
    workers = [_Worker(i) for i in range(256)]
    assert _pick(_policy(workers, {"w7": SYSTEM}), workers, prompt) == "w7"
    assert hashed == []

    tree = _policy([]).routing_key(prompt, {}).tree  # the prompt's key: its last 64 tokens are hashed

    def weight(w: _Worker) -> int:
        tail = tree[len(tree) - 64:].encode("utf-32-le", "surrogatepass")
        return xxhash.xxh3_64_intdigest(tail, seed=xxhash.xxh3_64_intdigest(w.url.encode()))

    expected = max((workers[7], workers[9]), key=weight).id
    assert _pick(_policy(workers, {"w7": SYSTEM, "w9": SYSTEM}), workers, prompt) == expected
    assert sorted(hashed) == sorted([workers[7].url, workers[9].url])
