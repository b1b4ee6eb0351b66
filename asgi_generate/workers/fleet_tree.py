"""One radix tree of the prompts routed to the whole fleet, each node
listing the workers that hold it: the cache-aware policy's approximation of
every engine's prefix cache.

As in sglang-router's tree (``sgl-router/src/policies/tree.rs``), a node
maps each worker holding it to the stamp of that worker's last use of it,
and a worker holding a node holds its parent. A key is walked once,
whatever the fleet's size: :meth:`FleetTree.deepest` gives the longest
prefix of it any of some candidates hold, and which of them hold it.

Bounds are per worker, as one
:class:`~asgi_generate.workers.prefix_tree.PrefixTree` per worker had
them: ``max_tokens`` characters and ``max_nodes`` nodes held (a node that
another worker's key splits counts twice for each worker holding it).
Past either, at once on every insert, the worker lets go of its least
recently used leaves (nodes it holds with no child it holds) until both
hold again; a node no worker holds leaves the tree. A key longer than
``max_tokens`` is stored cut to it.

Keys are :func:`~asgi_generate.workers.prefix_tree.token_key` and
:func:`~asgi_generate.workers.prefix_tree.text_key` strings.
"""

from __future__ import annotations

import heapq
import itertools
from types import MappingProxyType
from typing import Any, Collection, Mapping

from .prefix_tree import common_length

#: A leaf's children: shared, read-only (a leaf costs no dict of its own).
_NO_CHILDREN: Mapping[str, "_Node"] = MappingProxyType({})
#: Holders past which a node's holders among one candidate set are kept
#: (:meth:`FleetTree.deepest`): intersecting them costs per holder.
MEMO_HOLDERS = 16
#: Nodes whose holders among candidates are kept at most.
MEMO_NODES = 256


class _Node:
    __slots__ = ("edge", "children", "parent", "holders", "stamp", "kids")

    def __init__(self, edge: str, parent: "_Node | None") -> None:
        self.edge = edge
        self.children: Any = _NO_CHILDREN
        self.parent = parent
        # Who holds it: nobody (None), one worker (its id; its stamp in
        # ``stamp``, and how many of the children it holds in ``kids``: most
        # nodes, with no dict of their own) or several (worker id -> stamp;
        # each one's count of children held in its _Holder.kids).
        self.holders: str | dict[str, int] | None = None
        self.stamp = 0
        self.kids = 0

    def __lt__(self, other: "_Node") -> bool:
        # Leaf heaps order by stamp; nodes tied on one are in any order
        # (no tie-breaking counter: an int less per leaf).
        return False

    def holder_ids(self) -> Collection[str]:
        """The ids of the workers holding it."""
        holders = self.holders
        if holders.__class__ is dict:
            return holders
        return () if holders is None else (holders,)

    def stamp_of(self, wid: str) -> int | None:
        """Worker ``wid``'s last use of it, ``None`` if it does not hold it."""
        holders = self.holders
        if holders.__class__ is dict:
            return holders.get(wid)
        return self.stamp if holders == wid else None

    def kids_of(self, kids: dict["_Node", int]) -> int:
        """How many of its children a worker holding it holds (``kids``:
        that worker's counts)."""
        return kids.get(self, 0) if self.holders.__class__ is dict else self.kids

    def add_kids(self, kids: dict["_Node", int], delta: int) -> int:
        """A worker holding it (``kids``: its counts) holds ``delta`` more of
        its children; returns how many it holds now."""
        if self.holders.__class__ is dict:
            left = kids.get(self, 0) + delta
            if left:
                kids[self] = left
            else:
                kids.pop(self, None)
            return left
        self.kids += delta
        return self.kids

    def hold(self, wid: str, stamp: int, holders_of: dict[str, "_Holder"]) -> bool:
        """Worker ``wid`` holds it, last used at ``stamp``; whether it did
        not before (``holders_of``: every worker's share)."""
        holders = self.holders
        if holders is None:
            self.holders, self.stamp = wid, stamp
            return True
        if holders.__class__ is dict:
            new = wid not in holders
            holders[wid] = stamp
            return new
        if holders == wid:
            self.stamp = stamp
            return False
        if self.kids:  # the first holder's count moves to its own counts
            holders_of[holders].kids[self] = self.kids
            self.kids = 0
        self.holders = {holders: self.stamp, wid: stamp}
        return True

    def release(self, wid: str, holders_of: dict[str, "_Holder"]) -> bool:
        """Worker ``wid`` (a holder) lets go of it; whether nobody holds it
        now."""
        holders = self.holders
        if holders.__class__ is dict:
            del holders[wid]
            if len(holders) == 1:
                ((last, self.stamp),) = holders.items()
                self.holders = last
                self.kids = holders_of[last].kids.pop(self, 0)
            return False
        self.holders = None
        self.kids = 0
        return True


