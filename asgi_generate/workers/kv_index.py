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

Workers share one :class:`SharedBlocks` (up to 64 of them; a policy
starts another past that): block key -> the mask of workers holding it,
as Dynamo's KV router keeps one radix tree with a worker set per node. A
request's walk goes down its block keys once, narrowing the mask; each
worker's overlap is where it dropped out, the leading run a walk of that
worker's own set would count (a property test checks the two agree), in
one probe a key instead of one a key a worker. Predictions stay each
worker's own (a key predicted again expires with the later prediction),
probed only where that worker is still in the walk and lacks the key; a
walk expires only the indexes with predictions left to expire (kept as
they come and go), not every index it walks for.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter
from typing import Iterable, Sequence

from ..hashes import expire, mask_drop, mask_missing, mask_remove, mask_set, mask_walk
from .block_hash import ROOT, block_hashes, namespace_seed
from .kv_events import Cleared, Event, Removed, Stored

#: Workers one :class:`SharedBlocks` indexes at most (a mask is 64 bits).
MAX_WORKERS = 64


class SharedBlocks:
    """The blocks of up to :data:`MAX_WORKERS` workers, each a bit: block key
    -> mask of the workers whose engines hold it (``held``). Written only
    through each worker's :class:`KVIndex`, which keeps its own
    predictions (the walk probes them only where that worker still walks
    and does not hold the key)."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self._bits = 0  # bits given out
        #: The indexes with predictions yet to expire: the only ones a walk expires.
        self.predicting: set[KVIndex] = set()
        #: Counts changes of who is walked at which block size (an index's
        #: block size; its worker starting or stopping to publish, which
        #: the policy counts here): a policy's grouping of workers is
        #: good while this stands.
        self.layout = 0

    @property
    def full(self) -> bool:
        """Every bit given out."""
        return self._bits >= MAX_WORKERS

    def take_bit(self) -> int:
        """A new worker's bit (an int with one bit set).

        Raises:
            ValueError: :attr:`full`.
        """
        if self.full:
            raise ValueError(f"a SharedBlocks indexes at most {MAX_WORKERS} workers")
        self._bits += 1
        return 1 << (self._bits - 1)

    def overlaps(self, keys: list[int], indexes: Iterable["KVIndex"], now: float) -> dict["KVIndex", tuple[int, int]]:
        """:meth:`KVIndex.overlap` of each of ``indexes`` (this one's, all of
        one block size: ``keys`` are that size's block hashes), in one walk."""
        indexes = list(indexes)
        active = 0
        for index in indexes:
            active |= index.bit
        blocks, guessed = self.walk(keys, active, now)
        return {index: (blocks[index.slot], guessed[index.slot]) for index in indexes}

    def walk(self, keys: list[int], active: int, now: float) -> tuple[list[int], list[int]]:
        """The overlap of ``keys`` (block hashes, of the one block size of
        the indexes walked) on each index whose bit is in the mask
        ``active``, their predictions expired at ``now`` first: two lists
        of 64 by slot, the leading keys held or predicted and how many of
        those are predicted only (0 outside ``active``). Its cost grows
        with the keys walked and the indexes predicting, not with the
        indexes walked."""
        predicted = []
        for index in [index for index in self.predicting if index.bit & active]:  # expiry leaves the set
            index._expire(now)
            if index._predicted:
                predicted.append((index.slot, index._predicted))
        return mask_walk(keys, self.held, active, predicted)


class KVIndex:
    """The blocks of one worker (a :class:`~asgi_generate.workers.kv_events.Sink`),
    its bit in a :class:`SharedBlocks`.

    Args:
        max_blocks: blocks held at most; past it the index is dropped and
            rebuilt from the events that follow (an engine's cache is
            bounded; an index this large means removals were missed).
        ttl: seconds a prediction lasts.
        shared: the index it shares with other workers (``None``: one of
            its own).

    Raises:
        ValueError: ``shared`` is :attr:`~SharedBlocks.full`.

    Attributes:
        block_size: tokens per block, from the events (``None`` before the
            first ``BlockStored``) or the worker's discovery route.
        resets: drops by reason (``restart``, ``gap``, ``bad``,
            ``cleared``, ``overflow``, ``forgotten``).
        orphans: stored blocks skipped for an unknown parent.
        predicted, confirmed: blocks predicted, and those a later
            ``BlockStored`` confirmed.
    """

    # Slots: a policy reads the counts of hundreds of indexes per request.
    __slots__ = ("max_blocks", "ttl", "shared", "bit", "slot", "_block_size", "_keys", "_count", "_predicted",
                 "_expiry", "resets", "orphans", "predicted", "confirmed")

    def __init__(self, max_blocks: int, ttl: float, shared: SharedBlocks | None = None) -> None:
        self.max_blocks = max_blocks
        self.ttl = ttl
        self.shared = shared if shared is not None else SharedBlocks()
        self.bit = self.shared.take_bit()
        self.slot = self.bit.bit_length() - 1
        self._block_size: int | None = None
        self._keys: dict = {}  # engine hash -> our key
        self._count = 0  # keys whose held mask has our bit
        self._predicted: dict[int, float] = {}
        #: Each routed request's newly predicted keys, with their expiry.
        self._expiry: deque[tuple[float, list[int]]] = deque()
        self.resets: dict[str, int] = {}
        self.orphans = self.predicted = self.confirmed = 0

    @property
    def block_size(self) -> int | None:
        """Tokens per block (see the class docstring); setting a new one
        counts as a change of :attr:`SharedBlocks.layout`."""
        return self._block_size

    @block_size.setter
    def block_size(self, size: int | None) -> None:
        if size != self._block_size:
            self._block_size = size
            self.shared.layout += 1

    @property
    def blocks(self) -> int:
        """Blocks held now (by the engine's events)."""
        return self._count

    def apply(self, events: list[Event]) -> None:
        """Take one batch's events."""
        for event in events:
            if isinstance(event, Stored):
                self._store(event)
            elif isinstance(event, Removed):
                self._count -= mask_remove(event.hashes, self._keys, self.shared.held, self.bit)
            elif isinstance(event, Cleared):
                self.reset("cleared")
        if self._count > self.max_blocks:
            self.reset("overflow")

    def _store(self, event: Stored) -> None:
        size = event.block_size
        if self.block_size != size:
            if self._count:  # a block size never changes on a running engine: a new one
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
        # In bulk: one dict update and one C pass over the masks per event, not per block.
        self._keys.update(zip(event.hashes, ours))
        self._count += mask_set(ours, self.shared.held, self.bit)
        predicted = self._predicted
        if predicted:
            confirmed = predicted.keys() & ours
            for key in confirmed:
                del predicted[key]
            self.confirmed += len(confirmed)

    def reset(self, reason: str) -> None:
        """Forget every block (predictions too)."""
        self.resets[reason] = self.resets.get(reason, 0) + 1
        if self._count:  # every key with our bit: an engine hash reused for another block left its first one
            mask_drop(self.shared.held, self.bit)
        self._keys.clear()
        self._count = 0
        self._predicted.clear()
        self._expiry.clear()
        self.shared.predicting.discard(self)

    def overlap(self, keys: Sequence[int], now: float) -> tuple[int, int]:
        """How many leading ``keys`` (a list) are held or predicted
        (unexpired), and how many of those are predicted only: one probe a
        key, in C, up to the first key in neither
        (:meth:`SharedBlocks.overlaps` for this worker alone)."""
        return self.shared.overlaps(keys, (self,), now)[self]

    @property
    def pending(self) -> int:
        """Blocks predicted and not yet confirmed (as of the last expiry):
        prefills routed here that the engine has not stored yet."""
        return len(self._predicted)

    def predict(self, keys: Sequence[int], now: float, held: int = 0) -> None:
        """Count ``keys`` (a request routed here, a list) as held for ``ttl``
        seconds; ``held``: how many leading keys the engine is known to
        hold (an :meth:`overlap` with nothing guessed), not looked at again."""
        until = now + self.ttl
        predicted = self._predicted
        new = mask_missing(keys, self.shared.held, self.bit, held)
        before = len(predicted)
        # One dict built and one expiry entry per request, not per block: a
        # 2,000-token prompt at SGLang's page size 1 is 2,000 blocks.
        if predicted:
            predicted.update(dict.fromkeys(new, until))
        else:
            predicted = self._predicted = dict.fromkeys(new, until)
        self.predicted += len(predicted) - before
        self._expiry.append((until, new))
        self.shared.predicting.add(self)
        if len(predicted) > self.max_blocks:  # bounded, whatever the traffic
            self._expire(float("inf"))

    def _expire(self, now: float) -> None:
        expiry, predicted = self._expiry, self._predicted
        while expiry and expiry[0][0] <= now:
            until, keys = expiry.popleft()
            expire(keys, predicted, until)
        if not expiry:
            self.shared.predicting.discard(self)

    def stats(self) -> dict:
        """Sizes and counters, for ``/stats``."""
        return {"block_size": self.block_size, "blocks": self._count, "predicted_now": len(self._predicted),
                "predicted": self.predicted, "confirmed": self.confirmed, "orphans": self.orphans,
                "resets": dict(sorted(self.resets.items()))}


_COUNT = attrgetter("_count")
_PREDICTED = attrgetter("_predicted")


def held_and_pending(indexes: list[KVIndex]) -> tuple[list[int], list[int]]:
    """:attr:`KVIndex.blocks` and :attr:`KVIndex.pending` of each of
    ``indexes``, as two lists, read without a Python call per index."""
    return list(map(_COUNT, indexes)), list(map(len, map(_PREDICTED, indexes)))
