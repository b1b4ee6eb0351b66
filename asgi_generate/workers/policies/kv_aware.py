"""KV-aware routing: score each worker by what its engine says it caches.

Each worker's engine publishes KV cache events (vLLM ``--kv-events-config``,
SGLang ``--kv-events-config``); a subscriber per worker
(:class:`~asgi_generate.workers.kv_events.Subscriber`) keeps that worker's
:class:`~asgi_generate.workers.kv_index.KVIndex`. Where to subscribe comes
from the worker itself (vLLM ``GET /kv_event_sources``, 0.32 and later;
SGLang ``/server_info``'s ``kv_events``), or is given per worker
(``--kv-events URL=ENDPOINT[+REPLAY]``). A wildcard host (``*``,
``0.0.0.0``, ``::``) is the worker URL's host.

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
request count of the engine's load reading (below), each taken at the
prompt tokens per sample of the requests this replica routed (a moving
average). With them a worker busy with long requests weighs more than one
busy with as many short ones, as in Dynamo's KV router
(``overlap_weight x prefill blocks + decode blocks``).

The defaults (``overlap_weight`` 1.25, ``queued_weight`` 0,
``load_weight`` 128, ``active_weight`` 0) were chosen on ``bench/bench_routing.py``'s four
workloads (figures in ``bench/README.md``):

- The queue is off by default. Waiting behind a queued prefill costs the
  request about what computing its prefix again elsewhere would, so at
  weight 1 it moved conversation turns and a shared system prompt off
  their worker at every short queue; the copy elsewhere then took cache
  room from other prompts and split the prefix's later requests between
  two workers (the benchmark's former made-up 72-row Mooncake-format
  sample through one process: hit ratio 0.59 at
  weight 1, 0.60-0.66 a run at 0.1, 0.664 every run at 0).
- A held token counts 1.25 prompt tokens, so a worker holding a prefix
  keeps it a margin past the load at which a copy elsewhere only breaks
  even: at weight 1 a GRPO group's 1,024-token system prefix tied with
  8 requests (8 x 128), and at four replicas, whose load readings lag,
  the next group tied often and went to a second worker (hit ratio 0.96
  against 0.978).
- The running requests' tokens are off by default. At 0.05 to 0.15 a
  token (with ``load_weight`` 128, or 0 at 0.1 and 0.15) GRPO groups
  alternated between two workers (hit ratio 0.959 against 0.978, mean
  TTFT 50 against 56 ms at one replica, one sitting) or stayed on one,
  and the former made-up Mooncake-format sample through one process fell
  from 0.664 to 0.615 in
  every such run: long conversation turns running on a worker pushed the
  one-shot requests' shared system prompt off it, and the copies took
  cache room from the conversations. At 0.02 nothing moved.

The requests on ``w`` are the whole fleet's, not this replica's alone: this
replica's own outstanding requests now, plus the others' as the engine
last counted them: its running and waiting requests
(:mod:`~asgi_generate.workers.engine_load`: SGLang ``GET /v1/loads``, vLLM
``GET /metrics``), read every ``load_interval`` seconds (an idle
engine's less often: :meth:`KVAwarePolicy.read_due`), less this
replica's outstanding ones at that reading. Every replica reads the same
engines, so replicas weigh the same load and spread new prompts as one
router would; a replica counting only its own requests sees a quarter of
the load at four replicas and piles new prompts onto workers the others
filled. Its own requests it counts fresh, never from a stale reading: one
replica alone routes exactly as without readings. Requests count in the
engine's units: a request of ``n`` samples is ``n`` (the engines run each
sample as a request), by a moving average of the samples per request this
replica routed to ``w``, seeded by the first (so a replica's first
groups of ``n`` count as ``n``, not as 1 and then a fraction of the way
to ``n``: every replica's first groups went to one worker). Without a
reading (``load_interval`` 0, a worker that does not serve the route) the others
count 0, and ``/stats`` says why.

The lowest cost wins; ties go to the worker whose cache holds the fewest
tokens (its engine's blocks and this replica's predictions: as
sglang-router's ``cache_aware`` sends a miss to its smallest tree, but
counted from the engine's own cache, the same in every replica, so that
replicas spread new prompts where the caches have room), then to the
fewest requests, then to a
rendezvous hash of the prompt's last 64 tokens and the worker's URL (the
same for a request's siblings, different for prompts that share only a
system prefix: hashing the first tokens sent every replica's first GRPO
group to one worker), so that every frontend replica fed the same events picks the same worker at the
same loads (``serve --workers N``, several hosts behind a balancer). The
winner's blocks are then predicted on it for ``ttl`` seconds (sibling
placement, :mod:`~asgi_generate.workers.kv_index`).

A worker that publishes no events (no discovery answer, publishing off) is
scored by an approximate prefix tree of the prompts this process sent it,
as ``cache-aware`` keeps, and ``/stats`` says so (``source: tree`` and
why). A request without token ids (a text prompt) is routed by those trees
for every worker: the engine's blocks are of tokens the frontend cannot
compute.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence
from urllib.parse import urlsplit

import anyio
import orjson

from ..block_hash import ROOT, block_hashes, namespace_seed
from ..engine_load import LOAD_PATHS, EngineLoad, parse_load
from ...exceptions import WorkerError
from ..kv_events import Source, Subscriber
from ..kv_index import KVIndex, SharedBlocks
from . import Candidate, Least, Policy, W
from .cache_aware import CacheAwarePolicy, prompt_ids, tree_key

if TYPE_CHECKING:
    from ...sdk.codec import GenerateRequest

log = logging.getLogger("asgi_generate.kv_aware")
#: Seconds a discovery request may take.
DISCOVERY_TIMEOUT_S = 5.0
#: Seconds between looks at a worker waiting to be up, or to come back.
WATCH_S = 0.2
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


def _dial(endpoint: str, host: str) -> str:
    """``endpoint`` with a wildcard host replaced by ``host``."""
    rest = endpoint[len("tcp://"):]
    name, _, port = rest.rpartition(":")
    return f"tcp://{host}:{port}" if name in _WILDCARDS else endpoint


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


def _moving_average(average: float, sample: float, samples_before: int) -> float:
    """``average`` moved a fifth of the way to ``sample``, or ``sample``
    itself when it is the first (no start value to creep up from)."""
    return average + 0.2 * (sample - average) if samples_before else sample


class _WorkerKV:
    """What the policy keeps of one worker."""

    __slots__ = ("index", "worker", "subscriber", "why_tree", "engine", "others", "why_own", "readings", "peak",
                 "per_request", "routed", "read_at", "read_mark", "skipped")

    def __init__(self, index: KVIndex, worker: Candidate) -> None:
        self.index = index
        #: The worker itself (its in-flight legs, for ``/stats``).
        self.worker = worker
        self.subscriber: Subscriber | None = None
        self.why_tree = "discovering"
        #: The engine's last load reading, and the requests in it that
        #: other replicas sent.
        self.engine: EngineLoad | None = None
        self.others = self.readings = 0
        self.why_own = "no reading yet"
        #: The most requests this replica had outstanding here since the
        #: current reading was asked for.
        self.peak = 0
        #: Engine sequences per request this replica routed here (a moving
        #: average, seeded by the first): the engines count ``n`` samples
        #: as ``n`` requests.
        self.per_request = 1.0
        self.routed = 0
        #: When the last reading was taken (the policy's clock), what had
        #: happened here by then (:meth:`activity`), and the readings
        #: skipped as idle since the first (:meth:`KVAwarePolicy.read_due`).
        self.read_at = 0.0
        self.read_mark: tuple[int, int] = (-1, -1)
        self.skipped = 0

    def activity(self) -> tuple[int, int]:
        """What moves when anyone uses the worker: the requests this
        replica routed here, and the event batches its engine published
        (another replica's request is prefilled, and published, here)."""
        return self.routed, self.subscriber.batches if self.subscriber is not None else 0

    def requests(self, outstanding: int) -> float:
        """The fleet's requests here, in the engine's units, given this
        replica's ``outstanding`` ones."""
        return outstanding * self.per_request + self.others

    def read(self, load: EngineLoad | None, own: int) -> None:
        """Take an engine's ``load`` reading (``None``: none) while this
        replica had ``own`` requests outstanding there."""
        self.engine = load
        self.others = max(0, round(load.requests - own * self.per_request)) if load is not None else 0


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
            (:meth:`read_due`; 0: read every ``load_interval``).
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
        self.workers: dict[str, _WorkerKV] = {}
        #: The workers' indexes share one (one a 64 workers).
        self.shared = SharedBlocks()
        #: The fallback: its trees, one per worker routed to.
        self.fallback = CacheAwarePolicy(max_tree_tokens=max_tree_tokens, max_tree_nodes=max_tree_nodes)
        self.by_events = self.by_tree = self.overlapped = 0
        self.clock: Callable[[], float] = time.monotonic

    def _key(self, request: "GenerateRequest", headers: Mapping[bytes, bytes]) -> _Key | None:
        tree = tree_key(request)
        if tree is None:
            return None
        return _Key(prompt_ids(request), tree, request.cache_salt, len(request.items) if request.items else 1)

    def _kv(self, worker: Candidate) -> _WorkerKV:
        kv = self.workers.get(worker.id)
        if kv is None:
            if self.shared.full:
                self.shared = SharedBlocks()
            kv = self.workers[worker.id] = _WorkerKV(KVIndex(self.max_blocks, self.ttl, self.shared), worker)
        return kv


    def choose(self, candidates: Sequence[W], key: _Key, least: Least[W]) -> W:
        """See the module docstring."""
        now = self.clock()
        prompt = len(key.tree) - 1
        kvs = [self._kv(w) for w in candidates]
        overlaps = self._overlaps(key, kvs, now) if key.ids is not None else {}
        costs = []
        for w, kv in zip(candidates, kvs):
            index = kv.index
            queued = 0
            if index in overlaps:
                blocks, guessed = overlaps[index]
                held = blocks * index.block_size
                # Prefills queued here that this request does not share.
                queued = (index.pending - guessed) * index.block_size
                cached = (index.blocks + index.pending) * index.block_size
            else:
                tree = self.fallback.trees.get(w.id)
                held = tree.match(key.tree) - 1 if tree is not None else 0
                cached = tree.tokens if tree is not None else 0
            requests = kv.requests(w.outstanding)
            cost = self.overlap_weight * (prompt - held) + self.queued_weight * queued + self.load_weight * requests
            if self.active_weight:
                cost += self.active_weight * self.active(w, kv)
            costs.append((cost, cached, requests, -_rendezvous(w.url, key), held, w))
        *_, held, best = min(costs, key=lambda c: c[:4])
        kv = self._kv(best)
        kv.peak = max(kv.peak, best.outstanding + 1)
        kv.per_request = _moving_average(kv.per_request, key.sequences, kv.routed)
        kv.routed += 1
        self.tokens_per_sequence = _moving_average(self.tokens_per_sequence, key.tokens / key.sequences, self.keyed)
        self.keyed += 1
        if held:
            self.overlapped += 1
        walked = overlaps.get(kv.index)
        if walked is not None:
            self.by_events += 1
            # A leading run held with nothing guessed needs no second look.
            kv.index.predict(key.hashes(kv.index.block_size), now, walked[0] if not walked[1] else 0)
        else:
            self.by_tree += 1
        self.fallback.tree(best).insert(key.tree)
        return best

    @staticmethod
    def _overlaps(key: _Key, kvs: list[_WorkerKV], now: float) -> dict[KVIndex, tuple[int, int]]:
        """The (blocks, predicted only) overlap of ``key`` on each of ``kvs``
        scored by events: one walk per shared index and block size (one in
        all for a fleet of one engine kind)."""
        groups: dict[tuple[int, int], list[KVIndex]] = {}
        for kv in kvs:
            index = kv.index
            if kv.subscriber is not None and index.block_size:
                groups.setdefault((id(index.shared), index.block_size), []).append(index)
        out: dict[KVIndex, tuple[int, int]] = {}
        for (_, block), indexes in groups.items():
            out.update(indexes[0].shared.overlaps(key.hashes(block), indexes, now))
        return out

    def active(self, worker: Candidate, kv: _WorkerKV) -> float:
        """Tokens the requests running on ``worker`` hold in its KV cache
        (Dynamo's decode blocks, in tokens): this replica's own, each its
        prompt (times its samples) and the output tokens its leg produced
        so far, read from the worker's in-flight legs; plus the other
        replicas' requests in the engine's last load reading
        (:meth:`_WorkerKV.read`), each at :attr:`tokens_per_sequence`."""
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
        """``worker``'s tasks: its subscriber (once the worker is up, find
        where it publishes and follow its events until cancelled; a worker
        without events is scored by its tree, and asked again when it comes
        back) and its engine's load readings."""

        async def both() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(events)
                if self.load_interval > 0:
                    tg.start_soon(self._read_loads, worker)

        async def events() -> None:
            kv = self._kv(worker)
            try:
                while True:
                    while not worker.healthy:
                        await anyio.sleep(WATCH_S)
                    source, block_size, why = await self._discover(worker)
                    if source is None:
                        kv.why_tree = why
                        log.warning("worker %s (%s) publishes no KV events (%s): routed by its prefix tree",
                                    worker.id, worker.url, why)
                        while worker.healthy:
                            await anyio.sleep(WATCH_S)
                        continue
                    if block_size:
                        kv.index.block_size = block_size
                    kv.subscriber = Subscriber(source, kv.index)
                    kv.why_tree = ""
                    await kv.subscriber.run()
            finally:
                kv.subscriber = None

        return both

    async def _read_loads(self, worker: Any) -> None:
        """Read ``worker``'s engine load every ``load_interval`` seconds
        while it is up; on a failed reading count only this replica's
        requests until one succeeds."""
        kv = self._kv(worker)
        protocol = worker.protocol.name
        path = LOAD_PATHS.get(protocol)
        if path is None:
            kv.why_own = f"no load route known for {protocol}"
            return
        while True:
            if not worker.healthy:
                kv.read(None, 0)
                kv.why_own = "worker down"
                await anyio.sleep(WATCH_S)
                continue
            if not self.read_due(kv, worker.outstanding, self.clock()):
                kv.skipped += 1
                await anyio.sleep(self.load_interval)
                continue
            kv.read_at, kv.read_mark = self.clock(), kv.activity()
            # Own requests that ended shortly before the reading may still be
            # in the engine's count: subtract the most this replica had there
            # since the previous reading was asked for.
            window, kv.peak = kv.peak, worker.outstanding
            try:
                with anyio.fail_after(DISCOVERY_TIMEOUT_S):
                    async with worker.pool.request(b"GET", path) as resp:
                        body = await resp.read()
                if resp.status != 200:
                    raise ValueError(f"answered {resp.status}")
                kv.read(parse_load(protocol, body), max(window, kv.peak, worker.outstanding))
                kv.readings += 1
            except (TimeoutError, WorkerError, ValueError) as exc:
                why = f"GET {path.decode()}: {exc!r}"
                if why != kv.why_own:  # once per reason, not per reading
                    log.warning("worker %s (%s): no load reading (%s): weighed by this replica's own "
                                "requests", worker.id, worker.url, why)
                kv.read(None, 0)
                kv.why_own = why
            await anyio.sleep(self.load_interval)

    def read_due(self, kv: _WorkerKV, outstanding: int, now: float) -> bool:
        """Whether to read ``kv``'s engine load at ``now``, given this
        replica's ``outstanding`` requests there. An idle engine's reading
        cannot change: when its last reading counted no requests, this
        replica has none there, and since that reading it has neither
        routed one there nor seen its engine publish an event (a request
        another replica sent there is prefilled and published), the
        reading waits, up to ``load_idle_interval`` seconds after the last.
        A busy engine is read every ``load_interval`` seconds.
        """
        if kv.engine is None or kv.engine.requests or outstanding:
            return True
        return now - kv.read_at >= self.load_idle_interval or kv.activity() != kv.read_mark

    async def _discover(self, worker: Any) -> tuple[Source | None, int | None, str]:
        """Where ``worker`` publishes, its block size if it says, and why
        not when it does not."""
        host = urlsplit(worker.url).hostname or "127.0.0.1"
        given = self.sources.get(worker.url)
        if given is not None:
            return given, None, ""
        vllm = worker.protocol.name == "vllm"
        path = b"/kv_event_sources" if vllm else b"/server_info"
        try:
            with anyio.fail_after(DISCOVERY_TIMEOUT_S):
                async with worker.pool.request(b"GET", path) as resp:
                    body = await resp.read()
            if resp.status != 200:
                return None, None, f"GET {path.decode()} answered {resp.status}"
            info = orjson.loads(body)
        except (TimeoutError, WorkerError, orjson.JSONDecodeError) as exc:
            return None, None, f"GET {path.decode()} failed: {exc!r}"
        if vllm:
            config = info.get("0") if isinstance(info, dict) else None
            if not isinstance(config, dict) or config.get("publisher") != "zmq":
                return None, None, "GET /kv_event_sources lists no zmq publisher"
            replay = config.get("replay_endpoint")
            return (Source(_dial(config["endpoint"], host), replay and _dial(replay, host), config.get("topic") or ""),
                    None, "")
        events = info.get("kv_events") if isinstance(info, dict) else None
        if not isinstance(events, dict) or events.get("publisher") != "zmq":
            return None, None, "/server_info has no kv_events publisher"
        name = events.get("endpoint_host") or host
        dial = host if name in _WILDCARDS else name
        replay = events.get("replay_endpoint_port_base")
        source = Source(f"tcp://{dial}:{events['endpoint_port_base']}",
                        f"tcp://{dial}:{replay}" if replay is not None else None, events.get("topic") or "")
        return source, events.get("block_size"), ""

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


def _rendezvous(url: str, key: _Key) -> int:
    """The tie-break weight of ``url`` for ``key`` (its last 64 tokens or
    characters): the same in every process."""
    digest = hashlib.blake2b(url.encode(), digest_size=8)
    digest.update(key.tree[max(1, len(key.tree) - 64):].encode("utf-32-le", "surrogatepass"))
    return int.from_bytes(digest.digest(), "big")
