"""Routing CPU per request: ``kv-aware`` against ``cache-aware``, in process.

No server, no simulator: each policy is built as the frontend builds it
and fed what it would be fed, so the figures are the policy's own work
(what ``bench_routing.py`` shows only as TTFT on a shared machine).

- Fleet: ``--workers`` (4) workers, each publishing KV events at
  ``--block-size`` (1: SGLang's page size, a block a token). Each
  worker's index holds ``--held`` (8) prompts stored through
  ``BlockStored`` events, as the subscriber applies them.
- Requests: ``--requests`` (400) prompts of ``--prompt-tokens`` (2,000)
  token ids, packed as the codecs pack them (``PackedIds``), each sharing
  a 1,024-token system prefix with the held prompts; each is keyed
  (``routing_key``) and placed (``choose``) among all workers, and its
  prediction lapses before the next one (the worker's index stays the
  same size throughout).
- Events: one ``BlockStored`` of a ``--prompt-tokens`` prompt applied to
  an index (what every replica does for every prompt any engine stores),
  then its ``BlockRemoved``.

Measured: CPU time (``time.process_time``) per request and per event
batch, the median of ``--reps`` (5) passes, kv-aware beside cache-aware
(which keys a prompt and is routed by ``Router.pick`` over the fleet's
healthy workers, the router's candidates and least-outstanding rule
included; it applies no events). The held prompts are learned the same way
in both: through the policy's ``learn``.

Usage: ``.venv/bin/python bench/bench_kv_routing_cpu.py`` (a few seconds);
``--profile`` prints cProfile's top functions for kv-aware's requests.
``--baseline DIR`` measures a checkout of the frontend (``git archive
<commit> | tar -x -C DIR``, its C extension built in place:
``python setup.py build_ext --inplace``) beside this one, each pass a
child process of each in turn (``PYTHONPATH``), and prints before, after
and after / before.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

from asgi_generate.sdk._codec import GenerateRequest
from asgi_generate.sdk._token_ids import pack_token_ids
from asgi_generate.workers.kv_events import Removed, Stored
from asgi_generate.workers.policies.cache_aware import CacheAwarePolicy
from asgi_generate.workers.policies.kv_aware import KVAwarePolicy
from asgi_generate.workers.router import Router

SYSTEM = 1024


class _Worker:
    """A candidate as the router hands it to the policy: no legs running."""

    def __init__(self, i: int) -> None:
        self.id, self.url, self.outstanding, self.inflight = f"w{i}", f"http://127.0.0.1:{9000 + i}", 0, ()


def _prompt(n: int, tokens: int) -> list[int]:
    """Prompt ``n``: the shared system prefix, then ids of its own."""
    own = tokens - SYSTEM
    return list(range(1, SYSTEM + 1)) + list(range(100_000 + n * own, 100_000 + (n + 1) * own))


def _request(ids: list[int]) -> GenerateRequest:
    return GenerateRequest(stream=False, input_ids=ids, input_ids_packed=pack_token_ids(ids))


def _least(c):
    return min(c, key=lambda w: w.outstanding)


def _stored(ids: list[int], block: int, first_hash: int) -> Stored:
    blocks = len(ids) // block
    return Stored(list(range(first_hash, first_hash + blocks)), None, ids[: blocks * block], block, None)


def route_kv(args: argparse.Namespace, requests: list[GenerateRequest]) -> float:
    """kv-aware's CPU seconds per request."""
    workers = [_Worker(i) for i in range(args.workers)]
    policy = KVAwarePolicy(ttl=0.0)  # each prediction lapses before the next request
    clock = iter(range(1, 1 << 30))
    policy.clock = lambda: float(next(clock))
    for i, w in enumerate(workers):
        kv = policy._kv(w)
        kv.subscriber = object()  # events arrive: the index scores it
        kv.index.block_size = args.block_size
        for h in range(args.held):
            kv.index.apply([_stored(_prompt(1000 + i * args.held + h, args.prompt_tokens), args.block_size,
                                    (i * args.held + h) << 20)])
    start = time.process_time()
    for req in requests:
        policy.choose(workers, policy.routing_key(req, {}), _least)
    return (time.process_time() - start) / len(requests)


