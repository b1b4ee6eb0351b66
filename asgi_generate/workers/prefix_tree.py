"""A radix tree over prompts with a capacity and LRU eviction.

The keys (:func:`token_key`, :func:`text_key`) and the edge matching
(:func:`common_length`) are those of the cache-aware policy's fleet tree
(:mod:`asgi_generate.workers.fleet_tree`), which holds what one
:class:`PrefixTree` per worker would, in one tree whose nodes list their
workers; :class:`PrefixTree` is the one-tree-per-worker reading its tests
check it against, as SGLang's ``RadixCache`` (``mem_cache/radix_cache.py``)
is one tree over token ids.

Keys are ``str``: a token id prompt becomes one character per token
(:func:`token_key`), so matching and splitting run on C string operations
(``str.startswith`` with an offset) and a token costs 1 to 4 bytes, not a
Python int. A text prompt is its own characters (:func:`text_key`); the
first character of every key says which kind it is, so text and token
prompts never share a prefix.

Bounds: ``max_tokens`` characters stored in all (the first character
included) and ``max_nodes`` nodes; past either, least recently used leaves
are evicted, whole, until both hold again. A key longer than
``max_tokens`` is stored cut to it.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from typing import Iterable

from ..sdk._token_ids import as_u32

#: Code points a token id maps onto (ids beyond fold onto others: the tree
#: is an approximation, and real vocabularies stay far below).
_CODE_POINTS = 0x110000
TOKENS, TEXT = "\x01", "\x02"


def token_key(ids: list[int] | array) -> str:
    """The key of a token id prompt: :data:`TOKENS` then one character per id.

    ``ids``: a list, or the codec's packed ``array('I')``
    (:class:`~asgi_generate.sdk.PackedIds`), read as it is."""
    try:  # in C: about 5 times faster than chr() per id
        return TOKENS + as_u32(ids).tobytes().decode("utf-32-le", "surrogatepass")
    except (OverflowError, UnicodeDecodeError):  # an id past the code points
        return TOKENS + "".join(map(chr, (i % _CODE_POINTS for i in ids)))


def text_key(text: str) -> str:
    """The key of a text prompt: :data:`TEXT` then the text."""
    return TEXT + text


class _Node:
    __slots__ = ("edge", "children", "parent", "stamp")

    def __init__(self, edge: str, parent: "_Node | None", stamp: int) -> None:
        self.edge = edge
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.stamp = stamp


def common_length(edge: str, key: str, pos: int) -> int:
    """How many leading characters of ``edge`` ``key`` has at ``pos``
    (at least 1: the caller found ``edge`` by ``key[pos]``)."""
    lo, hi = 1, min(len(edge), len(key) - pos)
    while lo < hi:  # largest m with key[pos:pos+m] == edge[:m]
        mid = (lo + hi + 1) // 2
        if key.startswith(edge[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """A radix tree of keys with LRU eviction.

    Args:
        max_tokens: characters (tokens) it may hold, >= 1.
        max_nodes: nodes it may hold besides the root, >= 1.

    Attributes:
        tokens: characters held now.
        nodes: nodes held now (the root not counted).
        evicted_tokens: characters evicted so far.
    """

    def __init__(self, max_tokens: int, max_nodes: int) -> None:
        if max_tokens < 1 or max_nodes < 1:
            raise ValueError("a prefix tree needs room for at least one token and one node")
        self.max_tokens = max_tokens
        self.max_nodes = max_nodes
        self._clock = itertools.count(1)
        self.clear()
        self.evicted_tokens = 0

    def clear(self) -> None:
        """Forget everything (an engine's cache flush)."""
        self._root = _Node("", None, 0)
        self.tokens = 0
        self.nodes = 0
        # (stamp, tie, node) of leaves; stale entries are skipped when popped.
        self._leaves: list[tuple[int, int, _Node]] = []
        self._tie = itertools.count()

    def match(self, key: str) -> int:
        """Length of the longest prefix of ``key`` the tree holds. Reads
        only: the recency of what it matched is unchanged."""
        node, pos, n = self._root, 0, len(key)
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                break
            edge = child.edge
            if not key.startswith(edge, pos):
                return pos + common_length(edge, key, pos)
            pos += len(edge)
            node = child
        return pos

    def insert(self, key: str) -> int:
        """Add ``key`` (cut to ``max_tokens``), mark its whole path most
        recently used, then evict to the bounds. Returns the length that was
        already held (:meth:`match` before the insert)."""
        key = key[: self.max_tokens]
        stamp = next(self._clock)
        node, pos, n = self._root, 0, len(key)
        held = None
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                break
            edge = child.edge
            if not key.startswith(edge, pos):
                held = pos + common_length(edge, key, pos)
                child = self._split(child, held - pos)
            pos += len(child.edge)
            child.stamp = stamp
            node = child
        if held is None:
            held = pos
        if pos < n:
            leaf = _Node(key[pos:], node, stamp)
            node.children[key[pos]] = leaf
            self.tokens += n - pos
            self.nodes += 1
            node = leaf
        if node is not self._root and not node.children:
            heapq.heappush(self._leaves, (stamp, next(self._tie), node))
        self._evict()
        return held

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` characters; return the new
        upper node, which takes its place."""
        parent = child.parent
        upper = _Node(child.edge[:at], parent, child.stamp)
        child.edge = child.edge[at:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        parent.children[upper.edge[0]] = upper
        self.nodes += 1
        return upper

    def _evict(self) -> None:
        leaves = self._leaves
        while self.tokens > self.max_tokens or self.nodes > self.max_nodes:
            stamp, _, node = heapq.heappop(leaves)
            if node.parent is None or node.children or node.stamp != stamp:
                continue  # stale: removed, no longer a leaf, or used since
            parent = node.parent
            del parent.children[node.edge[0]]
            node.parent = None
            self.tokens -= len(node.edge)
            self.evicted_tokens += len(node.edge)
            self.nodes -= 1
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.stamp, next(self._tie), parent))
        if len(leaves) > 2 * self.nodes + 64:  # too many stale entries: rebuild
            self._leaves = [(n.stamp, next(self._tie), n) for n in self._walk() if not n.children]
            heapq.heapify(self._leaves)

    def _walk(self) -> Iterable[_Node]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
