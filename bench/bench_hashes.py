"""What the C accelerator saves: the hash chains in C
(``asgi_generate/hashes/_native.c``) and in pure Python
(``asgi_generate/hashes/_python.py``, the path of an install without a C
compiler) side by side, in one run, on the same inputs:

- the replay chain of a 16K-token prompt (64-token blocks, a packed
  ``array('I')``, as a trace record hashes it: its JSON text);
- the KV index's block keys of a 2,000-token prompt at SGLang's page size 1
  (a block a token, as ``--policy kv-aware`` hashes each routed request),
  alone and with the rest of the index's work for that request: one walk
  of four workers' masks (each holding a different leading part of the
  prompt, one with predictions) and the routed worker's new predictions.

Each figure is the fastest of ``--repeat`` timings of ``--number`` calls,
per call, so that other load on the machine adds as little as it can.

Usage: ``.venv/bin/python bench/bench_hashes.py`` (a few seconds; needs the
accelerator built: ``pip install`` with a C compiler).
"""

from __future__ import annotations

import argparse
import array
import random
import sys
import timeit

from asgi_generate.hashes import _python

try:
    from asgi_generate.hashes import _native
except ImportError:
    sys.exit("bench_hashes: the C accelerator is not built (asgi_generate.hashes._native): "
             "reinstall with a C compiler on PATH")


def per_call_us(fn, number: int, repeat: int) -> float:
    """Microseconds per call of ``fn``, the fastest of ``repeat`` runs of ``number``."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def kv_request(impl, ids: list[int], held: dict[int, int], predicted: list) -> None:
    """The index's work for one routed request (workers/kv_index.py's
    ``overlaps`` and ``predict``): its keys, one walk of the four workers of
    ``held``, the new predictions of the one holding the most."""
    keys = impl.kv_chain(0, ids, 1)
    overlaps, _ = impl.mask_walk(keys, held, 0b1111, predicted)
    impl.mask_missing(keys, held, 1 << 3, overlaps[3])


def four_workers(ids: list[int]) -> tuple[dict[int, int], list]:
    """An index of four workers, worker ``i`` holding the prompt's first
    ``500 * i`` blocks, worker 1 with the next 500 predicted."""
    keys = _python.kv_chain(0, ids, 1)
    held: dict[int, int] = {}
    for slot in range(4):
        _python.mask_set(keys[: 500 * slot], held, 1 << slot)
    return held, [(1, dict.fromkeys(keys[500:1000], 1.0))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=200, help="calls per timing (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=7, help="timings, the fastest kept (default %(default)s)")
    args = parser.parse_args()
    rng = random.Random(0)
    prompt = array.array("I", (rng.randrange(4096) for _ in range(16384)))
    kv_prompt = [rng.randrange(4096) for _ in range(2000)]
    held, predicted = four_workers(kv_prompt)
    cases = [
        ("replay chain, 16K tokens, 64-token blocks (JSON text)",
         lambda impl: lambda: impl.chain_json(prompt, 64)),
        ("replay chain, 16K tokens, 64-token blocks (list)",
         lambda impl: lambda: impl.chain(prompt, 64)),
        ("KV block keys, 2,000 tokens, 1-token blocks",
         lambda impl: lambda: impl.kv_chain(0, kv_prompt, 1)),
        ("KV block keys + a 4-worker walk + predictions, 2,000 tokens",
         lambda impl: lambda: kv_request(impl, kv_prompt, held, predicted)),
    ]
    assert _native.chain_json(prompt, 64) == _python.chain_json(prompt, 64)
    assert _native.kv_chain(0, kv_prompt, 1) == _python.kv_chain(0, kv_prompt, 1)
    print(f"{'':<62}{'C':>10}{'Python':>10}{'ratio':>8}")
    for name, make in cases:
        c = per_call_us(make(_native), args.number, args.repeat)
        py = per_call_us(make(_python), args.number, args.repeat)
        print(f"{name:<62}{c:>8.1f}us{py:>8.1f}us{py / c:>7.1f}x")


if __name__ == "__main__":
    main()
