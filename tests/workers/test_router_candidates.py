"""The router's candidate lists kept between picks and its counted loads
(workers/candidates.py, workers/outstanding.py): every pick is the one the
walk of the whole group made (the fewest outstanding, first in round-robin
order), and no pick is served from a list a change made stale."""

from __future__ import annotations

import random

import pytest

from asgi_generate.workers.fence import RouteKey
from asgi_generate.workers.outstanding import Legs, LoadIndex
from asgi_generate.workers.policies import Policy
from asgi_generate.workers.router import Router


def _first_least(order, eligible):
    """The rule the router walked by before its lists were kept: the first
    eligible worker of ``order`` with the fewest outstanding."""
    best, fewest = None, 0
    for w in order:
        if not eligible(w):
            continue
        outstanding = w.outstanding
        if best is None or outstanding < fewest:
            best, fewest = w, outstanding
            if not outstanding:
                break
    return best


def expected_pick(r: Router, protocol: str, role: str, exclude, floor=None, need: int = 1):
    """What the router picked by walking the group: round-robin order from
    its counter, routable and not excluded, with room when room counts."""
    group = r._groups.get((protocol, role))
    if not group:
        return None
    start = r._next.get((protocol, role), 0) % len(group)
    order = group[start:] + group[:start]
    candidates = [w for w in order if r.fence.admits(w, floor) and w not in exclude]
    if r.room is not None and role in ("aggregated", "decode"):
        candidates = [w for w in candidates if r.room(w) >= need] or candidates
    return _first_least(candidates, lambda w: True)


def fleet(n: int = 12, policy=None) -> Router:
    urls = [f"http://127.0.0.1:{31000 + i}" for i in range(n)]
    r = Router([("sglang", u) for u in urls],
               prefill=[("sglang", f"http://127.0.0.1:{32000 + i}") for i in range(3)],
               decode=[("sglang", f"http://127.0.0.1:{33000 + i}") for i in range(4)], policy=policy)
    for w in r.workers:
        w.healthy = True
        w.info = {"weight_version": "v1"}
    return r


def _shake(r: Router, rng: random.Random, legs: dict) -> None:
    """One random change to loads or routability between picks."""
    w = rng.choice(r.workers)
    what = rng.random()
    if what < 0.45:
        leg = object()
        w.inflight.add(leg)
        legs.setdefault(w, []).append(leg)
    elif what < 0.7:
        if legs.get(w):
            w.inflight.discard(legs[w].pop(rng.randrange(len(legs[w]))))
    elif what < 0.75:
        legs[w] = [object() for _ in range(rng.randrange(4))]
        w.inflight = set(legs[w])
    elif what < 0.83:
        w.healthy = not w.healthy
    elif what < 0.87:
        if w.draining:
            r.undrain(w)
        else:
            r.drain(w)
    elif what < 0.92:
        w.fence = None if w.fence else "failed /update_weights_from_disk: 400"
    elif what < 0.96:
        w.info = {"weight_version": rng.choice(("v1", "v2"))}
    else:
        if "sglang" in r.fence.versions:
            del r.fence.versions["sglang"]
        else:
            r.fence.versions["sglang"] = rng.choice(("v1", "v2"))


@pytest.mark.parametrize("seed", range(6))
def test_every_pick_is_the_walk_s_pick(seed):
    """Random loads, health, drains, fences, weight versions, exclusions,
    keys (the least-outstanding policy is handed the candidates), room and
    minimum versions: each pick equals the whole walk's."""
    rng = random.Random(seed)
    r = fleet(policy=Policy())
    legs: dict = {}
    room_left = {w: rng.randrange(3) for w in r.workers}
    picked = set()
    for step in range(1500):
        for _ in range(rng.randrange(4)):
            _shake(r, rng, legs)
        r.room = (lambda w: room_left[w]) if step % 5 == 0 else None
        role = rng.choice(("aggregated", "aggregated", "prefill", "decode"))
        exclude = rng.sample(r.workers, rng.choice((0, 0, 1, 3)))
        floor = rng.choice((None, None, "v1", "v2", "v0"))
        key = rng.choice((None, b"k"))
        route = RouteKey(key, floor) if floor else key
        expected = expected_pick(r, "sglang", role, exclude, floor, need=2)
        assert r.pick("sglang", exclude, role, route, need=2) is expected
        picked.add(expected)
    assert None in picked and len(picked) > 10


