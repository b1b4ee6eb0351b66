"""The simulator's prefix cache: token blocks chained by hash, in namespaces, LRU.

Both engines cache a prompt's KV in fixed-size blocks (vLLM's
``--block-size``, default 16, ``vllm/v1/core/kv_cache_utils.py``
``hash_block_tokens``: a full block's hash covers its parent's hash and its
own token ids; SGLang's radix cache in pages of ``--page-size`` tokens,
default 1, ``mem_cache/radix_cache.py``). A block is found by the hash of
its whole prefix, so a hit is a run of leading blocks.

Namespaces keep requests apart that must not share KV: SGLang keys every
page by ``(extra_key, cache_salt)`` (``RadixKey.child_key_at``), vLLM puts
``cache_salt`` into the first block's hash (``generate_block_hash_extra_keys``
in ``kv_cache_utils.py``), and either way no block of one namespace is found
from another; here the keys are each engine's own
(:mod:`asgi_generate.sim.block_hash`).

Eviction: least recently used first, a block only once no cached block
hangs under it (its children are always evicted before it). vLLM evicts
block by block (its free-block queue hands out a freed request's tail blocks
first); SGLang evicts a whole radix node, the run of pages one insert added
(``RadixCache.evict``), which ``whole_runs`` plays. Running requests'
blocks are not pinned.

Keys are the 64-bit ints the engine publishes in KV events (SGLang's
paired with the ``extra_key`` its events leave out); a consumer matches
blocks by the token ids an event carries and uses the hash only to name a
block it removes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


#: The default capacity in tokens (``sim --cache-tokens``): the order of a
#: 7-8B model's KV pool on a 24 GB GPU (128 KiB of KV per token, 8 GiB), and
#: small enough that a long benchmark evicts.
DEFAULT_CACHE_TOKENS = 65536

class _Block:
    __slots__ = ("parent", "children", "first")

    def __init__(self, parent: Hashable | None, first: bool) -> None:
        self.parent = parent
        self.children = 0
        #: The first block one insert added (a radix node's start).
        self.first = first


class PrefixCache:
    """Full blocks of token ids, found by their prefix's hash.

    Args:
        capacity_tokens: tokens held at most, >= ``block``; whole blocks.
        block: tokens per block, >= 1.
        whole_runs: evict a radix node whole (SGLang), not block by block.

    Attributes:
        evicted_blocks: blocks evicted so far.
    """

    def __init__(self, capacity_tokens: int, block: int, whole_runs: bool = False) -> None:
        if block < 1 or capacity_tokens < block:
            raise ValueError(f"a prefix cache needs room for one block of {block} tokens, got {capacity_tokens}")
        self.block = block
        self.whole_runs = whole_runs
        self.capacity = capacity_tokens // block
        # Least recently used first; a parent is always after its children.
        self._blocks: OrderedDict[Hashable, _Block] = OrderedDict()
        self.evicted_blocks = 0

    @property
    def tokens(self) -> int:
        """Tokens held now."""
        return len(self._blocks) * self.block

    def match(self, hashes: list[Hashable]) -> int:
        """How many leading blocks of ``hashes`` are held. Reads only."""
        held = 0
        for h in hashes:
            if h not in self._blocks:
                break
            held += 1
        return held

    def insert(self, hashes: list[Hashable]) -> tuple[int, list[Hashable]]:
        """Hold the blocks ``hashes`` (a chain of keys from :mod:`~asgi_generate.sim.block_hash`),
        mark the whole chain most recently used, then evict to capacity.

        Returns:
            how many leading blocks were held already (the rest are newly
            stored, a ``BlockStored`` event's), and the hashes evicted, in
            eviction order (a ``BlockRemoved`` event's); a block stored and
            evicted at once is in both.
        """
        blocks = self._blocks
        new = self.match(hashes)
        parent = hashes[new - 1] if new else None
        if parent is not None:
            blocks[parent].children += 1 if new < len(hashes) else 0
        for i in range(new, len(hashes)):
            blocks[hashes[i]] = _Block(hashes[i - 1] if i else None, i == new)
            if i + 1 < len(hashes):
                blocks[hashes[i]].children = 1
        for h in reversed(hashes):  # the parent after its children
            blocks.move_to_end(h)
        return new, self._evict()

    def _evict(self) -> list[Hashable]:
        blocks = self._blocks
        gone = []
        while len(blocks) > self.capacity:
            h, node = blocks.popitem(last=False)
            gone.append(h)
            while node.parent is not None:
                parent = blocks[node.parent]
                parent.children -= 1
                if node.first or parent.children or not self.whole_runs:
                    break
                gone.append(node.parent)
                node = blocks.pop(node.parent)
        self.evicted_blocks += len(gone)
        return gone

    def clear(self) -> bool:
        """Forget every block; whether any was held."""
        had = bool(self._blocks)
        self._blocks.clear()
        return had
