"""Outstanding requests counted as they change, so a router finds the least
loaded of hundreds of workers without reading each one.

A worker's ``inflight`` set is a :class:`Legs`: when its size changes it
tells the :class:`LoadIndex` objects watching it. A load index keeps, over
a fixed list of such sets (a router's candidates, by position), the
positions at each load in ascending order, so the fewest and the most
outstanding, and the first position with the fewest from a round-robin
start, are read in O(log n) rather than by visiting every worker.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any, Iterable


class Legs(set):
    """The legs riding a worker (a ``set``), telling each open
    :class:`LoadIndex` watching it when its size changes.

    Every method that changes the set tells them, so a count read through
    an index is always ``len`` of the set.
    """

    __slots__ = ("watchers",)

    def __init__(self, legs: Iterable[Any] = ()) -> None:
        super().__init__(legs)
        #: ``(index, position)``: the indexes counting this set, and where.
        self.watchers: list[tuple[LoadIndex, int]] = []

    def watch(self, index: "LoadIndex", position: int) -> None:
        """Tell ``index`` of every change in size from now on, as its
        ``position``; indexes closed since are dropped here."""
        self.watchers = [w for w in self.watchers if w[0].open]
        self.watchers.append((index, position))

    def add(self, leg: Any) -> None:
        """``set.add``, counted."""
        before = len(self)
        set.add(self, leg)
        if len(self) != before:
            self._moved(before)

    def discard(self, leg: Any) -> None:
        """``set.discard``, counted."""
        before = len(self)
        set.discard(self, leg)
        if len(self) != before:
            self._moved(before)

    def _moved(self, before: int) -> None:
        after = len(self)
        closed = False
        for index, position in self.watchers:
            if index.open:
                index.move(position, before, after)
            else:
                closed = True
        if closed:
            self.watchers = [w for w in self.watchers if w[0].open]


def _counted(name: str) -> Any:
    """``set``'s method ``name``, telling the watchers when the size changed."""
    method = getattr(set, name)

    def counted(self: Legs, *args: Any) -> Any:
        before = len(self)
        result = method(self, *args)
        if len(self) != before:
            self._moved(before)
        return result

    counted.__name__ = counted.__qualname__ = name
    counted.__doc__ = f"``set.{name}``, counted."
    return counted


# The rest of set's changing methods: rarely used (tests set a worker's
# load whole), but none may change the size unseen.
for _name in ("remove", "pop", "clear", "update", "difference_update", "intersection_update",
              "symmetric_difference_update", "__ior__", "__iand__", "__isub__", "__ixor__"):
    setattr(Legs, _name, _counted(_name))
del _name


class LoadIndex:
    """The sizes of a fixed list of :class:`Legs` (positions ``0 .. n-1``),
    kept as they change.

    Attributes:
        low, high: the fewest and the most outstanding at any position (0
            for no position).
        open: counting; :meth:`close` stops it (its sets drop it at their
            next change or watch).
    """

    def __init__(self, legs: list[Legs]) -> None:
        self.open = True
        # load -> positions at that load, ascending
        self._at: dict[int, list[int]] = {}
        for position, riding in enumerate(legs):
            self._at.setdefault(len(riding), []).append(position)
            riding.watch(self, position)
        self.low = min(self._at, default=0)
        self.high = max(self._at, default=0)

    def close(self) -> None:
        """Stop counting (the candidate list it served was replaced)."""
        self.open = False

    def move(self, position: int, before: int, after: int) -> None:
        """The set at ``position`` went from ``before`` legs to ``after``."""
        at = self._at
        bucket = at[before]
        del bucket[bisect_left(bucket, position)]
        if not bucket:
            del at[before]
        insort(at.setdefault(after, []), position)
        # A leg at a time moves a count by one: then the new extreme is known.
        if after < self.low:
            self.low = after
        elif before == self.low and before not in at:
            self.low = after if after == before + 1 else min(at)
        if after > self.high:
            self.high = after
        elif before == self.high and before not in at:
            self.high = after if after == before - 1 else max(at)

    def first_least(self, start: int) -> int:
        """The first position with the fewest outstanding at or after
        ``start``, else the first with the fewest (round-robin order); at
        least one position."""
        bucket = self._at[self.low]
        i = bisect_left(bucket, start)
        return bucket[i] if i < len(bucket) else bucket[0]
