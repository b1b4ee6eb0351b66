"""KV-aware routing: score each worker by what its engine says it caches.

Each worker's engine publishes KV cache events (vLLM and SGLang
``--kv-events-config``); the subscriber service
(:mod:`~asgi_generate.workers.policies.kv_sources`) keeps each worker's
:class:`~asgi_generate.workers.kv_index.KVIndex` from them, and the load
readings (:mod:`~asgi_generate.workers.policies.kv_loads`) each engine's
request count. This module scores; what it keeps per worker is a
:class:`~asgi_generate.workers.policies.kv_worker.WorkerKV`.

For a request with token ids, over the candidates, the cost of worker ``w``
(after Dynamo's KV router, ``prefill blocks - overlap`` plus decode load):

    cost(w) = overlap_weight x (prompt tokens not held on w)
              + queued_weight x (prefill tokens queued on w that this
                                 request does not share)
              + load_weight x requests on w (the fleet's, below)
              + active_weight x tokens the requests running on w hold
                                (Dynamo's decode blocks, in tokens)

"Held" counts the blocks the engine's events say it stores and the blocks
predicted on it; "queued" are the predicted blocks not yet stored (requests
routed here within the last ``ttl`` seconds whose prefill the engine has
not published), less this request's own: a sibling waits for no prefill
it shares.

The running requests' tokens (:meth:`KVAwarePolicy.active`) are this
replica's own as they run (each leg on ``w`` carries its request's
routing key: its prompt tokens times its samples, plus the output tokens
the leg produced so far) and the other replicas', known only as the
request count of the engine's load reading, each taken at the prompt
tokens per sample of the requests this replica routed (a moving average).

The defaults are ``overlap_weight`` 1.25, ``queued_weight`` 0,
``load_weight`` 128 and ``active_weight`` 0 (bench/README.md,
bench_routing.py, says how they were chosen).

The requests on ``w`` are the whole fleet's: this replica's own
outstanding requests now, plus the others' as the engine last counted
them (its running and waiting requests, less this replica's outstanding
ones at that reading), so that every replica weighs the same load. Its own
requests it counts fresh, never from a stale reading: one replica alone
routes exactly as without readings. Requests count in the engine's units:
a request of ``n`` samples is ``n``, by a moving average of the samples
per request this replica routed to ``w``, seeded by the first. Without a
reading (``load_interval`` 0, a worker that does not serve the route) the
others count 0, and ``/stats`` says why.

The lowest cost wins; ties go to the worker whose cache holds the fewest
tokens (its engine's blocks and this replica's predictions, the same in
every replica), then to the fewest requests, then to a rendezvous hash of
the prompt's last 64 tokens and the worker's URL (XXH3-64 of the tail
seeded by the URL's; the same for a request's
siblings, different for prompts that share only a system prefix), so that
every frontend replica fed the same events picks the same worker at the
same loads. The winner's blocks are then predicted on it for ``ttl``
seconds (sibling placement, :mod:`~asgi_generate.workers.kv_index`).

A worker that publishes no events (no discovery answer, publishing off) is
scored by an approximate prefix tree of the prompts this process sent it,
as ``cache-aware`` keeps, and ``/stats`` says so (``source: tree`` and
why). A request without token ids (a text prompt) is routed by those trees
for every worker: the engine's blocks are of tokens the frontend cannot
compute.

Every candidate is scored on every request, so the scoring does no
Python work per worker where it can help it: the workers' grouping by
shared index and block size is kept per candidate set (:class:`_Roster`)
until a block size or a worker's source changes; one walk per group
gives every worker's overlap, expiring only the predictions of workers
that have some; the counts are read in bulk, the costs and their ties
computed in C (:func:`~asgi_generate.hashes.kv_lowest`, rounding as
Python does), and so is the rendezvous hash of the tied
(:func:`~asgi_generate.hashes.rendezvous`). Only the tree-scored workers (their trees' matches and
sizes) and, with a nonzero ``active_weight``, every worker's running
tokens are read one worker at a time. ``tests/workers/test_kv_choose_exact.py``
checks the choice against a plain scan of the rules above.
"""

from __future__ import annotations

import time
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence

import anyio

