"""Requests that carry several items: SGLang batches and ``n`` > 1, vLLM ``n`` > 1.

A request with ``GenerateRequest.items`` runs as :class:`BatchGeneration`:

- **Legs.** By default the whole request is one engine request on one worker
  (its prompts' prefixes are cached there). With ``--split-batches`` its
  prompt groups (``BatchItem.group``: a prompt and its samples) are spread
  over the healthy workers of the protocol, one leg per worker, run at once;
  the client's answer is the same (a unary list joined in item order, SSE
  chunks as they come with each item's index). Batches run aggregated and
  never migrate mid-answer; a leg that cannot connect fails over to
  another worker before anything reached the client.
- **P/D pairs.** Where no aggregated worker is up, or ``--disaggregation``
  is ``always``, the whole request runs on a prefill/decode pair as any
  request does (:class:`~asgi_generate.request.generation.Generation`'s
  attempts, :mod:`~asgi_generate.request.handshakes`), each leg carrying
  every item; a handshake whose engine cannot run several items on a pair
  (``WorkerProtocol.pd_items_refusal``: vLLM ``n`` > 1) answers 400 in the format's
  shape, saying why.
- **Aborts.** Where the engine runs each item under an id of its own (SGLang
  entries, samples included), the codec sends the ids the frontend minted per
  item (``Attempt.entry_ids``), so a disconnect aborts exactly the unfinished
  items, each acknowledged; vLLM's ``n`` choices run under the request's one
  id, whose abort ends them all.
- **Accounting.** Each item keeps its own count of the tokens its client
  was sent (counted when the write carrying them was taken), its finish,
  usage and token timing; at the end the request's one state becomes one
  record per item (:meth:`BatchGeneration.item_states`), each with the
  batch's id, its index and the batch size, its own attempts (the leg that
  carried it, under the item's engine id) and, for an item that had not
  finished, the request's outcome (a disconnect records every unfinished
  item as ``client_disconnect``). A request refused as a whole before any
  item ran (:meth:`BatchGeneration.refused_whole`) is one record whatever
  its items: the request's, its ``item_count`` saying how many it carried.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import anyio

from ..protocols import PROTOCOLS
from ..sdk import ids
from . import state
from ..sdk.codec import LEG_DONE, Attempt, Codec, Event, Exchange, GenerateRequest, RequestError
from ..tracing.state import RequestState
from .framing import Send
from .generation import Generation

if TYPE_CHECKING:
    from .context import RequestContext


@dataclass(slots=True)
class ItemTally:
    """One item's share of the answer (what its record says)."""

    request_id: str
    delivered: int = 0
    finish_reason: str | None = None
    matched: int | str | None = None
    finish_sent: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    t_first_token: float | None = None
    t_last_token: float | None = None


