"""A router's routable workers of one group, kept between picks.

Per ``(protocol, role, minimum weight version)`` the router keeps the
workers :meth:`~asgi_generate.workers.fence.Fence.admits` in group order
(:class:`CandidateList`), rebuilt only when something that decides
routability changed (:attr:`~asgi_generate.workers.worker.Worker.generation`,
the fleet's weight version, the group itself), and their outstanding
requests counted as they change
(:class:`~asgi_generate.workers.outstanding.LoadIndex`): a pick reads no
worker one by one, whatever the fleet's size.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Callable, Collection, Sequence

from .outstanding import LoadIndex
from .policies import Candidates, loads_of

if TYPE_CHECKING:
    from .worker import Worker


class CandidateList:
    """The routable workers of one group, in group order (maybe none).

    Args:
        workers: the routable workers of the group, in group order.
        group_size: workers in the group, routable or not (the round-robin
            counter runs over the group).
        generation, target: the worker generation and the fleet weight
            version it was built at (:meth:`current`).

    Attributes:
        workers: as given.
        ids: frozenset of their ids.
    """

    def __init__(self, workers: list["Worker"], group_size: int, generation: int, target: str | None) -> None:
        self.workers = workers
        self.group_size = group_size
        self.generation, self.target = generation, target
        self.ids = frozenset(w.id for w in workers)
        self._indices = [w.index for w in workers]
        self._rank = {w.id: i for i, w in enumerate(workers)}
        self._position = {w: i for i, w in enumerate(workers)}
        self._loads = LoadIndex([w.inflight for w in workers])

    def current(self, generation: int, target: str | None) -> bool:
        """Whether it still lists the routable workers."""
        return self.generation == generation and self.target == target

    def close(self) -> None:
        """Stop counting loads (replaced)."""
        self._loads.close()

    def _start(self, start: int) -> int:
        """The position of the first worker at group index ``start`` or
        after, else 0: where round-robin order begins."""
        p = bisect_left(self._indices, start)
        return p if p < len(self._indices) else 0

    def least(self, start: int) -> "Worker":
        """The first worker with the fewest outstanding requests in
        round-robin order from group index ``start`` (at least one is
        listed)."""
        return self.workers[self._loads.first_least(self._start(start))]

    def rotated(self, start: int, exclude: Collection["Worker"]) -> Candidates:
        """The workers in round-robin order from group index ``start``,
        none of ``exclude`` (possibly none left)."""
        p = self._start(start)
        ws = self.workers[p:] + self.workers[:p] if p else self.workers
        if exclude:
            gone = [w for w in exclude if w in self._position]
            if gone:
                left = [w for w in ws if w not in gone]
                if not left:
                    return Candidates((), frozenset(), 0, 0)
                loads = loads_of(left)
                return Candidates(left, self.ids.difference(w.id for w in gone), min(loads), max(loads))
        return Candidates(ws, self.ids, self._loads.low, self._loads.high, self._rank, p)

    def least_of(self, candidates: Candidates, start: int) -> Callable[[Sequence["Worker"]], "Worker"]:
        """The ``least`` a policy is handed for ``candidates`` (from
        :meth:`rotated` at ``start``): counted for that very list, read at C
        speed for any other."""
        whole = len(candidates) == len(self.workers)  # none excluded: the loads counted are its loads

        def least(workers: Sequence["Worker"]) -> "Worker":
            if workers is candidates and whole:
                return self.least(start)
            loads = loads_of(workers)
            return workers[loads.index(min(loads))]

        return least