from ...hashes import kv_lowest, rendezvous
from ..block_hash import ROOT, block_hashes, namespace_seed
from ..kv_events import Source
from ..kv_index import KVIndex, SharedBlocks, held_and_pending
from . import Candidate, Least, Policy, W
from .cache_aware import CacheAwarePolicy, prompt_ids, tree_key
from .kv_loads import KVLoads, read_loads
from .kv_sources import follow_events
from .kv_worker import WorkerKV, moving_average

if TYPE_CHECKING:
    from ...sdk._codec import GenerateRequest


class _Key:
    """A request as the policy routes it: token ids (or ``None``), the tree
    key, its ``cache_salt``, and the block hashes per block size, computed
    once each and chained from the salt's seed as the index keys a salted
    store (:class:`~asgi_generate.workers.kv_index.KVIndex`)."""

    __slots__ = ("ids", "tree", "seed", "sequences", "tokens", "_hashes")

    def __init__(self, ids: Sequence[int] | None, tree: str, salt: str | None = None, sequences: int = 1) -> None:
        self.ids = ids
        self.tree = tree
        self.seed = namespace_seed((salt,)) if salt else ROOT
        #: Sequences the engine runs for it (``n`` samples: ``n``).
        self.sequences = sequences
        #: Prompt tokens its sequences hold in the engine's KV cache while
        #: they run (each sample's prompt counted, as the engine counts
        #: ``n`` requests).
        self.tokens = (len(ids) if ids is not None else len(tree) - 1) * sequences
        self._hashes: dict[int, list[int]] = {}

    def hashes(self, block: int) -> list[int]:
        got = self._hashes.get(block)
        if got is None:
            got = self._hashes[block] = block_hashes(self.seed, self.ids, block)
        return got


_ID = attrgetter("id")
_OUTSTANDING = attrgetter("outstanding")
_PER_REQUEST = attrgetter("per_request")
_OTHERS = attrgetter("others")
#: Candidate sets whose :class:`_Roster` a policy keeps (a set excluding
#: a failed worker is another set); past it, they are built again.
ROSTERS = 16


class _Roster:
    """One candidate set as :meth:`KVAwarePolicy.choose` scores it: the
    workers scored by events first, grouped by shared index and block size,
    then those scored by their trees; good while the layout of every
    shared index its workers are in stands
    (:attr:`~asgi_generate.workers.kv_index.SharedBlocks.layout`).

    Attributes:
        workers, kvs, urls: the candidates, what the policy keeps of each,
            and each one's URL as bytes, in this order.
        groups: per shared index and block size, ``(shared, block size,
            mask of its workers' bits, their slots)``, the workers in
            that order.
        indexes: the events-scored workers' indexes (the first
            ``len(indexes)`` workers).
        sizes: their block sizes.
        tree: the workers scored by their trees (the rest).
        layouts: each shared index involved, with its layout when built.
    """

    __slots__ = ("workers", "kvs", "urls", "groups", "indexes", "sizes", "tree", "layouts")

    def __init__(self, pairs: list[tuple[Candidate, WorkerKV]]) -> None:
        grouped: dict[tuple[int, int], list[tuple[Candidate, WorkerKV]]] = {}
        tree = []
        shareds = {}
        for w, kv in pairs:
            index = kv.index
            shareds[id(index.shared)] = index.shared
            if kv.subscriber is not None and index.block_size:
                grouped.setdefault((id(index.shared), index.block_size), []).append((w, kv))
            else:
                tree.append((w, kv))
        self.groups = []
        ordered = []
        for (_, block), members in grouped.items():
            mask = 0
            for _, kv in members:
                mask |= kv.index.bit
            self.groups.append((members[0][1].index.shared, block, mask, [kv.index.slot for _, kv in members]))
            ordered += members
        self.indexes = [kv.index for _, kv in ordered]
        self.sizes = [index.block_size for index in self.indexes]
        self.tree = [w for w, _ in tree]
        ordered += tree
        self.workers = [w for w, _ in ordered]
        self.kvs = [kv for _, kv in ordered]
        self.urls = [w.url.encode() for w in self.workers]
        self.layouts = [(shared, shared.layout) for shared in shareds.values()]

    def current(self) -> bool:
        """Whether no layout changed since it was built."""
        return all(shared.layout == layout for shared, layout in self.layouts)


