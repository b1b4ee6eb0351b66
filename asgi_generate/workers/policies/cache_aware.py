"""Cache-aware routing: send a prompt where its longest prefix went.

The frontend keeps one approximate prefix tree of the prompts it routed,
whose nodes list the workers it routed them to
(:class:`~asgi_generate.workers.fleet_tree.FleetTree`): token ids, or the
characters of a text prompt. For each request, over the candidates
(healthy workers of the role):

1. Load imbalanced, ``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min`` (outstanding requests): the least
   outstanding worker.
2. Else, when the longest prefix any candidate's tree holds covers more
   than ``cache_threshold`` of the prompt: the least outstanding of the
   candidates holding that longest prefix (an affinity hit).
3. Else (a miss): the least outstanding worker.

The chosen worker's tree then takes the prompt (also in case 1, so the
tree follows where prompts really went). A request with no prompt the
frontend can read (embeddings) is least outstanding, as the router sends
every keyless request.

Learned from sglang-router's ``cache_aware`` policy (``sgl-router/src/
policies/cache_aware.rs`` and ``tree.rs``), with the same three steps and
threshold meanings and defaults (0.3, 64, 1.5). Where it differs:

- the tree is over token ids when the request has them (the router
  matches the text of the ids joined with spaces);
- among workers holding the longest prefix, the least outstanding (the
  router takes the first listed); on a miss, the least outstanding (the
  router takes the worker with the smallest tree);
- bounded at every insert (``max_tree_tokens`` tokens and
  ``max_tree_nodes`` nodes per worker, the worker's LRU leaves evicted at
  once) rather than by a periodic eviction thread, so memory never
  overshoots;
- a worker's share of the tree is dropped when its cache is flushed
  through the frontend (``/flush_cache``, ``/reset_prefix_cache``) and when
  the health probe gives the worker up (it may come back restarted, its
  cache empty).

A request costs one walk of its key and reads of the router's load counts
(:class:`~asgi_generate.workers.policies.Candidates`): no step visits
every candidate, so routing takes about as long for 256 workers as for 4.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..fleet_tree import FleetTree
from ..prefix_tree import text_key, token_key
from . import Candidate, Candidates, Least, Policy, W

if TYPE_CHECKING:
    from ...sdk._codec import GenerateRequest


def prompt_ids(request: "GenerateRequest") -> Sequence[int] | None:
    """The token ids of the one prompt ``request`` carries: its own, or the
    prompt every item shares (``n`` samples of one prompt: items of one
    group); ``None`` for text, several prompts, or none."""
    if request.input_ids:
        packed = request.input_ids_packed
        return packed.u32 if packed is not None else request.input_ids
    items = request.items
    if items and items[0].input_ids and all(item.group == items[0].group for item in items):
        return items[0].input_ids
    return None


def tree_key(request: "GenerateRequest") -> str | None:
    """The prompt's tree key: its token ids (:func:`prompt_ids`), else its
    text, else (or when empty) ``None``."""
    ids = prompt_ids(request)
    if ids:
        return token_key(ids)
    if request.prompt_text:
        return text_key(request.prompt_text)
    return None


class CacheAwarePolicy(Policy):
    """``--policy cache-aware`` (see the module docstring).

    Args:
        cache_threshold: share of the prompt (0 to 1) the longest match
            must exceed for an affinity hit.
        balance_abs_threshold, balance_rel_threshold: the imbalance test,
            on outstanding requests.
        max_tree_tokens, max_tree_nodes: each worker's bounds in the tree.

    Attributes:
        hits, misses, imbalanced: decisions by case.
        tree: the fleet's prefix tree.
    """

    name = "cache-aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 1 << 20,
        max_tree_nodes: int = 1 << 16,
    ) -> None:
        super().__init__()
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self.max_tree_nodes = max_tree_nodes
        self.tree = FleetTree(max_tree_tokens, max_tree_nodes)
        self.hits = self.misses = self.imbalanced = 0

    def _key(self, request: "GenerateRequest", headers: Mapping[bytes, bytes]) -> str | None:
        return tree_key(request)

    def forget(self, worker: Candidate) -> None:
        """Drop what ``worker`` holds in the tree."""
        self.tree.forget(worker.id)

    def held(self, key: str, candidates: Sequence[Candidate]) -> dict[str, int]:
        """Worker id to the characters of ``key`` it holds (the kind marker
        counted), for each of ``candidates`` holding more than the marker;
        the others hold none of the prompt."""
        ids = candidates.ids if isinstance(candidates, Candidates) else frozenset(w.id for w in candidates)
        return self.tree.held(key, ids)

    def cached_tokens(self, worker_id: str) -> int:
        """Characters ``worker_id`` holds in the tree (0 if none)."""
        return self.tree.tokens(worker_id)

    def learn(self, worker: Candidate, key: str) -> None:
        """``key`` was routed to ``worker``: it holds it now."""
        self.tree.insert(worker.id, key)

    def choose(self, candidates: Sequence[W], key: Any, least: Least[W]) -> W:
        """See the module docstring."""
        listed = Candidates.of(candidates)
        high, low = listed.high, listed.low
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            self.imbalanced += 1
            worker = least(candidates)
        else:
            best, holders = self.tree.deepest(key, listed.ids)
            # The key's first character is its kind marker, not prompt.
            if best > 1 and (best - 1) / (len(key) - 1) > self.cache_threshold:
                self.hits += 1
                worker = least(candidates if len(holders) == len(listed) else listed.among(holders))
            else:
                self.misses += 1
                worker = least(candidates)
        self.learn(worker, key)
        return worker

    def stats(self) -> dict[str, Any]:
        """Decisions by case, and each worker's tree size."""
        return {
            **super().stats(),
            "affinity_hits": self.hits, "misses": self.misses, "imbalanced": self.imbalanced,
            "trees": self.tree.stats(),
        }