def route_cache(args: argparse.Namespace, requests: list[GenerateRequest]) -> float:
    """cache-aware's CPU seconds per request, through ``Router.pick`` as a
    request is routed (the router hands the policy its candidates and its
    least-outstanding rule): the candidates' own costs are part of it."""
    router = Router([("sglang", f"http://127.0.0.1:{9000 + i}") for i in range(args.workers)],
                    policy=CacheAwarePolicy())
    policy = router.policy
    for i, w in enumerate(router.workers):
        w.healthy = True
        for h in range(args.held):
            policy.learn(w, policy.routing_key(_request(_prompt(1000 + i * args.held + h, args.prompt_tokens)), {}))
    start = time.process_time()
    for req in requests:
        router.pick("sglang", key=router.routing_key(req, {}))
    return (time.process_time() - start) / len(requests)


def apply_events(args: argparse.Namespace) -> float:
    """CPU seconds to apply one prompt's ``BlockStored`` and its ``BlockRemoved``."""
    policy = KVAwarePolicy()
    index = policy._kv(_Worker(0)).index
    batches = []
    for n in range(args.requests):
        stored = _stored(_prompt(n, args.prompt_tokens), args.block_size, n << 20)
        batches.append(([stored], [Removed(stored.hashes)]))
    start = time.process_time()
    for stored, removed in batches:
        index.apply(stored)
        index.apply(removed)
    return (time.process_time() - start) / len(batches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--block-size", type=int, default=1)
    p.add_argument("--held", type=int, default=8, help="prompts each worker's index holds")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="cProfile kv-aware's requests instead")
    p.add_argument("--baseline", metavar="DIR", help="a checkout to measure beside this one (see above)")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one pass, for --baseline's children
    args = p.parse_args()
    if args.baseline:
        compare(args)
        return
    requests = [_request(_prompt(n, args.prompt_tokens)) for n in range(args.requests)]
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        route_kv(args, requests)
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)
        return
    if args.json:
        print(json.dumps({"kv": route_kv(args, requests), "cache": route_cache(args, requests),
                          "events": apply_events(args)}))
        return
    load = os.getloadavg()[0]
    kv = statistics.median(route_kv(args, requests) for _ in range(args.reps))
    cache = statistics.median(route_cache(args, requests) for _ in range(args.reps))
    events = statistics.median(apply_events(args) for _ in range(args.reps))
    print(f"{args.workers} workers, block size {args.block_size}, {args.prompt_tokens}-token prompts "
          f"({SYSTEM} shared), {args.held} prompts held per worker; median of {args.reps} passes of "
          f"{args.requests}; 1-min load {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print()
    print("| work | kv-aware µs | cache-aware µs | kv-aware / cache-aware |")
    print("|---|---:|---:|---:|")
    print(f"| route one request (key + choose) | {kv * 1e6:,.1f} | {cache * 1e6:,.1f} | {kv / cache:.2f}x |")
    print(f"| apply one prompt's BlockStored + BlockRemoved | {events * 1e6:,.1f} | - | - |")


def compare(args: argparse.Namespace) -> None:
    """``--baseline``: each pass runs this script once against the baseline
    checkout and once against this one, alternating, and the table gives
    the medians side by side."""
    here = str(Path(__file__).resolve().parents[1])
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}"
             for name in ("workers", "block_size", "held", "prompt_tokens", "requests")]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    load = os.getloadavg()[0]
    for _ in range(args.reps):
        for name, root in (("before", args.baseline), ("after", here)):
            env = {**os.environ, "PYTHONPATH": root}
            out = subprocess.run([sys.executable, __file__, "--json", *flags], env=env, check=True,
                                 capture_output=True, text=True, cwd=root).stdout
            runs[name].append(json.loads(out))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("kv", "cache", "events")}
           for name, rs in runs.items()}
    print(f"{args.workers} workers, block size {args.block_size}, {args.prompt_tokens}-token prompts "
          f"({SYSTEM} shared), {args.held} prompts held per worker; median of {args.reps} alternating passes of "
          f"{args.requests}; before: {args.baseline}; 1-min load {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print()
    print("| work | before µs | after µs | after / before |")
    print("|---|---:|---:|---:|")
    for label, k in (("kv-aware: route one request (key + choose)", "kv"),
                     ("cache-aware: route one request (key + choose)", "cache"),
                     ("kv-aware: apply one prompt's BlockStored + BlockRemoved", "events")):
        b, a = med["before"][k], med["after"][k]
        print(f"| {label} | {b * 1e6:,.1f} | {a * 1e6:,.1f} | {a / b:.2f}x |")
    print(f"| kv-aware / cache-aware, routing | {med['before']['kv'] / med['before']['cache']:.2f}x "
          f"| {med['after']['kv'] / med['after']['cache']:.2f}x | |")


if __name__ == "__main__":
    main()
