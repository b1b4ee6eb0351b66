"""Engine aborts at scale: per worker, a bounded queue drained by a few
kept-alive connections of its own.

When thousands of clients leave at once, every live engine leg needs an
abort. One new connection per abort floods the engine's accept queue, misses
every timeout and starves the health probes and new requests that share the
engine. So each worker gets one :class:`AbortQueue`:

- aborts wait in a FIFO of at most ``queue_size`` entries; a full queue
  refuses an abort at once (counted unacknowledged: the closed generate
  connection is then the engine's only signal);
- ``concurrency`` sender tasks drain it, each over one kept-alive connection
  of a pool apart from the worker's generate/probe pool, so aborts hold at
  most ``concurrency`` engine connections and requests at any time;
- where the engine's abort route takes a list, one request carries every
  waiting id, up to ``batch``: vLLM ``POST /abort_requests``
  ``{"request_ids": [...]}`` (``vllm/entrypoints/serve/disagg/api_router.py``,
  ``abort_requests``, which hands the list to ``EngineClient.abort``).
  SGLang's ``POST /abort_request`` takes one ``rid`` (or ``abort_all``)
  (``sglang/srt/entrypoints/http_server.py``, ``abort_request`` with an
  ``AbortReq``), so one id per request there;
- a try answered with a non-200 status is retried with backoff,
  :data:`ABORT_TRIES` tries in all; a try the engine has not answered
  within ``timeout`` ends unacknowledged and is never sent again: slow is
  not dead, the engine has the request, and a copy would only add to the
  load of an engine already slow to answer (and name the ids twice);
- a connection that closes before the answer's head leaves the abort
  unacknowledged, not sent again (the engine may have read it: the pool
  never re-sends one, :class:`~asgi_generate.exceptions.Unanswered`);
  the worker's own probe judges whether it is gone;
- a refused connect or a connection broken mid-answer means the worker is lost: that
  batch and everything queued behind it end at once as ``lost``, the worker
  is reported (``on_lost``: the router takes it out of the rotation and
  ends the requests riding it), and aborts for a worker
  marked down end as ``lost`` without being sent: nothing waits out retries
  against a dead host;
- a caller waits at most ``deadline`` seconds, queueing included; an abort
  every caller gave up on is skipped if not yet sent;
- an engine id is sent at most one abort: a caller naming an id whose abort
  is queued or in flight joins it (every caller gets the one answer), and
  the answer of an abort that was sent is kept for the last ``remember``
  ids and given to any later caller without sending again. Concurrent
  admin aborts, abort-all, a client's disconnect and a leg given up may all
  name the same leg; a duplicate abort is extra load at best, and breaks
  pipeline-parallel engines at worst (SGLang model gateway, PR 2426).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Callable

import anyio

from ..exceptions import ConnectFailed, TimedOut, Unanswered, WorkerDisconnected
from .http import ConnectionPool

if TYPE_CHECKING:
    from .router import Worker

log = logging.getLogger("asgi_generate.aborts")

#: Sends of one abort request answered with a non-200 status before it
#: counts as unacknowledged (an unanswered one is sent once).
ABORT_TRIES = 3
#: Seconds before the first retry; each next one waits four times longer.
FIRST_BACKOFF = 0.05
ACKED, UNACKNOWLEDGED, LOST = "acked", "unacknowledged", "lost"
_JSON = [(b"content-type", b"application/json")]


class _Abort:
    """One engine id waiting for its abort's answer."""

    __slots__ = ("engine_id", "result", "done", "given_up", "waiters", "sent")

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.result: str | None = None
        self.done = anyio.Event()
        self.given_up = False
        #: Callers waiting for this answer (joined duplicates included).
        self.waiters = 0
        #: Whether a request naming it went out (its answer is remembered).
        self.sent = False

    def settle(self, result: str) -> None:
        if self.result is None:
            self.result = result
            self.done.set()


