"""The engines' capacity, as the simulator plays it (off unless a flag sets a limit).

One scheduler per simulated engine, stepping a batch the way the released
schedulers do, closely enough that a frontend's admission shows in the
engine's own figures:

- SGLang 0.5.23 (``sglang/srt/managers/scheduler.py``,
  ``schedule_policy.py``, ``schedule_batch.py``): at most
  ``--max-running-requests`` running; a KV token pool of
  ``--max-total-tokens``; a waiting queue, FCFS or, with
  ``--enable-priority-scheduling``, by ``priority`` (larger first, or smaller
  with ``--schedule-low-priority-values-first``; a request without one takes
  the lowest; without it a priority is ignored, or aborted with 503 under
  ``--abort-on-priority-when-disabled``); ``--max-queued-requests``: past it the newcomer is aborted
  with status 503 ``"The request queue is full."``, or with priority
  scheduling the least preferred waiting request when the newcomer is
  strictly better (``"The request is aborted by a higher priority
  request."``, ``Scheduler._abort_on_queued_limit``). A new request is
  admitted while its prompt fits beside the decode reservation of the
  running ones (their remaining tokens times ``new_token_ratio``, from
  :data:`INIT_NEW_TOKEN_RATIO` decaying to :data:`MIN_NEW_TOKEN_RATIO` over
  :data:`NEW_TOKEN_RATIO_DECAY_STEPS` steps, ``PrefillAdder``); when a decode
  step does not fit, decoding requests are retracted, fewest output tokens
  (then longest prompt) first, keeping one (``ScheduleBatch.retract_decode``),
  back to the waiting queue, to recompute prompt and output later. With
  priority scheduling, a request that finds every seat taken preempts
  running ones (``PrefillAdder.preempt_to_schedule``, on unless
  ``--disable-priority-preemption``): least preferred first (then the
  latest into the queue), each while the newcomer is preferred by more
  than ``--priority-scheduling-preemption-threshold`` (default 10), until
  their reserved new tokens make room for it; they go back to the waiting
  queue and recompute later.
- vLLM 0.33.0 (``vllm/v1/core/sched/scheduler.py``): at most
  ``--max-num-seqs`` running sequences (an ``n`` > 1 request counts ``n``);
  a pool of ``--num-gpu-blocks-override`` blocks of ``--block-size``
  tokens; ``--max-num-batched-tokens`` per step, running requests first
  (chunked prefill); a waiting queue, FCFS or, with ``--scheduling-policy
  priority``, by ``(priority, arrival)`` smaller first; when a running
  request's next tokens do not fit, the last running request (priority: the
  largest ``(priority, arrival)``) is preempted back to the front of the
  waiting queue and recomputes later (``Scheduler._preempt_request``);
  ``--max-num-queued-reqs`` and ``--max-num-queued-tokens`` are checked by
  the API server (``AsyncLLM.check_admission``, see
  :meth:`Capacity.vllm_admission`).

Both count a request's KV as its prompt plus, per sequence, its output
tokens; cached tokens not held by a running request are free to evict, as
in both engines, so the prefix cache (:mod:`asgi_generate.sim.prefix_cache`)
is separate from the pool.

Time is a deterministic roofline per step: ``step_ms`` plus
``step_us_per_seq`` per scheduled sequence plus
``step_us_per_prefill_token`` per prefill token computed in that step. A
sequence gets one token per step; a prefill's first token comes at the end
of the step that computes its last prompt token. Retraction and preemption
change only when tokens come, never which: the tokens are the model's
function of the prefix.

The scheduler has no task of its own: whichever request is waiting for a
token drives the steps (:meth:`Capacity.next_token`), handing over to
another when it has its token or is aborted, so the model runs under any
ASGI server, or none, with no lifespan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import anyio

from .capacity_flags import CapacityConfig

#: SGLang's decode reservation ratio (``NewTokenRatioTracker``: its
#: environment's defaults ``SGLANG_INIT_NEW_TOKEN_RATIO`` 0.7 times
#: ``schedule_conservativeness`` 1, the minimum 0.14 of that, decayed per
#: decode step over ``SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS``; after a
#: retraction ``estimate_new_token_ratio_after_retract`` with
#: ``SGLANG_RETRACT_DECODE_STEPS``).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.7 * 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
#: SGLang's clip on a request's reserved new tokens (``CLIP_MAX_NEW_TOKENS``).
CLIP_MAX_NEW_TOKENS = 4096

#: The priority SGLang gives a request without one under priority
#: scheduling (``Scheduler._set_or_validate_priority``: ``sys.maxsize`` or
#: ``-sys.maxsize - 1``), so that it ranks last.
_LAST_LOW_FIRST, _LAST_HIGH_FIRST = (1 << 63) - 1, -(1 << 63)

SGLANG_QUEUE_FULL = "The request queue is full."
SGLANG_QUEUE_EVICTED = "The request is aborted by a higher priority request."
SGLANG_PRIORITY_DISABLED = ("Using priority is disabled for this server. "
                            "Please send a new request without a priority.")
#: vLLM's ``QueueOverflowError`` (``vllm/exceptions.py``), answered by its
#: ``create_error_response`` (type: the status' phrase).
VLLM_QUEUE_OVERFLOW = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)
#: vLLM's ``MaxQueuedTokensError`` (``vllm/exceptions.py``), answered alike.
VLLM_QUEUED_TOKENS = (
    "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance."
)


@dataclass(eq=False, slots=True)
class Entry:
    """One request in the scheduler: ``need`` tokens to (re)compute before
    its next token, ``computed`` of them done, ``generated`` tokens granted
    (per sequence), ``credit`` a granted token its generator has not taken."""

    job: object
    prompt: int
    max_new: int
    seqs: int
    priority: int
    arrival: int
    need: int = 0
    computed: int = 0
    generated: int = 0
    credit: bool = False
    matched: bool = False
    running: bool = False
    gone: bool = False
    #: When it last joined the waiting queue (a counter; SGLang's
    #: ``wait_queue_entry_time``, stamped again on every requeue).
    queued_at: int = 0


@dataclass(slots=True)
class _Plan:
    seconds: float
    deadline: float = 0.0
    decode: list[Entry] = field(default_factory=list)
    prefill: list[tuple[Entry, int]] = field(default_factory=list)


class Capacity:
    """The scheduler of one simulated engine.

    Args:
        config: the limits and step costs.
        on_prefill_start: called with a job when its first prefill is
            scheduled (the engine matches its prompt against the cache).
        on_prefilled: called with a job when its first prefill is done.
    """

    def __init__(self, config: CapacityConfig, on_prefill_start: Callable[[object], None],
                 on_prefilled: Callable[[object], None]) -> None:
        self.config = config
        self._on_prefill_start = on_prefill_start
        self._on_prefilled = on_prefilled
        self.entries: dict[int, Entry] = {}
        self.waiting: list[Entry] = []
        self.running: list[Entry] = []
        self._arrivals = 0
        self._plan: _Plan | None = None
        self._driving = False
        self._idle = False
        self._stepped = anyio.Event()
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        #: Counters (``/sim/stats`` ``capacity``, the engines' load routes).
        self.steps = 0
        self.retractions = 0
        self.preemptions = 0
        self.queue_refusals = 0
        self.queued_token_refusals = 0
        self.peak_waiting = 0
        self.peak_running = 0

    # -- admission -------------------------------------------------------

    def vllm_admission(self, seqs: int) -> str | None:
        """vLLM ``AsyncLLM.check_admission`` (``vllm/v1/engine/async_llm.py``)
        for a request of ``seqs`` sequences: :data:`VLLM_QUEUE_OVERFLOW` when
        they would take the unfinished sequences (waiting and running) past
        ``--max-num-queued-reqs``; else :data:`VLLM_QUEUED_TOKENS` when the
        prompt tokens of the sequences still prefilling already reach
        ``--max-num-queued-tokens`` (``>=``, the newcomer's own not
        counted); else ``None``. Counts each refusal."""
        cap = self.config.max_queued
        if cap is not None and self.unfinished() + seqs > cap:
            self.queue_refusals += 1
            return VLLM_QUEUE_OVERFLOW
        tokens = self.config.max_queued_tokens
        if tokens is not None and self.prefilling_tokens() >= tokens:
            self.queued_token_refusals += 1
            return VLLM_QUEUED_TOKENS
        return None

    def prefilling_tokens(self) -> int:
        """vLLM ``OutputProcessor.get_num_queued_tokens``: the whole prompt
        of every sequence whose first token has not come yet (its
        ``is_prefilling``; a partly computed prompt counts whole, and a
        preempted request that already had tokens not at all)."""
        return sum(e.prompt * e.seqs for e in self.entries.values() if e.generated == 0)

    def unfinished(self) -> int:
        """Sequences waiting or running."""
        return sum(e.seqs for e in self.entries.values())

    def enter(self, job, prompt: int, max_new: int, seqs: int = 1, priority: int | None = None,
              prefilled: bool = False) -> None:
        """Queue ``job``. On SGLang a full queue refuses it or another
        waiting job (that job's ``refused`` is set and it is woken)."""
        cfg = self.config
        if cfg.abort_on_priority_when_disabled and not cfg.priority and priority is not None:
            job.refused = (503, SGLANG_PRIORITY_DISABLED)  # Scheduler._set_or_validate_priority
            return
        if priority is None or not cfg.priority:
            # SGLang: a request without a priority ranks last; vLLM ignores it under FCFS.
            if cfg.engine == "sglang":
                priority = _LAST_LOW_FIRST if cfg.low_priority_values_first else _LAST_HIGH_FIRST
            else:
                priority = 0
        self._arrivals += 1
        # A P/D decode's prompt KV came from its prefill server: nothing to compute.
        entry = Entry(job, prompt, max_new, seqs, priority, self._arrivals, need=prompt,
                      computed=prompt if prefilled else 0, matched=prefilled, queued_at=self._arrivals)
        self.entries[id(job)] = entry
        if cfg.engine == "sglang" and not self._sglang_queue(entry):
            return
        self.waiting.append(entry)
        self.peak_waiting = max(self.peak_waiting, len(self.waiting))
        self._wake()

    def _sglang_queue(self, entry: Entry) -> bool:
        """SGLang ``_abort_on_queued_limit`` for ``entry`` (new or
        retracted) about to join the waiting queue: ``False`` when it is the
        one aborted; with priority scheduling the least preferred waiting
        request goes instead when ``entry`` is strictly better. The one
        aborted leaves with ``refused`` set (status 503)."""
        cfg = self.config
        if cfg.max_queued is None or len(self.waiting) + 1 <= cfg.max_queued:
            return True
        self.queue_refusals += 1
        victim = max(self.waiting, key=self._sglang_rank) if cfg.priority and self.waiting else None
        if victim is None or not self._sglang_rank(entry)[0] < self._sglang_rank(victim)[0]:
            victim, message = entry, SGLANG_QUEUE_FULL
        else:
            message = SGLANG_QUEUE_EVICTED
            self.waiting.remove(victim)
        victim.gone = True
        del self.entries[id(victim.job)]
        victim.job.refused = (503, message)
        self._wake()
        return victim is not entry

    def leave(self, job) -> None:
        """``job`` ended (finished, aborted, refused): free its seat and KV."""
        entry = self.entries.pop(id(job), None)
        if entry is None:
            return
        entry.gone = True
        if entry.running:
            self.running.remove(entry)
        else:
            self.waiting.remove(entry)
        self._wake()

    # -- tokens ------------------------------------------------------------

    async def next_token(self, job) -> bool:
        """Wait until the scheduler computed ``job``'s next token; ``False``
        when the job left or was aborted (``job.abort_event``) first. The
        caller drives the steps while nobody else does."""
        entry = self.entries.get(id(job))
        while entry is not None and not entry.gone and not entry.credit:
            if job.aborted:
                return False
            if not self._driving:
                self._driving = True
                try:
                    await self._drive(entry)
                finally:
                    self._driving = False
                    self._wake()
            else:
                if self._idle:  # this request is ready now: the driver plans again
                    self._wake()
                stepped = self._stepped
                with anyio.move_on_after(1.0):  # a safety net: a step always wakes us sooner
                    await stepped.wait()
        if entry is None or entry.gone or job.aborted:
            return False
        entry.credit = False
        return True

    async def _drive(self, entry: Entry) -> None:
        """Run steps until ``entry`` has a token or is gone; a step planned
        by an earlier driver ends at the same deadline. With nothing to
        compute (every running request's last token untaken, nothing
        admissible) it waits for a change instead of spinning."""
        job = entry.job
        while not entry.credit and not entry.gone and not job.aborted:
            if self._plan is None:
                plan = self._schedule()
                if not plan.prefill and not plan.decode:
                    self._idle = True
                    stepped = self._stepped
                    with anyio.move_on_after(1.0):  # a safety net: any change wakes us sooner
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(_cancel_on, job.abort_event, tg.cancel_scope)
                            await stepped.wait()
                            tg.cancel_scope.cancel()
                    self._idle = False
                    continue
                plan.deadline = anyio.current_time() + plan.seconds
                self._plan = plan
            wait = self._plan.deadline - anyio.current_time()
            if wait > 0:
                with anyio.move_on_after(wait):
                    await job.abort_event.wait()
                if job.aborted:
                    return
            else:
                await anyio.lowlevel.checkpoint()
            plan, self._plan = self._plan, None
            if plan is not None:
                self.steps += 1
                self._apply(plan)

    def step_now(self) -> tuple[int, int]:
        """Plan and apply one step at once, its time not spent (for tests
        and tools that drive the scheduler by hand; a generator still takes
        each granted token with :meth:`next_token`). Returns ``(sequences
        decoded, prefill tokens computed)``."""
        plan = self._schedule()
        if plan.prefill or plan.decode:
            self.steps += 1
            self._apply(plan)
        return sum(e.seqs for e in plan.decode), sum(n for _, n in plan.prefill)

    def _wake(self) -> None:
        self._stepped.set()
        self._stepped = anyio.Event()

    # -- one step --------------------------------------------------------

    def _blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def _held(self, entry: Entry, extra: int = 0) -> int:
        """KV tokens (SGLang) or blocks (vLLM) ``entry`` holds with ``extra``
        more tokens per sequence."""
        prompt_part = min(entry.computed, entry.prompt)
        out = max(0, entry.computed - entry.prompt) + extra
        tokens = prompt_part + entry.seqs * out if entry.running else 0
        return self._blocks(tokens) if self.config.engine == "vllm" else tokens

    def pool(self) -> int | None:
        """The pool's size in its unit (tokens or blocks), ``None`` if unbounded."""
        kv = self.config.kv_tokens
        if kv is None:
            return None
        return kv // self.config.block_size if self.config.engine == "vllm" else kv

    def used(self) -> int:
        """The pool held by running requests, in its unit."""
        return sum(self._held(e) for e in self.running)

    def _seats(self) -> int:
        return sum(e.seqs for e in self.running)

    def _sglang_rank(self, entry: Entry) -> tuple[int, int]:
        """The waiting queue's order (``SchedulePolicy._sort_by_priority_and_fcfs``:
        priority, then when it joined the queue)."""
        sign = 1 if self.config.low_priority_values_first else -1
        return (sign * entry.priority, entry.queued_at)

    def _order_waiting(self) -> None:
        cfg = self.config
        if cfg.priority:
            if cfg.engine == "sglang":
                self.waiting.sort(key=self._sglang_rank)
            else:
                self.waiting.sort(key=lambda e: (e.priority, e.arrival))

    def _schedule(self) -> _Plan:
        cfg = self.config
        plan = _Plan(0.0)
        self._order_waiting()
        if cfg.engine == "sglang":
            self._schedule_sglang(plan)
        else:
            self._schedule_vllm(plan)
        seqs = sum(e.seqs for e in plan.decode) + sum(e.seqs for e, _ in plan.prefill)
        tokens = sum(n for _, n in plan.prefill)
        plan.seconds = cfg.step_s + cfg.seq_s * seqs + cfg.prefill_token_s * tokens
        self.peak_running = max(self.peak_running, len(self.running))
        return plan

    def _ready(self, entry: Entry) -> bool:
        """Prefilled and its last token taken: it decodes this step."""
        return entry.computed >= entry.need and not entry.credit and entry.generated < entry.max_new

    def _schedule_sglang(self, plan: _Plan) -> None:
        cfg, pool = self.config, self.pool()
        retracted_before = self.retractions
        # The decode batch: every prefilled request (one whose last token is
        # still untaken decodes as soon as it is taken, so it counts too).
        decoding = [e for e in self.running if e.computed >= e.need and e.generated < e.max_new]
        if pool is not None and decoding:
            # ScheduleBatch.retract_decode: keep the most output, then the shortest prompt.
            keep = sorted(decoding, key=lambda e: (e.generated, -e.prompt), reverse=True)
            others = sum(self._held(e) for e in self.running if e not in keep)
            retracted = self.retractions
            while len(keep) > 1 and others + sum(self._held(e, 1) for e in keep) > pool:
                self._back_to_waiting(keep.pop(), front=False)
                self.retractions += 1
            if self.retractions > retracted:
                decoded = sum(e.generated for e in keep)
                self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(keep))
                                           / (sum(e.max_new for e in keep) + 1))
            decoding = keep
        decoding = [e for e in decoding if self._ready(e)]
        plan.decode = decoding
        if decoding and self.retractions == retracted_before:
            step = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / NEW_TOKEN_RATIO_DECAY_STEPS
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - step)
        # PrefillAdder: admit in queue order while seats and tokens last.
        reserved = sum(min(e.max_new - e.generated, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
                       for e in self.running)
        free = None if pool is None else pool - self.used() - reserved
        preempt = cfg.priority and cfg.priority_preemption
        for entry in list(self.waiting):
            if entry.gone:  # evicted from a full queue by a preemption's requeue in this pass
                continue
            if cfg.max_running is not None and self._seats() + entry.seqs > cfg.max_running:
                if not preempt:
                    break
                freed = self._sglang_preempt(entry, free, plan)
                if freed is None:
                    break
                if free is not None:
                    free += freed
                if self._seats() + entry.seqs > cfg.max_running:
                    break
            cost = entry.need - entry.computed
            if free is not None:
                ask = cost + min(entry.max_new - entry.generated, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
                if ask > free and self.running:
                    break
                free -= ask
            self._admit(entry)
            plan.prefill.append((entry, cost))
        for entry in self.running:  # a chunk left over (never on SGLang here: whole prefills)
            if entry.computed < entry.need and all(entry is not e for e, _ in plan.prefill):
                plan.prefill.append((entry, entry.need - entry.computed))

    def _reserve(self, entry: Entry) -> float:
        """SGLang ``PrefillAdder._get_running_request_total_token_offset``:
        the new tokens a running request may still need (clipped), times
        ``new_token_ratio`` (1 for an ``ignore_eos`` request)."""
        ratio = 1.0 if getattr(entry.job, "ignore_eos", False) else self.new_token_ratio
        return min(entry.max_new - entry.generated, CLIP_MAX_NEW_TOKENS) * ratio

    def _sglang_preempt(self, entry: Entry, free: float | None, plan: _Plan) -> float | None:
        """SGLang ``PrefillAdder.preempt_to_schedule`` for ``entry``, which
        finds every seat taken: running requests in order of least preferred
        priority, then latest into the queue, each preempted while
        ``entry``'s priority beats its by more than the threshold, until their
        reserved tokens (:meth:`_reserve`) cover what ``entry`` asks beyond
        ``free`` (one suffices with an unbounded pool). They go back to the
        waiting queue (``_add_request_to_queue``, its limit included) to
        recompute later. Returns the reserved and held tokens freed, or
        ``None`` when nothing is preempted."""
        cfg = self.config
        sign = 1 if cfg.low_priority_values_first else -1
        admitted = [e for e, _ in plan.prefill]  # this pass's, not yet in SGLang's running batch
        candidates = sorted((e for e in self.running if e not in admitted and e.generated < e.max_new),
                            key=lambda e: (e.priority * -sign, -e.queued_at))
        ask = (entry.need - entry.computed) + min(entry.max_new - entry.generated, CLIP_MAX_NEW_TOKENS)
        short = ask - free if free is not None else -math.inf
        chosen = []
        for running in candidates:
            if (entry.priority - running.priority) * -sign <= cfg.preemption_threshold:
                break
            chosen.append(running)
            short -= self._reserve(running)
            if short <= 0:
                break
        if not chosen or short > 0:
            return None
        freed = 0.0
        for running in chosen:
            # What ``free`` counted for it: its reservation as the admission above reckons it, and its KV.
            freed += min(running.max_new - running.generated, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
            freed += self._held(running)
            plan.decode = [e for e in plan.decode if e is not running]
            self._back_to_waiting(running, front=False)
            self.preemptions += 1
        return freed

    def _schedule_vllm(self, plan: _Plan) -> None:
        cfg, pool = self.config, self.pool()
        budget = cfg.max_batched_tokens if cfg.max_batched_tokens is not None else 1 << 62
        preemptions = self.preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            entry = self.running[i]
            if entry.computed < entry.need:
                n = min(entry.need - entry.computed, budget)
            elif self._ready(entry):
                n = 0
            else:
                i += 1
                continue
            grow = n if n else 1
            while pool is not None and self.used() - self._held(entry) + self._held_after(entry, grow) > pool:
                if cfg.priority:
                    victim = max(self.running, key=lambda e: (e.priority, e.arrival))
                else:
                    victim = self.running[-1]
                victim_index = self.running.index(victim)
                self._back_to_waiting(victim, front=True)
                self.preemptions += 1
                plan.decode = [e for e in plan.decode if e is not victim]
                plan.prefill = [(e, k) for e, k in plan.prefill if e is not victim]
                if victim is entry:
                    break
                if victim_index < i:
                    i -= 1
            else:
                if n:
                    plan.prefill.append((entry, n))
                    budget -= n
                else:
                    plan.decode.append(entry)
                    budget -= entry.seqs
                i += 1
                continue
            # entry itself was preempted: the rest of the running list shifted
        preempted = self.preemptions > preemptions
        for entry in list(self.waiting):
            if budget <= 0 or preempted:
                break  # vLLM admits no new request in a step that preempted
            if cfg.max_running is not None and self._seats() + entry.seqs > cfg.max_running:
                break
            n = min(entry.need - entry.computed, budget)
            entry.running = True
            fits = pool is None or self.used() + self._held_after(entry, n) - self._held(entry) <= pool
            entry.running = False
            if not fits:
                break
            self._admit(entry)
            plan.prefill.append((entry, n))
            budget -= n

    def _held_after(self, entry: Entry, tokens: int) -> int:
        """The pool ``entry`` holds once ``tokens`` more are computed."""
        computed = entry.computed
        if computed < entry.need:
            entry.computed = computed + tokens
            held = self._held(entry)
            entry.computed = computed
            return held
        return self._held(entry, tokens)

    def _admit(self, entry: Entry) -> None:
        self.waiting.remove(entry)
        self.running.append(entry)
        entry.running = True
        if not entry.matched:
            entry.matched = True
            self._on_prefill_start(entry.job)

    def _back_to_waiting(self, entry: Entry, front: bool) -> None:
        """Retract (SGLang) or preempt (vLLM) ``entry``: it frees its KV and
        recomputes its prompt and output when admitted again."""
        self.running.remove(entry)
        entry.running = False
        entry.computed = 0
        entry.need = entry.prompt + entry.generated
        self._arrivals += 1
        entry.queued_at = self._arrivals
        if front:
            self.waiting.insert(0, entry)
        elif self._sglang_queue(entry):  # a retracted request meets the queue's limit too
            self.waiting.append(entry)
        self.peak_waiting = max(self.peak_waiting, len(self.waiting))

    def _apply(self, plan: _Plan) -> None:
        woke = False
        for entry, n in plan.prefill:
            if entry.gone or not entry.running:
                continue
            first = entry.generated == 0 and entry.computed < entry.prompt
            entry.computed += n
            if entry.computed >= entry.need:
                if first:
                    self._on_prefilled(entry.job)
                self._grant(entry)
                woke = True
        for entry in plan.decode:
            if entry.gone or not entry.running:
                continue
            entry.computed += 1
            entry.need += 1
            self._grant(entry)
            woke = True
        if woke or plan.prefill or plan.decode:
            self._wake()

    @staticmethod
    def _grant(entry: Entry) -> None:
        entry.generated += 1
        entry.credit = True

    # -- figures ---------------------------------------------------------

    def sequences(self) -> tuple[int, int]:
        """``(running, waiting)`` sequences."""
        return self._seats(), sum(e.seqs for e in self.waiting)

    def waiting_tokens(self) -> int:
        """Tokens the waiting requests still have to compute (SGLang ``seqlen``)."""
        return sum(e.need - e.computed for e in self.waiting)

    def stats(self) -> dict:
        """``/sim/stats`` ``capacity``."""
        running, waiting = self.sequences()
        cfg = self.config
        return {
            "max_running": cfg.max_running, "kv_pool": self.pool(), "kv_used": self.used(),
            "block_size": cfg.block_size, "max_batched_tokens": cfg.max_batched_tokens,
            "max_queued": cfg.max_queued, "priority": cfg.priority,
            "running": running, "waiting": waiting, "steps": self.steps,
            "retractions": self.retractions, "preemptions": self.preemptions,
            "queue_refusals": self.queue_refusals, "queued_token_refusals": self.queued_token_refusals,
            "max_queued_tokens": cfg.max_queued_tokens, "peak_waiting": self.peak_waiting,
            "peak_running": self.peak_running,
        }


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
