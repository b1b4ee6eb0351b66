"""Requests that carry several items: SGLang batches and ``n`` > 1, vLLM ``n`` > 1.

A request with ``GenerateRequest.items`` runs with a :class:`Batch`, the
strategy its attempt loop (:class:`~asgi_generate.request.generation.Generation`)
and its answer writer (:class:`~asgi_generate.request.answer.AnswerWriter`)
are given:

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
  record per item (:meth:`Batch.item_states`), each with the
  batch's id, its index and the batch size, its own attempts (the leg that
  carried it, under the item's engine id) and, for an item that had not
  finished, the request's outcome (a disconnect records every unfinished
  item as ``client_disconnect``). A request refused as a whole before any
  item ran (:meth:`Batch.refused_whole`) is one record whatever
  its items: the request's, its ``item_count`` saying how many it carried.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import anyio

from ..protocols import PROTOCOLS
from ..sdk import _ids as ids
from . import state
from ..sdk._codec import LEG_DONE, BatchItem, Event, RequestError
from ..tracing.state import LegRecord, RequestState

if TYPE_CHECKING:
    from ..sdk._codec import Codec, Exchange, GenerateRequest, WorkerRequest
    from ..workers.router import Worker
    from .answer import AnswerWriter
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


#: (item, tokens, finished) of one event's share, credited to the item once written.
Share = tuple[int, int, bool]


class BatchLoop(Protocol):
    """What a :class:`Batch` needs of the attempt loop that was given it
    (:class:`~asgi_generate.request.generation.Generation`)."""

    ctx: "RequestContext"
    codec: "Codec"
    codec_state: "Exchange"
    req: "GenerateRequest"
    st: RequestState
    writer: "AnswerWriter"
    #: The request's routing key; a batch sent whole to one worker sets it.
    key: Any
    batch: "Batch | None"

    async def run_attempts(self) -> None:
        """Run the request as one item is (on P/D pairs)."""

    async def run_client_leg(self, worker: "Worker", attempt: LegRecord, wreq: "WorkerRequest") -> bool:
        """Run and conclude a leg whose events make the client's answer;
        whether to try another worker."""

    def retry_after(self) -> list[tuple[bytes, bytes]]:
        """The ``Retry-After`` of the frontend's own 503."""

    def release_body(self) -> None:
        """Give the request's share of the body budget back."""