class BatchGeneration(Generation):
    """Drives a request with items; see the module docstring."""

    __slots__ = ("items", "tallies", "outbox_items", "pending_items", "write_lock", "refused")

    def __init__(
        self, ctx: "RequestContext", codec: Codec, ex: Exchange, req: GenerateRequest, st: RequestState, send: Send
    ) -> None:
        super().__init__(ctx, codec, ex, req, st, send)
        self.sent_ids = None  # batches never migrate
        self.items = req.items
        self.tallies = [ItemTally(ids.mint()) for _ in self.items]
        #: (item, tokens, finished) of the events in the outbox / of a unary answer.
        self.outbox_items: list[tuple[int, int, bool]] = []
        self.pending_items: list[tuple[int, int, bool]] = []
        #: Legs run at once (``--split-batches``) share the client.
        self.write_lock = anyio.Lock()
        #: The routing key of a batch sent whole to one worker, else ``None``.
        self.key = None
        #: An engine answered the request with its own error (not 200).
        self.refused = False
        st.expand = self.item_states

    # -- legs ---------------------------------------------------------------

    async def run(self) -> None:
        protocol = self.codec.worker_protocol
        router = self.ctx.router
        if router.disaggregation == "always" or (router.disaggregation == "auto" and
                                                 not router.up(protocol, "aggregated") and router.can_plan(protocol)):
            refusal = PROTOCOLS[protocol].pd_items_refusal
            if refusal is not None:
                await self.refuse(RequestError(400, refusal, "rejected"))
                return
            await super().run()  # on pairs, as one item is
            return
        parts = [list(range(len(self.items)))]
        if self.ctx.settings.split_batches:
            workers = max(1, sum(1 for w in router.workers if w.healthy and w.protocol.name == protocol
                                 and w.role == "aggregated"))
            groups: dict[int, list[int]] = {}
            for j, item in enumerate(self.items):
                groups.setdefault(item.group, []).append(j)
            parts = [[] for _ in range(min(workers, len(groups)))]
            for k, members in enumerate(groups.values()):
                parts[k % len(parts)].extend(members)
        # A batch on one worker goes where the policy sends its prompt (n
        # samples of one prompt: its prefix is cached there); legs split
        # over workers go least outstanding.
        self.key = router.routing_key(self.req, self.st.headers) if len(parts) == 1 else None
        spread: list = []  # workers given a leg: the next leg prefers another
        # Every leg's body is built (and checked) before any is sent: a
        # refused item refuses the whole batch before an engine sees it.
        first = []
        for part in parts:
            prepared = await self._prepare(part, spread, [])
            if prepared is None:
                return
            first.append(prepared)
        if len(parts) == 1:
            await self._leg(parts[0], spread, first[0])
            return
        async with anyio.create_task_group() as tg:
            for part, prepared in zip(parts, first):
                tg.start_soon(self._leg_then_check, part, spread, prepared, tg.cancel_scope)

    def carry(self, attempt: Attempt) -> None:
        """Give ``attempt`` every item, each under an id of its own where
        the engine runs them so (a leg of an attempt on a pair)."""
        attempt.entries = list(range(len(self.items)))
        attempt.unfinished = set(attempt.entries)
        if getattr(self.ex, "names_entries", False):
            attempt.entry_ids = {j: ids.mint() for j in attempt.entries}

    async def _leg_then_check(self, entries: list[int], spread: list, prepared: tuple,
                              scope: anyio.CancelScope) -> None:
        await self._leg(entries, spread, prepared)
        if self.st.response_complete:  # an error ended the answer: stop the other legs
            scope.cancel()

    async def _prepare(self, entries: list[int], spread: list, tried: list) -> tuple | None:
        """A worker, attempt and worker request for the items ``entries``;
        ``None`` once the client was answered (no worker, or refused)."""
        router = self.ctx.router
        protocol = self.codec.worker_protocol
        key = self.key
        worker = router.pick(protocol, [*tried, *spread], key=key) or router.pick(protocol, tried, key=key)
        if worker is None:
            why = "no healthy worker" if router.has_protocol(protocol) else "no worker configured"
            await self.fail(RequestError(503, f"{why} for protocol {protocol!r}", "unavailable"), "unavailable",
                            headers=self.retry_after())
            return None
        spread.append(worker)
        attempt = Attempt(ids.mint(), "aggregated", worker.id, worker.info, worker)
        attempt.entries = entries
        attempt.unfinished = set(entries)
        if getattr(self.ex, "names_entries", False):
            attempt.entry_ids = {j: ids.mint() for j in entries}
        try:
            wreq = self.ex.worker_request(attempt)
        except RequestError as exc:  # nothing was sent to any engine
            if not self.st.response_started:
                await self.refuse(exc)
            return None
        finally:
            self.release_body()
        return worker, attempt, wreq

    async def _leg(self, entries: list[int], spread: list, prepared: tuple) -> None:
        """Run the items ``entries`` as one engine request, failing over to
        another worker while nothing reached the client."""
        tried: list = []
        while True:
            worker, attempt, wreq = prepared
            self.st.attempts.append(attempt)
            leg = self.client_leg(worker, attempt, wreq)
            retry = await self.judge(leg, await leg.run(self, self.ctx.router))
            if not retry or self.st.response_complete:
                return
            spread.remove(worker)
            tried.append(worker)
            prepared = await self._prepare(entries, spread, tried)
            if prepared is None:
                return

    async def settle(self, attempt: Attempt, event: Event) -> None:
        attempt.tokens += len(event.token_ids)
        for j, sub in event.entries or ():
            if sub.finish_reason is not None or sub.error is not None:
                attempt.unfinished.discard(j)
        if event.error is not None:
            attempt.live = False
            state.end_leg(attempt, "error")
        elif event.finish_reason is not None or (attempt.entry_ids is not None and not attempt.unfinished):
            attempt.live = False
            state.end_leg(attempt, "finished")
        if event.finish_reason != LEG_DONE:  # else: its items finished while other legs run
            await self._deliver(event)

    async def answer_worker_error(self, status: int, body: bytes, retry_after: bytes | None = None) -> None:
        """The engine refused the request as a whole (its own non-200
        answer); answered as any request's (:meth:`Generation.answer_worker_error`)."""
        self.refused = True
        await super().answer_worker_error(status, body, retry_after)

    # -- the client's answer, per item -----------------------------------------

    async def _write(self, message: dict) -> None:
        async with self.write_lock:
            await super()._write(message)

    def _queued(self, event: Event) -> bool:
        return False  # every event goes through the items' tallies (_deliver)

    async def _deliver(self, event: Event) -> None:
        now = time.monotonic()
        for j, sub in event.entries or ():
            tally = self.tallies[j]
            n = len(sub.token_ids)
            if n and self.timed:
                if tally.t_first_token is None:
                    tally.t_first_token = now
                else:
                    self.gap(now - tally.t_last_token)
                tally.t_last_token = now
            for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
                value = getattr(sub, name)
                if value is not None:
                    setattr(tally, name, value)
            finished = sub.finish_reason is not None
            if finished:
                tally.finish_reason, tally.matched = sub.finish_reason, sub.matched
            if sub.error is not None:
                tally.error = sub.error.message
            (self.outbox_items if self.req.stream else self.pending_items).append((j, n, finished))
        await super()._deliver(event)
        if not self.req.stream and self.st.response_complete and not self.gone and self.st.http_status == 200:
            self._credit(self.pending_items)

    async def flush(self, more: bool = True) -> None:
        taken, self.outbox_items = self.outbox_items, []
        await super().flush(more)
        if not self.gone:
            self._credit(taken)

    def _credit(self, taken: list[tuple[int, int, bool]]) -> None:
        for j, n, finished in taken:
            tally = self.tallies[j]
            tally.delivered += n
            tally.finish_sent = tally.finish_sent or finished
        taken.clear()

    # -- records ----------------------------------------------------------------

    def item_states(self) -> list[RequestState]:
        """One finished state per item (see the module docstring), each
        derived from the request's by :func:`asgi_generate.request.state.item_state`;
        a request refused as a whole before any item ran (:meth:`refused_whole`)
        is the request's one state, with its ``item_count``."""
        st = self.st
        size = len(self.items)
        if self.refused_whole():
            st.item_count = size
            return [st]
        out = []
        for j, (item, tally) in enumerate(zip(self.items, self.tallies)):
            answered = tally.finish_sent if st.stream else (st.status == "ok" and tally.finish_reason is not None)
            # An item's engine error counts once its finish reached the client (or the whole answer did).
            counted = tally.error is not None and (tally.finish_sent or st.status == "ok")
            out.append(state.item_state(
                st, answered, tally.error if counted else None,
                request_id=tally.request_id, public_id=item.public_id,
                input_ids=item.input_ids,
                input_length=len(item.input_ids) if item.input_ids is not None else None,
                replay_excluded=st.replay_excluded if st.replay_excluded == "rejected" else item.replay_excluded,
                batch_id=st.request_id, batch_index=j, batch_size=size,
                attempts=list(_item_attempts(st.attempts, j, tally)),
                finish_reason=tally.finish_reason if answered else None,
                finish_matched=tally.matched if answered else None,
                output_tokens=tally.delivered,
                prompt_tokens=tally.prompt_tokens if tally.prompt_tokens is not None else st.prompt_tokens,
                engine_completion_tokens=tally.completion_tokens,
                cached_tokens=tally.cached_tokens if tally.cached_tokens is not None else st.cached_tokens,
                t_first_token=tally.t_first_token, t_last_token=tally.t_last_token,
            ))
        return out

    def refused_whole(self) -> bool:
        """Whether the request was refused as a whole before any item ran:
        by the frontend (``rejected``: a check after decoding;
        ``unavailable``: no worker to take it) or by its engine's own error
        answer (e.g. vLLM's 400 to ``n`` above its ``max_num_seqs``), with
        nothing of any item received."""
        st = self.st
        if not (self.refused or st.status in ("rejected", "unavailable")):
            return False
        return not any(t.delivered or t.finish_reason is not None or t.error is not None for t in self.tallies)


