"""Routing policies: which worker of a role a request goes to.

The router (:class:`~asgi_generate.workers.router.Router`) hands a policy
the healthy workers a request may use (its role, its protocol, none it
already failed on), in round-robin order as :class:`Candidates` (their ids
and load spread read already), and a ``least`` function: least outstanding
requests, ties round-robin, today's rule and every policy's fallback.
Policies:

- ``least-outstanding`` (:class:`Policy`, the default): ``least``.
- ``session`` (:mod:`.session`): rendezvous hashing on a session key
  header, with bounded load.
- ``cache-aware`` (:mod:`.cache_aware`): longest prefix match against an
  approximate prefix tree of the fleet whose nodes list their workers,
  least outstanding when load is imbalanced.
- ``kv-aware`` (:mod:`.kv_aware`): the blocks each engine's KV cache
  events say it holds, and this frontend's recent decisions, against load.

In P/D the policy picks the prefill worker; the decode worker is always
least outstanding. A policy only chooses the worker: answers and trace
records are the same whichever it picks.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Collection, Mapping, Protocol, Sequence, TypeVar

from ...config import POLICIES

if TYPE_CHECKING:
    from ..engine_load import LoadShare
    from ...sdk._codec import GenerateRequest
    from ...config import Settings


class Candidate(Protocol):
    """A worker as a policy sees it (the router's
    :class:`~asgi_generate.workers.router.Worker`)."""

    id: str
    url: str
    #: The legs riding it now (:class:`~asgi_generate.workers.router.InFlight`).
    inflight: Collection[Any]

    @property
    def outstanding(self) -> int:
        """Requests in flight on it."""


W = TypeVar("W", bound=Candidate)
#: The router's least-outstanding choice among candidates (never empty).
Least = Callable[[Sequence[W]], W]

_ID = attrgetter("id")
_INFLIGHT = attrgetter("inflight")


def loads_of(candidates: Sequence[Candidate]) -> list[int]:
    """Each candidate's outstanding requests (``len`` of its ``inflight``),
    read at C speed: no Python call per worker."""
    return list(map(len, map(_INFLIGHT, candidates)))


class Candidates(list):
    """The candidates of one request, as the router hands them to a policy:
    a list of workers in round-robin order (never empty), with what the
    router read of them already. :meth:`of` makes one from any sequence.

    Attributes:
        ids: frozenset of their ids (the router keeps it between picks).
        low, high: the fewest and the most outstanding requests among them.
    """

    __slots__ = ("ids", "low", "high", "_rank", "_offset")

    def __init__(self, workers: Sequence[Any], ids: frozenset[str], low: int, high: int,
                 rank: Mapping[str, int] | None = None, offset: int = 0) -> None:
        super().__init__(workers)
        self.ids, self.low, self.high = ids, low, high
        # id -> position before the rotation by ``offset`` (the router's
        # candidate list), when this list is that one rotated whole.
        self._rank, self._offset = rank, offset

    @classmethod
    def of(cls, workers: Sequence[Any]) -> "Candidates":
        """``workers`` (in round-robin order, not empty) as candidates; their
        ids and loads read at C speed."""
        if isinstance(workers, Candidates):
            return workers
        loads = loads_of(workers)
        return cls(workers, frozenset(map(_ID, workers)), min(loads), max(loads))

    def among(self, ids: Collection[str]) -> list[Any]:
        """The candidates whose id is in ``ids`` (some of :attr:`ids`), in
        round-robin order; a few of many are found by their rank, not by
        reading every candidate."""
        rank, n = self._rank, len(self)
        if rank is not None and len(ids) * 4 < n:
            offset = self._offset
            return [self[r] for r in sorted((rank[i] - offset) % n for i in ids)]
        return [w for w in self if w.id in ids]


class Policy:
    """Least outstanding requests, ties round-robin (``least-outstanding``);
    the base of the other policies.

    A request whose key is ``None`` never reaches :meth:`choose`: the
    router sends it to ``least`` itself.

    Attributes:
        name: the ``--policy`` value.
        requests: requests keyed so far (:meth:`routing_key` calls).
        keyless: those without a key.
    """

    name = "least-outstanding"

    def __init__(self) -> None:
        self.requests = 0
        self.keyless = 0

    def routing_key(self, request: "GenerateRequest", headers: Mapping[bytes, bytes]) -> Any:
        """What the policy routes ``request`` by, computed once per request
        (``headers`` has lower-case names); ``None``: least outstanding."""
        self.requests += 1
        key = self._key(request, headers)
        if key is None:
            self.keyless += 1
        return key

    def _key(self, request: "GenerateRequest", headers: Mapping[bytes, bytes]) -> Any:
        return None

    def choose(self, candidates: Sequence[W], key: Any, least: Least[W]) -> W:
        """The worker for a request with ``key`` (not ``None``) among
        ``candidates`` (healthy, never empty)."""
        return least(candidates)

    def forget(self, worker: Candidate) -> None:
        """``worker``'s engine lost its prefix cache (flushed, or the worker
        was lost and may come back restarted): drop what the policy knows
        of it."""

    def service(self, worker: Any) -> Callable[[], Awaitable[None]] | None:
        """A task to run for ``worker`` while it is a member (a KV event
        subscriber), or ``None``."""
        return None

    def load_share(self, worker: Any) -> "LoadShare | None":
        """The policy's own readings of ``worker``'s engine load, for
        another reader of the same route to take for it (one GET for both:
        :class:`~asgi_generate.workers.engine_load.LoadShare`); ``None``: it
        reads none. Asked before its :meth:`service` starts."""
        return None

    def metrics(self) -> list[tuple[str, str, float]]:
        """``(worker id, quantity, value)`` gauges for ``/metrics``."""
        return []

    def stats(self) -> dict[str, Any]:
        """The policy's block of ``/stats``: its name and counters."""
        return {"policy": self.name, "requests": self.requests, "keyless": self.keyless}


def build_policy(settings: "Settings") -> Policy:
    """The policy ``settings.policy`` names, configured from ``settings``.

    Raises:
        ValueError: an unknown policy name.
    """
    if settings.policy == "least-outstanding":
        return Policy()
    if settings.policy == "session":
        from .session import SessionPolicy

        return SessionPolicy(settings.session_headers, settings.session_balance_epsilon)
    if settings.policy == "cache-aware":
        from .cache_aware import CacheAwarePolicy

        return CacheAwarePolicy(
            cache_threshold=settings.cache_threshold,
            balance_abs_threshold=settings.balance_abs_threshold,
            balance_rel_threshold=settings.balance_rel_threshold,
            max_tree_tokens=settings.max_tree_tokens,
            max_tree_nodes=settings.max_tree_nodes,
        )
    if settings.policy == "kv-aware":
        from .kv_aware import KVAwarePolicy

        return KVAwarePolicy(
            overlap_weight=settings.kv_overlap_weight,
            queued_weight=settings.kv_queued_weight,
            load_weight=settings.kv_load_weight,
            active_weight=settings.kv_active_weight,
            ttl=settings.kv_predict_ttl,
            load_interval=settings.kv_load_interval,
            load_idle_interval=settings.kv_load_idle_interval,
            max_blocks=settings.max_tree_tokens,
            max_tree_tokens=settings.max_tree_tokens,
            max_tree_nodes=settings.max_tree_nodes,
            sources={url: (pub, replay) for url, pub, replay in settings.kv_events},
        )
    raise ValueError(f"unknown policy {settings.policy!r} (known: {', '.join(POLICIES)})")