def test_ties_go_round_robin_and_load_decides_first():
    r = fleet(6)
    assert [r.pick("sglang").id for _ in range(7)] == ["w0", "w1", "w2", "w3", "w4", "w5", "w0"]
    for w, n in zip(r.workers, (2, 1, 1, 3, 1, 2)):
        w.inflight = {object() for _ in range(n)}
    # The counter is past w0: w1, then w2, w4 (ties, in order), then w1 again.
    assert [r.pick("sglang").id for _ in range(4)] == ["w1", "w2", "w4", "w1"]
    leg = object()
    r.workers[2].inflight.add(leg)  # w2 now 2: w4 then w1
    assert [r.pick("sglang").id for _ in range(2)] == ["w4", "w1"]
    r.workers[0].inflight.clear()  # w0 idle
    assert [r.pick("sglang").id for _ in range(2)] == ["w0", "w0"]
    assert r.pick("sglang", exclude=[r.workers[0]]).id == "w1"
    assert r.pick("sglang", exclude=r.workers[:2] + [r.workers[4]]).id == "w2"


def test_a_kept_list_never_serves_a_worker_that_left():
    """Each change that takes a worker out of the rotation is seen by the
    very next pick, whichever worker the counted loads favour."""
    r = fleet(4)
    for w in r.workers[1:]:
        w.inflight.add(object())
    w0 = r.workers[0]
    assert r.pick("sglang") is w0  # the list is kept now, w0 the only idle worker
    assert r.pick("sglang") is w0
    w0.healthy = False
    assert r.pick("sglang").id == "w1"
    w0.healthy = True
    assert r.pick("sglang") is w0
    w0.fence = "failed /update_weights_from_disk: 400"
    assert r.pick("sglang").id == "w1"
    w0.fence = None
    assert r.pick("sglang") is w0
    r.drain(w0)
    assert r.pick("sglang").id == "w2"
    r.undrain(w0)
    assert r.pick("sglang") is w0
    r.fence.versions["sglang"] = "v2"  # the fleet moved on: nobody is at v2
    assert r.pick("sglang") is None
    w0.info = {"weight_version": "v2"}
    assert r.pick("sglang") is w0
    r.workers[2].info = {"weight_version": "v2"}
    w0.inflight.add(object())
    w0.inflight.add(object())  # w0 2, w2 1
    assert r.pick("sglang").id == "w2"
    del r.fence.versions["sglang"]
    # A minimum version keeps its own list: v2 or later is w0 and w2.
    floor = RouteKey(None, "v2")
    assert [r.pick("sglang", key=floor).id for _ in range(2)] == ["w2", "w2"]
    r.workers[2].healthy = False
    assert r.pick("sglang", key=floor) is w0
    r.remove(w0)
    assert r.pick("sglang", key=floor) is None
    assert r.pick("sglang").id == "w1"


def test_load_index_counts_every_change_to_the_sets():
    sets = [Legs(range(n)) for n in (3, 1, 1, 4)]
    index = LoadIndex(sets)
    assert (index.low, index.high, index.first_least(0), index.first_least(2), index.first_least(3)) == (1, 4, 1, 2, 1)
    sets[1].update({10, 11})  # 3
    sets[2].remove(0)  # 0
    assert (index.low, index.high, index.first_least(3)) == (0, 4, 2)
    sets[3] -= {0, 1, 2, 3}
    sets[2] |= {7}
    assert (index.low, index.high, index.first_least(0)) == (0, 3, 3)
    sets[0].intersection_update({0})
    sets[0].symmetric_difference_update({0, 5, 6})
    assert [len(s) for s in sets] == [2, 3, 1, 0]
    assert (index.low, index.high, index.first_least(0)) == (0, 3, 3)
    index.close()
    sets[3].add(1)  # a closed index is dropped, not told
    assert sets[3].watchers == [] and (index.low, index.first_least(0)) == (0, 3)