class _Holder:
    """One worker's share of the tree."""

    __slots__ = ("tokens", "nodes", "evicted_tokens", "leaves", "kids")

    def __init__(self) -> None:
        self.tokens = self.nodes = self.evicted_tokens = 0
        # (stamp, node) of its leaves; stale entries are skipped when popped.
        self.leaves: list[tuple[int, _Node]] = []
        # node -> how many of its children it holds, for nodes several
        # workers hold and it holds children of (see _Node.kids)
        self.kids: dict[_Node, int] = {}


class FleetTree:
    """A radix tree of keys shared by the fleet, bounded per worker.

    Args:
        max_tokens: characters each worker may hold, >= 1.
        max_nodes: nodes each worker may hold, >= 1.

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(self, max_tokens: int, max_nodes: int) -> None:
        if max_tokens < 1 or max_nodes < 1:
            raise ValueError("a prefix tree needs room for at least one token and one node per worker")
        self.max_tokens = max_tokens
        self.max_nodes = max_nodes
        self._root = _Node("", None)
        self._holders: dict[str, _Holder] = {}
        self._clock = itertools.count(1)
        # node -> (candidate ids, those of them holding it), for nodes many hold
        self._memo: dict[_Node, tuple[frozenset[str], frozenset[str]]] = {}

    def _path(self, key: str) -> list[tuple[_Node, int]]:
        """``(node, characters of key matched through it)`` along ``key``."""
        path = []
        node, pos, n = self._root, 0, len(key)
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                break
            edge = child.edge
            if not key.startswith(edge, pos):
                path.append((child, pos + common_length(edge, key, pos)))
                break
            pos += len(edge)
            path.append((child, pos))
            node = child
        return path

    def deepest(self, key: str, ids: frozenset[str]) -> tuple[int, frozenset[str]]:
        """The characters of ``key`` (the kind marker counted) the workers of
        ``ids`` that hold the most of it hold, and those workers' ids;
        ``(0, frozenset())`` when none holds any."""
        memo = self._memo
        for node, matched in reversed(self._path(key)):
            holders = node.holder_ids()
            if len(holders) < MEMO_HOLDERS:
                held = ids.intersection(holders)
                if held:
                    return matched, held
                continue
            if ids.isdisjoint(holders):
                continue
            kept = memo.get(node)
            if kept is None or kept[0] is not ids:
                if len(memo) >= MEMO_NODES:
                    memo.clear()
                kept = memo[node] = (ids, ids.intersection(holders))
            return matched, kept[1]
        return 0, frozenset()

    def held(self, key: str, ids: frozenset[str]) -> dict[str, int]:
        """Worker id to the characters of ``key`` it holds (the kind marker
        counted), for each of ``ids`` holding more than the marker."""
        out: dict[str, int] = {}
        for node, matched in self._path(key):
            if matched > 1:
                out.update(dict.fromkeys(ids.intersection(node.holder_ids()), matched))
        return out

    def tokens(self, wid: str) -> int:
        """Characters worker ``wid`` holds."""
        holder = self._holders.get(wid)
        return holder.tokens if holder is not None else 0

    def insert(self, wid: str, key: str) -> None:
        """Worker ``wid`` holds ``key`` (cut to ``max_tokens``), its whole
        path its most recently used; then every worker whose share grew is
        brought back within the bounds."""
        holder = self._holders.get(wid)
        if holder is None:
            holder = self._holders[wid] = _Holder()
        key = key[: self.max_tokens]
        stamp = next(self._clock)
        root = node = self._root
        pos, n = 0, len(key)
        split = None
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                break
            edge = child.edge
            if not key.startswith(edge, pos):
                child = split = self._split(child, common_length(edge, key, pos))
            pos += len(child.edge)
            self._hold(wid, holder, child, stamp)
            node = child
        if pos < n:
            leaf = _Node(key[pos:], node)
            if node.children is _NO_CHILDREN:
                node.children = {}
            node.children[key[pos]] = leaf
            self._hold(wid, holder, leaf, stamp)
            node = leaf
        if node is not root and not node.kids_of(holder.kids):
            heapq.heappush(holder.leaves, (stamp, node))
        self._evict(wid, holder)
        if split is not None:  # the split node counts once more for each of its holders
            for other in list(split.holder_ids()):
                self._evict(other, self._holders[other])

    def _hold(self, wid: str, holder: _Holder, node: _Node, stamp: int) -> None:
        if node.hold(wid, stamp, self._holders):
            holder.tokens += len(node.edge)
            holder.nodes += 1
            parent = node.parent
            if parent is not self._root:
                parent.add_kids(holder.kids, 1)
            self._memo.pop(node, None)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` characters; return the new upper
        node, which takes its place, held by the same workers."""
        parent = child.parent
        upper = _Node(child.edge[:at], parent)
        holders = child.holders
        upper.stamp = child.stamp
        child.edge = child.edge[at:]
        child.parent = upper
        upper.children = {child.edge[0]: child}
        parent.children[upper.edge[0]] = upper
        # Each holder holds the one child, counted where one holder's count is.
        if holders.__class__ is dict:
            upper.holders = dict(holders)
            for wid in holders:
                holder = self._holders[wid]
                holder.nodes += 1
                holder.kids[upper] = 1
        else:
            upper.holders, upper.kids = holders, 1
            self._holders[holders].nodes += 1
        return upper

    def _detach(self, node: _Node) -> None:
        """Take ``node`` (no worker holds it) out of the tree."""
        parent = node.parent
        children = parent.children
        del children[node.edge[0]]
        if not children:
            parent.children = _NO_CHILDREN
        node.parent = None

    def _evict(self, wid: str, holder: _Holder) -> None:
        leaves, kids = holder.leaves, holder.kids
        while holder.tokens > self.max_tokens or holder.nodes > self.max_nodes:
            stamp, node = heapq.heappop(leaves)
            if node.stamp_of(wid) != stamp or node.kids_of(kids):
                continue  # stale: let go of, no longer a leaf of it, or used since
            empty = node.release(wid, self._holders)
            self._memo.pop(node, None)
            size = len(node.edge)
            holder.tokens -= size
            holder.nodes -= 1
            holder.evicted_tokens += size
            parent = node.parent
            if empty:
                self._detach(node)
            if parent is not self._root and not parent.add_kids(kids, -1):
                heapq.heappush(leaves, (parent.stamp_of(wid), parent))
        if len(leaves) > 2 * holder.nodes + 64:  # too many stale entries: keep the live ones
            live = {}
            for entry in leaves:
                stamp, node = entry
                if node.stamp_of(wid) == stamp and not node.kids_of(kids):
                    live[node] = entry
            holder.leaves = list(live.values())
            heapq.heapify(holder.leaves)

    def forget(self, wid: str) -> None:
        """Worker ``wid`` holds nothing any more."""
        holder = self._holders.pop(wid, None)
        if holder is None:
            return
        root = self._root
        # Every node it holds is on the way up from one of its leaves.
        for _, node in holder.leaves:
            while node is not root and node.stamp_of(wid) is not None:
                empty = node.release(wid, self._holders)
                self._memo.pop(node, None)
                parent = node.parent
                if empty:
                    self._detach(node)
                node = parent

    def stats(self) -> dict[str, dict[str, int]]:
        """Worker id to its ``tokens``, ``nodes`` and ``evicted_tokens``,
        for each worker the tree learned of since it last forgot it."""
        return {wid: {"tokens": h.tokens, "nodes": h.nodes, "evicted_tokens": h.evicted_tokens}
                for wid, h in sorted(self._holders.items())}