class AbortQueue:
    """Sends one worker's engine aborts (see the module docstring).

    Args:
        worker: the worker (its protocol gives the abort route and body;
            ``worker.healthy`` false means aborts end as ``lost`` unsent).
        concurrency: abort requests in flight at once, each on its own
            kept-alive connection (at least 1).
        queue_size: aborts that may wait; more are refused as unacknowledged.
        batch: engine ids per request where the route takes a list.
        timeout: seconds a try has to connect and be answered; past them
            the abort is unacknowledged (not re-sent).
        deadline: seconds a caller waits for the answer, queueing included.
        remember: engine ids whose sent abort's answer is kept, so that a
            repeat is answered without a second abort (oldest forgotten
            first).
        on_lost: called with ``(worker, reason)`` when a connect is refused
            or a connection breaks.
    """

    def __init__(
        self,
        worker: "Worker",
        *,
        concurrency: int = 8,
        queue_size: int = 16384,
        batch: int = 512,
        timeout: float = 2.0,
        deadline: float = 30.0,
        remember: int = 65536,
        on_lost: Callable[["Worker", str], None] | None = None,
    ) -> None:
        self.worker = worker
        self.concurrency = max(1, concurrency)
        self.queue_size = queue_size
        self.batch = batch if worker.protocol.abort_takes_list else 1
        self.timeout = timeout
        self.deadline = deadline
        self.on_lost = on_lost
        self.pool = ConnectionPool(
            worker.pool.host,
            worker.pool.port,
            connect_timeout=timeout,
            max_idle=self.concurrency,
            # Keep-alives idle past the engine server's own timeout are
            # reopened: hypercorn and uvicorn close them after 5 s.
            idle_timeout=worker.pool.idle_timeout,
            ssl_context=worker.pool.ssl_context,
            tls_hostname=worker.pool.tls_hostname,
        )
        self._waiting: deque[_Abort] = deque()
        #: Aborts queued or in flight, by engine id (a duplicate joins one).
        self._pending: dict[str, _Abort] = {}
        #: Answers of sent aborts, by engine id, the last ``remember``.
        self._answered: OrderedDict[str, str] = OrderedDict()
        self.remember = remember
        self._wake = anyio.Event()
        self.in_flight = 0
        #: The most abort requests ever in flight at once (at most ``concurrency``).
        self.peak_in_flight = 0
        #: HTTP abort requests sent (one per batch and try).
        self.requests = 0
        #: Aborts refused because the queue was full.
        self.refused = 0
        #: Aborts whose caller stopped waiting at the deadline.
        self.expired = 0
        #: Aborts of an id already queued, in flight or answered: not sent again.
        self.duplicates = 0

    @property
    def queued(self) -> int:
        """Aborts waiting to be sent."""
        return len(self._waiting)

    async def abort(self, engine_id: str) -> str:
        """Abort ``engine_id`` (the id as minted; the protocol adds any
        prefix) and wait for the outcome: ``"acked"`` (HTTP 200),
        ``"unacknowledged"`` (refused, failed or past ``deadline``) or
        ``"lost"`` (the worker is down or went away)."""
        if not self.worker.healthy:
            return LOST
        item = self._pending.get(engine_id)
        if item is None:
            known = self._answered.get(engine_id)
            if known is not None:
                self.duplicates += 1
                return known
            if len(self._waiting) >= self.queue_size:
                self.refused += 1
                _log_sometimes(self.refused, "worker %s: abort queue full (%d); %d aborts refused so far",
                               self.worker.id, self.queue_size, self.refused)
                return UNACKNOWLEDGED
            item = self._pending[engine_id] = _Abort(engine_id)
            self._waiting.append(item)
            self._wake.set()
        else:
            self.duplicates += 1
        item.waiters += 1
        with anyio.move_on_after(self.deadline):
            await item.done.wait()
        item.waiters -= 1
        if item.result is None:
            if item.waiters == 0 and not item.sent:  # nobody waits: skip it, a later caller queues anew
                item.given_up = True
                self._pending.pop(engine_id, None)
            self.expired += 1
            _log_sometimes(self.expired, "worker %s: %d aborts unanswered after %g s so far",
                           self.worker.id, self.expired, self.deadline)
            return UNACKNOWLEDGED
        return item.result

    def _settle(self, item: _Abort, result: str) -> None:
        """End ``item`` with ``result`` for every caller; a sent one's
        answer is kept for repeats."""
        item.settle(result)
        if self._pending.get(item.engine_id) is item:
            del self._pending[item.engine_id]
        if item.sent:
            self._answered[item.engine_id] = result
            self._answered.move_to_end(item.engine_id)
            while len(self._answered) > self.remember:
                self._answered.popitem(last=False)

    async def run(self) -> None:
        """Run the sender tasks until cancelled, then close the connections."""
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self.concurrency):
                    tg.start_soon(self._sender)
        finally:
            with anyio.CancelScope(shield=True):
                await self.pool.aclose()

    def _take(self) -> list[_Abort]:
        batch: list[_Abort] = []
        while self._waiting and len(batch) < self.batch:
            item = self._waiting.popleft()
            if not item.given_up:
                batch.append(item)
        return batch

    async def _sender(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                if self._wake.is_set():
                    self._wake = anyio.Event()
                await self._wake.wait()
                continue
            if not self.worker.healthy:
                self._lose(batch)
                continue
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            for item in batch:
                item.sent = True
            result = UNACKNOWLEDGED
            try:
                result = await self._send(batch)
            finally:
                self.in_flight -= 1
                for item in batch:
                    self._settle(item, result)

    def _lose(self, batch: list[_Abort]) -> None:
        for item in batch:
            self._settle(item, LOST)
        while self._waiting:
            self._settle(self._waiting.popleft(), LOST)

    async def _send(self, batch: list[_Abort]) -> str:
        proto = self.worker.protocol
        body = proto.abort_body([item.engine_id for item in batch])
        delay = FIRST_BACKOFF
        for tries in range(1, ABORT_TRIES + 1):
            self.requests += 1
            try:
                with anyio.fail_after(self.timeout):
                    async with self.pool.request(b"POST", proto.abort_path, body, _JSON) as resp:
                        await resp.read()
                if resp.status == 200:
                    return ACKED
            except Unanswered as exc:
                # Read or not, it is not sent twice; a worker that is gone
                # refuses the next connect (or fails its probe).
                log.warning("worker %s closed the connection before answering the abort of %d request(s): %s",
                            self.worker.id, len(batch), exc)
                return UNACKNOWLEDGED
            except (ConnectFailed, WorkerDisconnected) as exc:
                # Gone, not slow: everything queued for it ends now.
                if self.on_lost is not None:
                    self.on_lost(self.worker, f"abort failed: {exc}")
                self._lose([])
                return LOST
            except (TimedOut, TimeoutError):
                # Slow is not dead: an engine this slow to accept or answer
                # gets no copy to add to its load; it may yet act on this one.
                log.warning("worker %s did not answer the abort of %d request(s) within %g s",
                            self.worker.id, len(batch), self.timeout)
                return UNACKNOWLEDGED
            if tries < ABORT_TRIES:
                await anyio.sleep(delay)
                delay *= 4
        log.warning("worker %s refused the abort of %d request(s) %d times", self.worker.id, len(batch), ABORT_TRIES)
        return UNACKNOWLEDGED

    def stats(self) -> dict:
        """Figures for ``/stats``."""
        return {
            "queued": len(self._waiting),
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "requests": self.requests,
            "refused": self.refused,
            "expired": self.expired,
            "duplicates": self.duplicates,
            # Cumulative: a connection is replaced after a timed-out try or
            # once idle past the pool's idle timeout.
            "connections_opened": self.pool.opened,
        }


def _log_sometimes(count: int, message: str, *args: object) -> None:
    # The 1st, 2nd, 4th, 8th, ... time: a storm shows in the log without flooding it.
    if count & (count - 1) == 0:
        log.warning(message, *args)