class KVAwarePolicy(Policy):
    """``--policy kv-aware`` (see the module docstring).

    Args:
        overlap_weight: weight of the prompt tokens a worker does not hold.
        queued_weight: weight of the prefill tokens queued on a worker
            (routed there, not stored yet) that the request does not share.
        load_weight: tokens one outstanding request costs.
        active_weight: weight of each token the worker's running requests
            hold (prompt and generated so far).
        ttl: seconds a routed request's blocks count as predicted (held,
            and queued until the engine stores them).
        load_interval: seconds between readings of each engine's load
            (0: none, this replica's own counts only).
        load_idle_interval: seconds an idle engine's reading may stand
            (:func:`.kv_loads.read_due`; 0: read every ``load_interval``).
        max_blocks: blocks each worker's index holds at most.
        max_tree_tokens, max_tree_nodes: the fallback trees' bounds.
        sources: worker base URL to its ``(PUB endpoint, replay endpoint
            or None)``, for workers whose discovery route is not to be asked.
    """

    name = "kv-aware"

    def __init__(
        self,
        overlap_weight: float = 1.25,
        queued_weight: float = 0.0,
        load_weight: float = 128.0,
        active_weight: float = 0.0,
        ttl: float = 5.0,
        load_interval: float = 0.1,
        load_idle_interval: float = 1.0,
        max_blocks: int = 1 << 20,
        max_tree_tokens: int = 1 << 20,
        max_tree_nodes: int = 1 << 16,
        sources: Mapping[str, tuple[str, str | None]] | None = None,
    ) -> None:
        super().__init__()
        self.overlap_weight = overlap_weight
        self.queued_weight = queued_weight
        self.load_weight = load_weight
        self.active_weight = active_weight
        #: Prompt tokens per engine sequence of the requests routed (a
        #: moving average, seeded by the first): what one of the other
        #: replicas' requests is taken to hold.
        self.tokens_per_sequence = 0.0
        self.keyed = 0
        self.ttl = ttl
        self.load_interval = load_interval
        self.load_idle_interval = load_idle_interval
        self.max_blocks = max_blocks
        self.sources = {url: Source(pub, replay) for url, (pub, replay) in (sources or {}).items()}
        self.workers: dict[str, WorkerKV] = {}
        #: The workers' indexes share one (one a 64 workers).
        self.shared = SharedBlocks()
        #: The fallback: its trees, one per worker routed to.
        self.fallback = CacheAwarePolicy(max_tree_tokens=max_tree_tokens, max_tree_nodes=max_tree_nodes)
        self.by_events = self.by_tree = self.overlapped = 0
        self.clock: Callable[[], float] = time.monotonic
        #: Workers whose load another reader takes for the policy (:meth:`load_share`).
        self.loads_shared: set[str] = set()
        self._rosters: dict[frozenset, _Roster] = {}

    def _key(self, request: "GenerateRequest", headers: Mapping[bytes, bytes]) -> _Key | None:
        tree = tree_key(request)
        if tree is None:
            return None
        return _Key(prompt_ids(request), tree, request.cache_salt, len(request.items) if request.items else 1)

    def _kv(self, worker: Candidate) -> WorkerKV:
        kv = self.workers.get(worker.id)
        if kv is None:
            if self.shared.full:
                self.shared = SharedBlocks()
            kv = self.workers[worker.id] = WorkerKV(KVIndex(self.max_blocks, self.ttl, self.shared), worker)
        return kv

    def _roster(self, candidates: Sequence[W]) -> _Roster:
        """``candidates`` as scored (:class:`_Roster`), built again only
        when the set or a layout changed."""
        ident = frozenset(candidates)
        roster = self._rosters.get(ident)
        if roster is None or not roster.current():
            if len(self._rosters) >= ROSTERS:
                self._rosters.clear()
            roster = self._rosters[ident] = _Roster([(w, self._kv(w)) for w in candidates])
        return roster

    def choose(self, candidates: Sequence[W], key: _Key, least: Least[W]) -> W:
        """See the module docstring."""
        now = self.clock()
        prompt = len(key.tree) - 1
        roster = self._roster(candidates)
        workers, kvs = roster.workers, roster.kvs
        # Per worker, in the roster's order: blocks matched and predicted
        # only, blocks held and pending, block size (the tree-scored: the
        # tree's match and size, in tokens as blocks of 1).
        if key.ids is not None:
            blocks: list[int] = []
            guessed: list[int] = []
            for shared, block, mask, slots in roster.groups:
                overlap, predicted = shared.walk(key.hashes(block), mask, now)
                blocks += map(overlap.__getitem__, slots)
                guessed += map(predicted.__getitem__, slots)
            count, pending = held_and_pending(roster.indexes)
            sizes = roster.sizes[:] if roster.tree else roster.sizes
            tree = roster.tree
        else:
            blocks, guessed, count, pending, sizes = [], [], [], [], []
            tree = workers
        events = len(blocks)
        if tree:
            fallback = self.fallback
            held = fallback.held(key.tree, tree)
            blocks += [max(held.get(w.id, 1) - 1, 0) for w in tree]
            count += map(fallback.cached_tokens, map(_ID, tree))
            guessed += [0] * len(tree)
            pending += [0] * len(tree)
            sizes += [1] * len(tree)
        extra = ([self.active_weight * self.active(w, kv) for w, kv in zip(workers, kvs)]
                 if self.active_weight else None)
        tied = kv_lowest(prompt, (self.overlap_weight, self.queued_weight, self.load_weight), blocks, guessed,
                         pending, count, sizes, list(map(_OUTSTANDING, workers)), list(map(_PER_REQUEST, kvs)),
                         list(map(_OTHERS, kvs)), extra)
        # The rendezvous hash only breaks ties: hashed for the tied alone.
        at = tied[0]
        if len(tied) > 1:
            top = rendezvous(roster.urls if len(tied) == len(workers) else list(map(roster.urls.__getitem__, tied)),
                             _tail(key))
            at = tied[top[0]]
            if len(top) > 1:  # equal URLs: the first in the candidates' order
                order = {id(w): n for n, w in enumerate(candidates)}
                at = min((tied[i] for i in top), key=lambda i: order[id(workers[i])])
        best, kv = workers[at], kvs[at]
        kv.peak = max(kv.peak, best.outstanding + 1)
        kv.per_request = moving_average(kv.per_request, key.sequences, kv.routed)
        kv.routed += 1
        kv.wake()
        self.tokens_per_sequence = moving_average(self.tokens_per_sequence, key.tokens / key.sequences, self.keyed)
        self.keyed += 1
        if blocks[at]:
            self.overlapped += 1
        if at < events:
            self.by_events += 1
            # A leading run held with nothing guessed needs no second look.
            kv.index.predict(key.hashes(kv.index.block_size), now, blocks[at] if not guessed[at] else 0)
        else:
            self.by_tree += 1
        self.fallback.learn(best, key.tree)
        return best

    @staticmethod
    def _overlaps(key: _Key, kvs: list[WorkerKV], now: float) -> dict[KVIndex, tuple[int, int]]:
        """The (blocks, predicted only) overlap of ``key`` on each of ``kvs``
        scored by events, by index: :meth:`choose`'s walks (one per shared
        index and block size) for a list of workers."""
        roster = _Roster([(kv.worker, kv) for kv in kvs])
        out: dict[KVIndex, tuple[int, int]] = {}
        for shared, block, mask, _ in roster.groups:
            out.update(shared.overlaps(key.hashes(block), [kv.index for kv in roster.kvs if kv.index.shared is shared
                                                           and kv.index.block_size == block], now))
        return out

    def active(self, worker: Candidate, kv: WorkerKV) -> float:
        """Tokens the requests running on ``worker`` hold in its KV cache
        (Dynamo's decode blocks, in tokens): this replica's own, each its
        prompt (times its samples) and the output tokens its leg produced
        so far, read from the worker's in-flight legs; plus the other
        replicas' requests in the engine's last load reading
        (:meth:`.kv_worker.WorkerKV.read`), each at :attr:`tokens_per_sequence`."""
        own = 0
        for leg in worker.inflight:
            key = getattr(leg, "route_key", None)
            key = getattr(key, "policy_key", key)  # a RouteKey's policy key
            if isinstance(key, _Key):
                own += key.tokens + leg.attempt.tokens
        return own + kv.others * self.tokens_per_sequence

    def forget(self, worker: Candidate) -> None:
        """``worker``'s cache is gone (flushed, or the worker lost): drop its
        blocks, predictions and tree."""
        kv = self.workers.get(worker.id)
        if kv is not None:
            kv.index.reset("forgotten")
        self.fallback.forget(worker)

    def service(self, worker: Any) -> Callable[[], Awaitable[None]]:
        """``worker``'s tasks: its subscriber service
        (:func:`.kv_sources.follow_events`) and, with a ``load_interval``,
        its engine's load readings (:func:`.kv_loads.read_loads`)."""

        async def both() -> None:
            kv = self._kv(worker)
            async with anyio.create_task_group() as tg:
                tg.start_soon(follow_events, worker, kv, self.sources.get(worker.url))
                if self.load_interval > 0 and worker.id not in self.loads_shared:
                    tg.start_soon(read_loads, worker, kv, self.load_interval, self.load_idle_interval, self.clock)

        return both

    def load_share(self, worker: Any) -> KVLoads | None:
        """With a ``load_interval``: ``worker``'s load readings as another
        reader of the same route takes them for the policy (admission's),
        whose turns and bookkeeping they are; the policy's own reader then
        does not run for it. Ask before its :meth:`service` starts."""
        if self.load_interval <= 0:
            return None
        self.loads_shared.add(worker.id)
        return KVLoads(worker, self._kv(worker), self.load_interval, self.load_idle_interval, self.clock)

    def metrics(self) -> list[tuple[str, str, float]]:
        """Per worker: its subscriber's counters, its index's blocks, the
        blocks predicted and confirmed (``asgi_generate_kv_events``)."""
        rows = []
        for wid, kv in self.workers.items():
            index, sub = kv.index, kv.subscriber
            rows += [(wid, "index_blocks", index.blocks), (wid, "predicted", index.predicted),
                     (wid, "confirmed", index.confirmed), (wid, "load_readings", kv.readings)]
            if kv.engine is not None:
                rows += [(wid, "engine_requests", kv.engine.requests), (wid, "others_requests", kv.others)]
            if sub is not None:
                rows += [(wid, name, getattr(sub, name))
                         for name in ("batches", "events", "gaps", "replays", "rebuilds", "restarts")]
        return rows

    def stats(self) -> dict[str, Any]:
        """Decisions by source, and per worker where its blocks come from,
        its index, its subscriber's counters and its load (the engine's
        reading, and the tokens its running requests hold:
        :meth:`active`)."""
        workers = {}
        predicted = confirmed = 0
        for wid, kv in sorted(self.workers.items()):
            sub = kv.subscriber
            row = {"source": "events" if sub is not None else "tree", **kv.index.stats()}
            if sub is not None:
                row["subscriber"] = sub.stats()
            else:
                row["why_tree"] = kv.why_tree
            row["load"] = ({"engine_requests": kv.engine.requests, "engine_waiting_tokens": kv.engine.waiting_tokens,
                            "others": kv.others, "readings": kv.readings, "skipped_idle": kv.skipped}
                           if kv.engine is not None else {"own_counts": kv.why_own, "readings": kv.readings})
            row["load"]["active_tokens"] = round(self.active(kv.worker, kv))
            predicted += kv.index.predicted
            confirmed += kv.index.confirmed
            workers[wid] = row
        return {
            **super().stats(),
            "by_events": self.by_events, "by_tree": self.by_tree, "overlapped": self.overlapped,
            "prediction_hit_ratio": round(confirmed / predicted, 4) if predicted else None,
            "overlap_weight": self.overlap_weight, "queued_weight": self.queued_weight,
            "load_weight": self.load_weight, "active_weight": self.active_weight, "ttl": self.ttl,
            "load_interval": self.load_interval, "load_idle_interval": self.load_idle_interval,
            "workers": workers,
        }


def _tail(key: _Key) -> bytes:
    """What the tie-break hashes of ``key``: its last 64 tokens or characters."""
    return key.tree[max(1, len(key.tree) - 64):].encode("utf-32-le", "surrogatepass")