def _item_attempts(attempts: list[Attempt], j: int, tally: ItemTally) -> Iterator[Attempt]:
    """The legs that carried item ``j``, each as the item's own attempt (its
    own engine id where it had one, its abort acknowledgement, its tokens on
    the leg that served it)."""
    carrying = [a for a in attempts if a.entries is not None and j in a.entries]
    for k, a in enumerate(carrying):
        last = k == len(carrying) - 1
        outcome = "finished" if last and tally.finish_reason is not None else a.outcome
        if a.entry_ids is not None:
            engine_id, acked = a.entry_ids[j], (a.entry_acked or {}).get(j)
        else:
            engine_id, acked = a.engine_id, a.abort_acked
        yield Attempt(engine_id, a.role, a.worker_id, outcome=outcome, abort_acked=acked,
                      tokens=tally.delivered if last else 0)


def named_legs(gen: Generation) -> Iterator[tuple[str | None, object, str]]:
    """``(public id, worker, engine id)`` of every live engine leg of
    ``gen`` a client id can name: a batch's unfinished items each under
    their own id, else the request's live attempts."""
    if isinstance(gen, BatchGeneration):
        for a in gen.st.attempts:
            if a.live and a.entry_ids is not None:
                for j in sorted(a.unfinished or ()):
                    yield gen.items[j].public_id, a.worker, a.entry_ids[j]
        return
    for a in gen.st.attempts:
        if a.live:
            yield gen.st.public_id, a.worker, a.engine_id
