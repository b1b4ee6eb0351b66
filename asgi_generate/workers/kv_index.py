"""One worker's KV index: the blocks its engine says it caches, and the
blocks this frontend predicts it will.

Blocks are keyed by hashes the frontend computes itself from token ids
(:func:`~asgi_generate.workers.block_hash.block_hashes`, seeded by the
storing request's ``cache_salt``): engines hash differently (vLLM SHA-256
or its own builtin hash of an int64, seeded by ``PYTHONHASHSEED`` in older
versions; SGLang int64 of its page hashes), so an engine's hash is used only
to find the block a ``BlockRemoved`` or a child's ``parent_block_hash``
names. A ``BlockStored`` whose parent the index does not hold (its store
was missed) is skipped: without the prefix its key cannot be computed.

Predictions (sibling placement, after Dynamo's
``--router-predicted-ttl-secs``): a request routed here has its blocks
counted as held for ``ttl`` seconds, so the rest of its group (best-of-N, a
GRPO group sent as separate requests) follows it before the engine has
published anything. A ``BlockStored`` of a predicted block confirms it.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from ._blockhash import expire, missing, walk
from .block_hash import ROOT, block_hashes, namespace_seed
from .kv_events import Cleared, Event, Removed, Stored


class KVIndex:
    """The blocks of one worker (a :class:`~asgi_generate.workers.kv_events.Sink`).

    Args:
        max_blocks: blocks held at most; past it the index is dropped and
            rebuilt from the events that follow (an engine's cache is
            bounded; an index this large means removals were missed).
        ttl: seconds a prediction lasts.

    Attributes:
        block_size: tokens per block, from the events (``None`` before the
            first ``BlockStored``) or the worker's discovery route.
        resets: drops by reason (``restart``, ``gap``, ``bad``,
            ``cleared``, ``overflow``, ``forgotten``).
        orphans: stored blocks skipped for an unknown parent.
        predicted, confirmed: blocks predicted, and those a later
            ``BlockStored`` confirmed.
    """

    def __init__(self, max_blocks: int, ttl: float) -> None:
        self.max_blocks = max_blocks
        self.ttl = ttl
        self.block_size: int | None = None
        self._keys: dict = {}  # engine hash -> our key
        self._held: set[int] = set()
        self._predicted: dict[int, float] = {}
        #: Each routed request's newly predicted keys, with their expiry.
        self._expiry: deque[tuple[float, list[int]]] = deque()
        self.resets: dict[str, int] = {}
        self.orphans = self.predicted = self.confirmed = 0

    @property
    def blocks(self) -> int:
        """Blocks held now (by the engine's events)."""
        return len(self._held)

    def apply(self, events: list[Event]) -> None:
        """Take one batch's events."""
        for event in events:
            if isinstance(event, Stored):
                self._store(event)
            elif isinstance(event, Removed):
                pop = self._keys.pop
                self._held.difference_update([pop(h, None) for h in event.hashes])
            elif isinstance(event, Cleared):
                self.reset("cleared")
        if len(self._held) > self.max_blocks:
            self.reset("overflow")

    def _store(self, event: Stored) -> None:
        size = event.block_size
        if self.block_size != size:
            if self._held:  # a block size never changes on a running engine: a new one
                self.reset("restart")
            self.block_size = size
        if event.parent is None:
            parent = None
            seed = namespace_seed((event.salt,)) if event.salt else ROOT
        else:
            parent = self._keys.get(event.parent)
            if parent is None:
                self.orphans += len(event.hashes)
                return
            seed = ROOT
        ours = block_hashes(seed, event.token_ids, size, parent)
        if len(ours) > len(event.hashes):  # fewer engine hashes than blocks: index those named
            ours = ours[: len(event.hashes)]
        # In bulk: one dict update and one set update per event, not per block.
        self._keys.update(zip(event.hashes, ours))
        self._held.update(ours)
        predicted = self._predicted
        if predicted:
            confirmed = predicted.keys() & ours
            for key in confirmed:
                del predicted[key]
            self.confirmed += len(confirmed)

    def reset(self, reason: str) -> None:
        """Forget every block (predictions too)."""
        self.resets[reason] = self.resets.get(reason, 0) + 1
        self._keys.clear()
        self._held.clear()
        self._predicted.clear()
        self._expiry.clear()

    def overlap(self, keys: Sequence[int], now: float) -> tuple[int, int]:
        """How many leading ``keys`` (a list) are held or predicted
        (unexpired), and how many of those are predicted only: one probe a
        key, in C, up to the first key in neither."""
        self._expire(now)
        return walk(keys, self._held, self._predicted)

    @property
    def pending(self) -> int:
        """Blocks predicted and not yet confirmed (as of the last expiry):
        prefills routed here that the engine has not stored yet."""
        return len(self._predicted)

    def predict(self, keys: Sequence[int], now: float) -> None:
        """Count ``keys`` (a request routed here) as held for ``ttl`` seconds."""
        until = now + self.ttl
        predicted = self._predicted
        new = missing(keys, self._held)
        before = len(predicted)
        # One dict update and one expiry entry per request, not per block: a
        # 2,000-token prompt at SGLang's page size 1 is 2,000 blocks.
        predicted.update(dict.fromkeys(new, until))
        self.predicted += len(predicted) - before
        self._expiry.append((until, new))
        if len(predicted) > self.max_blocks:  # bounded, whatever the traffic
            self._expire(float("inf"))

    def _expire(self, now: float) -> None:
        expiry, predicted = self._expiry, self._predicted
        while expiry and expiry[0][0] <= now:
            until, keys = expiry.popleft()
            expire(keys, predicted, until)

    def stats(self) -> dict:
        """Sizes and counters, for ``/stats``."""
        return {"block_size": self.block_size, "blocks": len(self._held), "predicted_now": len(self._predicted),
                "predicted": self.predicted, "confirmed": self.confirmed, "orphans": self.orphans,
                "resets": dict(sorted(self.resets.items()))}