class Batch:
    """A request with items: how its legs run (:meth:`run`) and each item's
    share of the answer (:meth:`tally`, :meth:`credit`), then its records
    (:meth:`item_states`); see the module docstring. Given to the request's
    :class:`~asgi_generate.request.generation.Generation` and, through it,
    to its :class:`~asgi_generate.request.answer.AnswerWriter`.

    Args:
        items: the request's items (``GenerateRequest.items``), in answer order.
        st: the request's state; its records expand into the items' (``st.expand``).
    """

    __slots__ = ("items", "st", "tallies", "queued", "unary", "write_lock", "refused")

    def __init__(self, items: list[BatchItem], st: RequestState) -> None:
        self.items = items
        self.st = st
        self.tallies = [ItemTally(ids.mint()) for _ in items]
        #: The shares of the events in the writer's outbox / of a unary answer.
        self.queued: list[Share] = []
        self.unary: list[Share] = []
        #: Legs run at once (``--split-batches``) share the client.
        self.write_lock = anyio.Lock()
        #: An engine answered the request with its own error (not 200).
        self.refused = False
        st.expand = self.item_states

    # -- legs ---------------------------------------------------------------

    async def run(self, loop: BatchLoop) -> None:
        """Run the request's items: on one worker, split over several
        (``--split-batches``), or as one request on a P/D pair."""
        protocol = loop.codec.worker_protocol
        router = loop.ctx.router
        if router.disaggregation == "always" or (router.disaggregation == "auto" and
                                                 not router.up(protocol, "aggregated") and router.can_plan(protocol)):
            refusal = PROTOCOLS[protocol].pd_items_refusal
            if refusal is not None:
                await loop.writer.refuse(RequestError(400, refusal, "rejected"))
                return
            await loop.run_attempts()  # on pairs, as one item is
            return
        parts = [list(range(len(self.items)))]
        if loop.ctx.settings.split_batches:
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
        loop.key = router.routing_key(loop.req, self.st.headers) if len(parts) == 1 else None
        spread: list = []  # workers given a leg: the next leg prefers another
        # Every leg's body is built (and checked) before any is sent: a
        # refused item refuses the whole batch before an engine sees it.
        first = []
        for part in parts:
            prepared = await self._prepare(loop, part, spread, [])
            if prepared is None:
                return
            first.append(prepared)
        if len(parts) == 1:
            await self._leg(loop, parts[0], spread, first[0])
            return
        async with anyio.create_task_group() as tg:
            for part, prepared in zip(parts, first):
                tg.start_soon(self._leg_then_check, loop, part, spread, prepared, tg.cancel_scope)

    def give_items(self, attempt: LegRecord, names_entries: bool) -> None:
        """Give ``attempt`` every item, each under an id of its own where
        the engine runs them so (``names_entries``; a leg of an attempt on a pair)."""
        self._assign(attempt, list(range(len(self.items))), names_entries)

    @staticmethod
    def _assign(attempt: LegRecord, entries: list[int], names_entries: bool) -> None:
        attempt.entries = entries
        attempt.unfinished = set(entries)
        if names_entries:
            attempt.entry_ids = {j: ids.mint() for j in entries}

    async def _leg_then_check(self, loop: BatchLoop, entries: list[int], spread: list, prepared: tuple,
                              scope: anyio.CancelScope) -> None:
        await self._leg(loop, entries, spread, prepared)
        if self.st.response_complete:  # an error ended the answer: stop the other legs
            scope.cancel()

    async def _prepare(self, loop: BatchLoop, entries: list[int], spread: list, tried: list) -> tuple | None:
        """A worker, attempt and worker request for the items ``entries``;
        ``None`` once the client was answered (no worker, or refused)."""
        router = loop.ctx.router
        protocol = loop.codec.worker_protocol
        key = loop.key
        need = len(entries)
        worker = (router.pick(protocol, [*tried, *spread], key=key, need=need)
                  or router.pick(protocol, tried, key=key, need=need))
        if worker is None:
            why = "no healthy worker" if router.has_protocol(protocol) else "no worker configured"
            await loop.writer.fail(RequestError(503, f"{why} for protocol {protocol!r}", "unavailable"),
                                   "unavailable", headers=loop.retry_after())
            return None
        spread.append(worker)
        attempt = LegRecord(ids.mint(), "aggregated", worker.id, worker.info, worker=worker)
        self._assign(attempt, entries, getattr(loop.codec_state, "names_entries", False))
        try:
            wreq = loop.codec_state.worker_request(attempt)
        except RequestError as exc:  # nothing was sent to any engine
            if not self.st.response_started:
                await loop.writer.refuse(exc)
            return None
        finally:
            loop.release_body()
        return worker, attempt, wreq

    async def _leg(self, loop: BatchLoop, entries: list[int], spread: list, prepared: tuple) -> None:
        """Run the items ``entries`` as one engine request, failing over to
        another worker while nothing reached the client."""
        tried: list = []
        while True:
            worker, attempt, wreq = prepared
            self.st.attempts.append(attempt)
            retry = await loop.run_client_leg(worker, attempt, wreq)
            if not retry or self.st.response_complete:
                return
            spread.remove(worker)
            tried.append(worker)
            prepared = await self._prepare(loop, entries, spread, tried)
            if prepared is None:
                return

    @staticmethod
    def end_items(attempt: LegRecord, event: Event) -> bool:
        """Count ``event`` on the batch leg ``attempt``: the items it
        finishes, and the leg's end (an error, its finish, or every item
        it runs under an id of its own finished); whether the client is
        owed the event (not a leg's end while other legs run)."""
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
        return event.finish_reason != LEG_DONE  # else: its items finished while other legs run

    # -- the client's answer, per item -----------------------------------------

    def tally(self, event: Event, timed: bool, gap: Callable[[float], None], stream: bool) -> None:
        """Each item's share of ``event`` (its tokens, timing, usage, finish
        and error), credited once written (:meth:`credit`); ``gap`` takes
        the seconds between two of an item's token events when ``timed``."""
        now = time.monotonic()
        for j, sub in event.entries or ():
            tally = self.tallies[j]
            n = len(sub.token_ids)
            if n and timed:
                if tally.t_first_token is None:
                    tally.t_first_token = now
                else:
                    gap(now - tally.t_last_token)
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
            (self.queued if stream else self.unary).append((j, n, finished))

    def take_queued(self) -> list[Share]:
        """The shares of the events about to be written (the writer's outbox)."""
        taken, self.queued = self.queued, []
        return taken

    def credit_unary(self) -> None:
        """The unary answer was written whole: credit its shares."""
        self.credit(self.unary)

    def credit(self, taken: list[Share]) -> None:
        """The write carrying ``taken`` was taken by the server: each item
        was sent its share."""
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


def _item_attempts(attempts: list[LegRecord], j: int, tally: ItemTally) -> Iterator[LegRecord]:
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
        yield LegRecord(engine_id, a.role, a.worker_id, outcome=outcome, abort_acked=acked,
                      tokens=tally.delivered if last else 0)


def named_legs(gen: BatchLoop) -> Iterator[tuple[str | None, object, str]]:
    """``(public id, worker, engine id)`` of every live engine leg of
    ``gen`` a client id can name: a batch's unfinished items each under
    their own id, else the request's live attempts."""
    if gen.batch is not None:
        items = gen.batch.items
        for a in gen.st.attempts:
            if a.live and a.entry_ids is not None:
                for j in sorted(a.unfinished or ()):
                    yield items[j].public_id, a.worker, a.entry_ids[j]
        return
    for a in gen.st.attempts:
        if a.live:
            yield gen.st.public_id, a.worker, a.engine_id
