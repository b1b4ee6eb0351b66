"""The simulator's engine: running requests, aborts, timing and counters.

Protocol front-ends (``sim/sglang.py``, ...) turn HTTP requests into
:class:`Job` objects and drive :meth:`SimEngine.tokens`; the engine decides
the tokens (through :class:`~asgi_generate.sim.model.Model`), when they come
(TTFT, ITL) and whether a request was aborted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

import anyio

from .capacity import Capacity
from .capacity_flags import CapacityConfig
from .model import Model, Step
from .block_hash import EMPTY, BlockHasher, Chain, SGLangPageHashes
from .prefix_cache import DEFAULT_CACHE_TOKENS, PrefixCache

if TYPE_CHECKING:
    from .kv_events import KVEventPublisher

#: Request ids each ``/sim/stats`` list keeps (``seen_rids``,
#: ``aborted_rids``, ``disconnect_aborted_rids``, ``abort_named_ids``): the
#: newest, beside an exact count of all (``*_total``), so the simulator's
#: memory stays flat over any number of requests.
RECENT_RIDS = 10_000


class DuplicateRequestId(Exception):
    """A request id that is already running was submitted again."""


class SimFault(Exception):
    """A fault armed with ``POST /sim/faults`` fired: raised out of the
    request's handler so that the server drops its connection mid-answer,
    as a crashing engine process does."""


@dataclass(slots=True)
class Job:
    """One generation request inside the engine.

    ``max_new_tokens`` is the cap on generated tokens; a token in
    ``stop_token_ids`` (or the model's EOS unless ``ignore_eos``) ends the
    request with ``stop``. ``logit_bias`` (token id to bias) re-ranks every
    step; ``refused`` is ``(status, message)`` when the scheduler refuses the
    request before its first token (it still runs as an abort).
    ``prefilled`` is the first token when another server prefilled the
    prompt (a P/D decode leg): it comes at once, without the TTFT.
    ``kv_cached`` is what a P/D decode that received the prompt's KV
    reports as ``cached_tokens`` (its own prefix cache is then not
    matched); ``None`` when it prefilled the prompt itself.
    """

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    refused: tuple[int, str] | None = None
    prefilled: int | None = None
    fail_after: int | None = None
    #: The armed fault stalls the job (no token, no error, health up)
    #: until it is aborted, instead of dropping its connection.
    stall: bool = False
    #: A P/D prefill leg's armed failure: ``("before", 0)`` ends it with
    #: an abort before its KV is handed over, ``("after", s)`` ``s``
    #: seconds after (``POST /sim/faults`` ``prefill_abort``).
    prefill_fault: tuple[str, float] | None = None
    #: The parallel sample this job draws (see :meth:`Model.sampled`); 0
    #: for every ``n`` = 1 request.
    sample: int = 0
    aborted: bool = False
    #: Aborted while in the waiting queue (not yet scheduled, or retracted
    #: or preempted back to it), not in the running batch: SGLang words
    #: the two aborts differently (:meth:`SimEngine.queued`).
    aborted_queued: bool = False
    abort_event: anyio.Event = field(default_factory=anyio.Event)
    namespace: tuple[str | None, ...] = ()
    cached_tokens: int = 0
    kv_cached: int | None = None
    output_ids: list[int] = field(default_factory=list)
    #: The cache keys hashed so far (of a prefix of the prompt, then of
    #: prompt and output): each cache look-up goes on from there.
    chain: Chain = EMPTY
    prefill_done: bool = False
    #: Steps generated so far (``/sim/stats``' ``running_output_tokens``).
    generated: int = 0
    #: The request's ``priority`` (scheduled by it only under the capacity
    #: model's priority scheduling), and the sequences it runs (vLLM ``n``).
    priority: int | None = None
    seqs: int = 1


@dataclass(slots=True)
class Token:
    """One generated token: its id, the step it was drawn from (its pick
    first), and how the request finishes with it (``None``,
    ``("stop", matched)``, ``("length", n)`` or ``("abort", (status,
    message))``)."""

    token_id: int
    step: Step
    finish: tuple[str, object] | None


class SimEngine:
    """Holds the running jobs and the counters ``/sim/stats`` reports.

    Args:
        model: the deterministic model.
        ttft_s: seconds before the first token.
        itl_s: seconds between tokens.
        script: token ids every answer starts with (``sim --emit-markers``):
            a prompt that already ends with the first ``k`` of them continues
            at ``k``, so a resumed leg goes on where the first stopped.
        abort_after: end every request after this many tokens with an
            ``abort`` finish carrying ``abort_status`` (``sim --abort-after``),
            as SGLang ends a request whose KV transfer failed.
        abort_status: the HTTP status of that abort.
        cache_tokens: the prefix cache's capacity in tokens (``sim
            --cache-tokens``, default :data:`~asgi_generate.sim.prefix_cache.DEFAULT_CACHE_TOKENS`; 0: no
            cache, every prompt computed whole).
        cache_block: the cache's unit: a hit counts whole blocks only (1 for
            SGLang's radix cache at page size 1; 16 for vLLM's default block
            size, ``vllm/v1/core/kv_cache_manager.py``).
        whole_runs: evict whole radix nodes (SGLang), not single blocks
            (vLLM); see :class:`~asgi_generate.sim.prefix_cache.PrefixCache`.
        hasher: the engine's block hashes, which the cache keys blocks by
            and KV events publish (:mod:`asgi_generate.sim.block_hash`;
            ``None``: SGLang's).
        prefill_us_per_token: prefill compute per uncached prompt token, in
            microseconds (``sim --prefill-us-per-token``). Prefills share
            one compute unit, one after another in arrival order, as a busy
            engine's batches do: a request's first token comes after the
            prefills before it, its own, then ``ttft_s``.
        capacity: the engine's scheduler limits and step costs
            (:mod:`asgi_generate.sim.capacity`); ``None`` (the default):
            unbounded, timed by ``ttft_s``/``itl_s``/``prefill_us_per_token``.
            With it, the step time alone times every token.
        abort_forwards_once: an abort of a running request still gives it
            the token of the forward pass it is in (SGLang: the scheduler's
            ``abort_request`` sets ``to_finish``, and the next batch result
            appends its token before ``update_finish_state`` finishes it
            with the abort); off, it stops at once (vLLM frees it).

    The prefix cache (a :class:`~asgi_generate.sim.prefix_cache.PrefixCache`
    of token blocks in namespaces, LRU) is matched when a prefill starts and takes the
    prompt once its prefill is done, and the
    prompt with its output when the request ends, aborted or not, as
    SGLang's ``cache_unfinished_req``/``cache_finished_req`` do. A prompt's
    hit is the longest prefix held, at most all but its last token (SGLang
    ``Req._compute_max_prefix_len``, vLLM ``max_cache_hit_length``: the
    last token is computed for its logits), in whole ``cache_block``
    blocks. Running requests' prefixes are not pinned against eviction.
    """

    def __init__(
        self,
        model: Model,
        ttft_s: float = 0.0,
        itl_s: float = 0.0,
        *,
        script: tuple[int, ...] = (),
        abort_after: int | None = None,
        abort_status: int = 503,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
        cache_block: int = 1,
        whole_runs: bool = True,
        prefill_us_per_token: float = 0.0,
        hasher: BlockHasher | None = None,
        capacity: CapacityConfig | None = None,
        abort_forwards_once: bool = False,
    ) -> None:
        self.model = model
        self.abort_forwards_once = abort_forwards_once
        self.capacity = Capacity(capacity, self._match, self._prefilled) if capacity is not None else None
        self.hasher: BlockHasher = hasher if hasher is not None else SGLangPageHashes()
        #: Where the cache's KV events go (``sim --kv-events-config``).
        self.events: KVEventPublisher | None = None
        self.cache = PrefixCache(cache_tokens, cache_block, whole_runs) if cache_tokens > 0 else None
        self.cache_tokens = cache_tokens
        self.prefill_s_per_token = prefill_us_per_token / 1e6
        #: One prefill computes at a time (a busy engine's prefill batches).
        self._prefill_unit = anyio.Lock()
        #: Prompt tokens prefilled here, and how many of them the cache served.
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.cache_flushes = 0
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.script = script
        self.abort_after = abort_after
        self.abort_status = abort_status
        self.running: dict[str, Job] = {}
        #: Jobs queued for the prefill unit (by ``id``): the engines' waiting
        #: queue, the rest of ``running`` their running batch.
        self.waiting: dict[int, Job] = {}
        self.received = 0
        #: Generate requests that arrived, refused ones included.
        self.generate_requests = 0
        self.completed = 0
        self.aborted_rids: deque[str] = deque(maxlen=RECENT_RIDS)
        self.aborted_total = 0
        self.abort_requests = 0
        self.disconnects = 0
        self.disconnect_aborted_rids: deque[str] = deque(maxlen=RECENT_RIDS)
        self.abort_named_ids: deque[str] = deque(maxlen=RECENT_RIDS)
        self.abort_named_total = 0
        self.seen_rids: deque[str] = deque(maxlen=RECENT_RIDS)
        #: Armed faults: (token count after which a request fails, the
        #: prompt length it must have or ``None`` for any, whether it stalls).
        self.faults: list[tuple[int, int | None, bool]] = []
        self.faults_fired = 0
        #: Armed prefill failures, each for the next prefill leg
        #: (:attr:`Job.prefill_fault`).
        self.prefill_faults: list[tuple[str, float]] = []
        #: A fault fired: health routes answer 503 until the faults are cleared.
        self.down = False
        #: Requests carrying several items (an SGLang batch or ``n`` > 1, a
        #: vLLM ``n`` > 1) and the items (entries, choices) they carried.
        self.batch_requests = 0
        self.batch_items = 0
        #: Scheduling held (SGLang ``/pause_generation``, vLLM ``/pause``):
        #: running and new jobs make no progress until :meth:`release`.
        self.held = False

    def arm(self, count: int, after_tokens: int, input_len: int | None = None, stall: bool = False) -> None:
        """Make the next ``count`` submitted requests (with a prompt of
        ``input_len`` tokens, if given) fail after ``after_tokens``
        generated tokens (0: right after the response headers),
        deterministically (``POST /sim/faults``): drop their connection, or
        with ``stall`` send nothing more (the worker stays healthy) until
        they are aborted."""
        self.faults.extend([(after_tokens, input_len, stall)] * count)

    def clear_faults(self) -> None:
        """Disarm every fault and answer health probes again (``DELETE /sim/faults``)."""
        self.faults.clear()
        self.prefill_faults.clear()
        self.down = False

    def submit(self, job: Job) -> None:
        """Register ``job`` as running.

        Raises:
            DuplicateRequestId: a job with the same rid is running.
        """
        if job.rid in self.running:
            raise DuplicateRequestId(job.rid)
        self.received += 1
        self.seen_rids.append(job.rid)
        for i, (after, length, stall) in enumerate(self.faults):
            if length is None or length == len(job.input_ids):
                job.fail_after, job.stall = after, stall
                del self.faults[i]
                break
        self.running[job.rid] = job
        if self.capacity is not None and job.refused is None:
            self.capacity.enter(job, len(job.input_ids), job.max_new_tokens, job.seqs, job.priority,
                                prefilled=job.prefilled is not None)

    def finish(self, job: Job) -> None:
        """Remove ``job`` from the running set and count it completed."""
        if self.capacity is not None:
            self.capacity.leave(job)
        if self.running.get(job.rid) is job:
            del self.running[job.rid]
            self.completed += 1
            self._cache_finished(job)

    def _cache_finished(self, job: Job) -> None:
        if self.cache is not None and job.prefill_done:
            self._insert(job, [*job.input_ids, *job.output_ids])

    def _insert(self, job: Job, ids: list[int]) -> None:
        cache = self.cache
        job.chain = self.hasher.extend(job.chain, ids, cache.block, job.namespace)
        keys = job.chain.keys
        held, gone = cache.insert(keys)
        if self.events is not None:
            wire, events, published = self.events.wire, [], self.hasher.published
            if held < len(keys):
                parent = published(keys[held - 1]) if held else None
                b = cache.block
                events.append(wire.stored([published(k) for k in keys[held:]], parent, ids[held * b : len(keys) * b],
                                          job.namespace))
            if gone:
                events.append(wire.removed([published(k) for k in gone]))
            self.events.publish(events)

    def flush_cache(self) -> None:
        """Empty the prefix cache (SGLang ``/flush_cache``, vLLM
        ``/reset_prefix_cache``)."""
        self.cache_flushes += 1
        if self.cache is not None:
            self.cache.clear()
            if self.events is not None:
                self.events.publish([self.events.wire.cleared()])

    async def _prefill(self, job: Job) -> None:
        """Run ``job``'s prefill: match its prompt against the cache (setting
        ``cached_tokens``), spend the compute of its uncached tokens, one
        prefill at a time in arrival order, and cache the prompt. The match
        is taken when the prefill starts, as SGLang's scheduler takes it
        when it schedules a request: a prompt queued behind its twin hits."""
        if self.prefill_s_per_token > 0:
            self.waiting[id(job)] = job
            try:
                await self._prefill_unit.acquire()
            finally:
                del self.waiting[id(job)]
            try:
                if not job.aborted:
                    self._match(job)
                    await self._pause(job, (len(job.input_ids) - job.cached_tokens) * self.prefill_s_per_token)
            finally:
                self._prefill_unit.release()
        else:
            self._match(job)
        self._prefilled(job)

    def _prefilled(self, job: Job) -> None:
        """``job``'s prompt is computed: cache it."""
        if self.cache is not None and not job.aborted:
            job.prefill_done = True
            self._insert(job, job.input_ids)

    def _match(self, job: Job) -> None:
        prompt = len(job.input_ids)
        cache = self.cache
        if job.kv_cached is not None:
            job.cached_tokens = job.kv_cached
        elif cache is not None and prompt:
            block = cache.block
            # The last prompt token is computed for its logits: never a hit.
            usable = job.input_ids[: (prompt - 1) // block * block]
            job.chain = self.hasher.extend(job.chain, usable, block, job.namespace)
            job.cached_tokens = cache.match(job.chain.keys) * block
        self.prompt_tokens += prompt
        self.cached_tokens += job.cached_tokens

    def abort(self, rid: str | None, abort_all: bool = False) -> list[str]:
        """Abort every running job whose rid starts with ``rid`` (SGLang's
        scheduler matches by prefix), or all of them; return the rids hit.
        Aborted jobs leave the running set (and count as completed) at once.

        An unknown or empty rid aborts nothing, silently, as SGLang does.
        """
        self.abort_requests += 1
        if rid:
            self.abort_named_ids.append(rid)
            self.abort_named_total += 1
        return self._stop([r for r in self.running if abort_all or (rid and r.startswith(rid))])

    def abort_ids(self, rids: list[str]) -> list[str]:
        """Abort the running jobs whose rid is exactly one of ``rids`` (vLLM
        matches whole ids), as :meth:`abort` does; unknown ids are ignored.
        Returns the rids hit. Every named id is recorded, hit or not, apart
        from the engine's own disconnect aborts (:meth:`disconnected`)."""
        self.abort_requests += 1
        self.abort_named_ids.extend(rids)
        self.abort_named_total += len(rids)
        return self._stop([r for r in dict.fromkeys(rids) if r in self.running])

    def disconnected(self, job: Job) -> None:
        """The client of ``job`` went away: abort it, as an engine that
        cancels on disconnect does (vLLM's ``with_cancellation``); it leaves
        the running set at once, as every abort does (:meth:`_stop`)."""
        self.disconnects += 1
        self.disconnect_aborted_rids.append(job.rid)
        self.finish(job)
        job.aborted = True
        job.abort_event.set()

    def queued(self, job: Job) -> bool:
        """Whether ``job`` waits in the engine's waiting queue rather than
        running: with the capacity model, not admitted (or retracted or
        preempted back); without it, queued for the prefill unit."""
        if self.capacity is not None:
            entry = self.capacity.entries.get(id(job))
            return entry is not None and not entry.running
        return id(job) in self.waiting

    def abandon(self, job: Job) -> None:
        """The engine's own abort of ``job`` (SGLang's, of a vanished
        client's request): it stops at its next token and leaves the
        scheduler at once; it stays running until its handler ends."""
        job.aborted_queued = self.queued(job)
        job.aborted = True
        job.abort_event.set()
        if self.capacity is not None:
            self.capacity.leave(job)

    def _stop(self, hit: list[str]) -> list[str]:
        for r in hit:
            # The engine frees an aborted request at once, even while its
            # HTTP response is still blocked on a slow reader.
            job = self.running.pop(r)
            job.aborted_queued = self.queued(job)
            if self.capacity is not None:
                self.capacity.leave(job)
            self.completed += 1
            job.aborted = True
            job.abort_event.set()
            self._cache_finished(job)
        self.aborted_rids.extend(hit)
        self.aborted_total += len(hit)
        return hit

    def abort_all(self) -> list[str]:
        """Abort every running job (a pause in ``abort`` mode); not counted
        as an abort request."""
        return self._stop(list(self.running))

    def hold(self) -> None:
        """Hold scheduling: no job gets another token until :meth:`release`."""
        self.held = True

    def release(self) -> None:
        """Let held jobs go on."""
        self.held = False

    async def _while_held(self, job: Job) -> None:
        # Polled: a held engine is an admin moment, never the hot path.
        while self.held and not job.aborted:
            await anyio.sleep(0.01)

    async def _pause(self, job: Job, seconds: float) -> None:
        if seconds > 0:
            with anyio.move_on_after(seconds):
                await job.abort_event.wait()

    async def tokens(self, job: Job) -> AsyncIterator[Token]:
        """Generate ``job``'s tokens (its own ``sample``), honouring TTFT,
        ITL and aborts.

        Stops after the finishing token; stops early (yielding nothing more)
        when the job is aborted, leaving ``job.aborted`` set.
        """
        async for step in self.samples(job, (job.sample,)):
            yield step[0][1]

    async def samples(self, job: Job, samples: tuple[int, ...]) -> AsyncIterator[list[tuple[int, Token]]]:
        """Generate the parallel ``samples`` of ``job`` in lockstep (vLLM's
        ``n`` children share one engine step): each step yields ``(sample,
        token)`` for every sample still running, in the order given. Timing,
        holds, faults and aborts as :meth:`tokens`.
        """
        model = self.model
        origin = model.origin
        start = model.fold(job.input_ids)
        states = dict.fromkeys(samples, start)
        outs: dict[int, list[int]] = {sample: [] for sample in samples}
        script = self.script[self._script_start(job.input_ids) :]
        capacity = self.capacity  # with it, the scheduler times every token
        if capacity is None and job.prefilled is None:
            await self._prefill(job)
            await self._pause(job, self.ttft_s)
        for i in range(job.max_new_tokens):
            if self.held:
                await self._while_held(job)
            last = job.aborted
            if not last and capacity is not None and not await capacity.next_token(job):
                last = job.aborted
                if not last:  # gone unaborted: refused by a full queue
                    return
            if last:
                if not self._forwards_once(job):
                    return
            elif i == job.fail_after and job.stall:
                self.faults_fired += 1
                await job.abort_event.wait()
                return
            if model.origin != origin:  # new weights loaded mid-stream: the rest is theirs
                origin = model.origin
                states = {s: model.fold([*job.input_ids, *outs[s]]) for s in states}
            if i == job.fail_after and not last:
                self.faults_fired += 1
                self.down = True
                raise SimFault(f"simulated worker failure after {i} tokens (POST /sim/faults)")
            step = []
            for sample, state in states.items():
                token = self._draw(job, state, sample, i, script)
                if last:  # the abort, not a stop or a cap, finishes it (to_finish comes first)
                    token = Token(token.token_id, token.step, None)
                states[sample] = model.advance(state, token.token_id)
                outs[sample].append(token.token_id)
                step.append((sample, token))
            if self.cache is not None:  # the first sample's output is what gets cached
                job.output_ids.append(step[0][1].token_id)
            job.generated += 1
            yield step
            if last:
                return
            for sample, token in step:
                if token.finish is not None:
                    del states[sample]
            if not states:
                return
            if self.itl_s > 0 and capacity is None:
                await self._pause(job, self.itl_s)
            else:  # a batching engine serves everyone: never hog the loop
                await anyio.lowlevel.checkpoint()

    def _forwards_once(self, job: Job) -> bool:
        """Whether aborted ``job`` gets the token of the forward pass it is
        in (``abort_forwards_once``): it was running, not waiting, and not
        refused."""
        return self.abort_forwards_once and not job.aborted_queued and job.refused is None

    def _draw(self, job: Job, state: int, sample: int, i: int, script: tuple[int, ...]) -> Token:
        """The ``i``-th token of ``sample`` at the prefix of ``state``."""
        model = self.model
        step = model.step(model.sampled(state, sample))
        if job.logit_bias:
            step = model.biased(step, job.logit_bias)
        if i < len(script):
            step = model.forced(step, script[i])
        if i == 0 and job.prefilled is not None:
            step = model.forced(step, job.prefilled)
        tok = step.token
        if tok in job.stop_token_ids or (tok == model.eos_id and not job.ignore_eos):
            finish: tuple[str, object] | None = ("stop", tok)
        elif i + 1 == self.abort_after:
            message = f"simulated abort after {i + 1} tokens (sim --abort-after)"
            finish = ("abort", (self.abort_status, message))
        elif i + 1 == job.max_new_tokens:
            finish = ("length", job.max_new_tokens)
        else:
            finish = None
        return Token(tok, step, finish)

    def _script_start(self, prompt: list[int]) -> int:
        """How much of the script ``prompt`` already ends with."""
        script = self.script
        for k in range(min(len(script), len(prompt)), 0, -1):
            if prompt[-k:] == list(script[:k]):
                return k
        return 0

    def load(self) -> tuple[int, int, int]:
        """``(running, waiting, waiting uncached tokens)``: the requests
        past their prefill's start, those queued for it, and the queued
        prompts' tokens times the cache's miss rate so far (SGLang
        ``SchedulerLoadInquirer.get_num_waiting_uncached_tokens`` when its
        waiting queue is not prefix-matched yet)."""
        miss = 1.0 - self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 1.0
        if self.capacity is not None:
            running, waiting = self.capacity.sequences()
            uncached = sum(int((e.need - e.computed) * miss) for e in self.capacity.waiting)
            return running, waiting, uncached
        waiting = len(self.waiting)
        uncached = sum(int(len(job.input_ids) * miss) for job in self.waiting.values())
        return max(0, len(self.running) - waiting), waiting, uncached

    def stats(self) -> dict:
        """The ``/sim/stats`` body (``capacity``: the scheduler's figures,
        with the capacity model only)."""
        stats = {
            "running": len(self.running),
            "running_rids": sorted(self.running),
            # A test waits on these to act mid-generation instead of sleeping.
            "running_output_tokens": {rid: job.generated for rid, job in sorted(self.running.items())},
            "received": self.received,
            "generate_requests": self.generate_requests,
            "completed": self.completed,
            "aborted_rids": list(self.aborted_rids),
            "aborted_total": self.aborted_total,
            "abort_requests": self.abort_requests,
            "disconnects": self.disconnects,
            "disconnect_aborted_rids": list(self.disconnect_aborted_rids),
            "abort_named_ids": list(self.abort_named_ids),
            "abort_named_total": self.abort_named_total,
            "seen_rids": list(self.seen_rids),
            # Each rid list above holds the newest RECENT_RIDS; the counts are of all.
            "recent_rids_max": RECENT_RIDS,
            "batch_requests": self.batch_requests,
            "batch_items": self.batch_items,
            "faults_armed": len(self.faults),
            "faults_fired": self.faults_fired,
            "down": self.down,
            "cache": {
                "capacity_tokens": self.cache_tokens,
                "tokens": self.cache.tokens if self.cache is not None else 0,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "evicted_tokens": self.cache.evicted_blocks * self.cache.block if self.cache is not None else 0,
                "flushes": self.cache_flushes,
            },
        }
        if self.capacity is not None:
            stats["capacity"] = self.capacity.stats()
        return stats
