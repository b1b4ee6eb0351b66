"""Session affinity: rendezvous hashing with bounded load.

A request carrying a session key (the first of the configured headers it
sends, by default ``X-Session-ID`` then ``X-SMG-Routing-Key``) goes to the
candidate with the highest score ``XXH3-64(worker URL, 0x00, key)``
(rendezvous, or highest-random-weight, hashing), unless that worker is full:
with ``n`` candidates holding ``T`` outstanding requests in all, a worker
takes the request only while its outstanding count is below

    cap = ceil((1 + epsilon) * (T + 1) / n)

(bounded-load consistent hashing, Mirrokni, Thorup and Zadimoghaddam,
SODA 2018), else the request spills to the next worker in the key's score
order. Some worker is always below the cap, so the walk ends. A request
without a key goes to the least outstanding worker.

Stateless: the score depends only on the worker's URL and the key (XXH3,
not Python's per-process salted ``hash``), so every frontend process, on
any host, sends a key to the same worker while load allows, and when a
worker leaves the rotation only its keys move (to their second choice),
coming back when it returns.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import xxhash

from ...config import DEFAULT_SESSION_HEADERS
from . import Candidate, Least, Policy, W

if TYPE_CHECKING:
    from ...sdk._codec import GenerateRequest

_score = xxhash.xxh3_64_intdigest


def rendezvous_order(candidates: Sequence[W], key: bytes) -> list[W]:
    """``candidates`` from the highest score for ``key`` to the lowest
    (ties, which need a 64-bit collision, by URL)."""
    return sorted(candidates, key=lambda w: (_score(w.url.encode() + b"\x00" + key), w.url), reverse=True)


class SessionPolicy(Policy):
    """``--policy session``.

    Args:
        headers: comma-separated header names the key is read from, first
            present (and non-empty) wins; case-insensitive.
        epsilon: the load bound's slack, >= 0 (see the module docstring).

    Attributes:
        affinity: keyed requests that went to their first-choice worker.
        spills: keyed requests that went elsewhere because the first
            choice was at its cap.
    """

    name = "session"

    def __init__(self, headers: str = DEFAULT_SESSION_HEADERS, epsilon: float = 1.0) -> None:
        super().__init__()
        self.headers = tuple(h.strip().lower().encode("latin-1") for h in headers.split(",") if h.strip())
        if not self.headers:
            raise ValueError("--session-headers names no header")
        if not epsilon >= 0:
            raise ValueError(f"--session-balance-epsilon must be 0 or more, not {epsilon!r}")
        self.epsilon = epsilon
        self.affinity = 0
        self.spills = 0

    def _key(self, request: "GenerateRequest", headers: Mapping[bytes, bytes]) -> bytes | None:
        """The first configured session header's value, ``None`` without one."""
        for name in self.headers:
            value = headers.get(name)
            if value:
                return value
        return None

    def cap(self, candidates: Sequence[Candidate]) -> int:
        """The outstanding count a worker must be below to take a keyed request."""
        total = sum(w.outstanding for w in candidates)
        return math.ceil((1 + self.epsilon) * (total + 1) / len(candidates))

    def choose(self, candidates: Sequence[W], key: Any, least: Least[W]) -> W:
        """See the module docstring."""
        cap = self.cap(candidates)
        for rank, worker in enumerate(rendezvous_order(candidates, key)):
            if worker.outstanding < cap:
                if rank == 0:
                    self.affinity += 1
                else:
                    self.spills += 1
                return worker
        raise AssertionError("bounded load: some worker is always below the cap")

    def stats(self) -> dict[str, Any]:
        """Requests, keyless ones, first-choice hits and spills."""
        return {
            **super().stats(), "headers": [h.decode("latin-1") for h in self.headers], "epsilon": self.epsilon,
            "affinity_hits": self.affinity, "spills": self.spills,
        }
