"""Bytes an open stream holds per piece, measured with tracemalloc.

Three pieces a request keeps for as long as it streams, each measured over
``--count`` objects built in this process (bytes per object, the traced
memory's growth divided by the count):

- a JSON result of ``orjson.dumps`` (a rid) next to ``dumps_compact``'s:
  orjson 3.11 returns a result in a buffer of at least 1 KiB, which
  ``sdk.codec.dumps_compact`` copies out;
- a 4-token prompt packed by ``sdk.token_ids.pack_token_ids`` (its ids as
  uint32 and its JSON text);
- an SGLang request with a 2,000-token prompt, decoded and its first worker
  body built and let go, as once sent (``SGLangCodec``): the prompt is kept packed, not as a list of
  Python ints (~36 bytes an id).

The goals beside each figure are the ones the pieces were built to: the
run prints both and says which are met. tests/codecs/test_held_bytes.py checks
the same pieces' values; bench_streams.py measures a whole open stream.

Usage: ``.venv/bin/python bench/bench_held_bytes.py [--count 200]``.
"""

from __future__ import annotations

import argparse
import tracemalloc
from typing import Callable

import orjson

from asgi_generate.sdk._codec import Attempt, dumps_compact
from asgi_generate.sdk._token_ids import pack_token_ids
from asgi_generate_sglang.codec import SGLangCodec


def per_object(build: Callable[[int], object], count: int) -> float:
    """Traced bytes per object of ``build(i)`` for ``i`` in ``range(count)``,
    all kept alive until measured."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = [build(i) for i in range(count)]
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del held
    return (after - before) / count


def _sglang_request(body: bytes) -> Callable[[int], object]:
    codec = SGLangCodec()

    def build(i: int) -> object:
        req = codec.decode(body, {})
        ex = codec.exchange(req, f"r{i}")
        ex.worker_request(Attempt("a" * 32, "aggregated"))  # sent: the body is not held
        return req, ex

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200, help="objects built per piece")
    count = parser.parse_args().count
    prompt = orjson.dumps({"input_ids": list(range(1000, 3000)), "stream": True,
                           "sampling_params": {"max_new_tokens": 9}})
    # (piece, bytes per object, goal, whether met)
    rows = [
        ("orjson.dumps result (a rid)", per_object(lambda i: orjson.dumps(f"rid-{i}"), count), "> 1024 (why)",
         lambda b: b > 1024),
        ("dumps_compact result (a rid)", per_object(lambda i: dumps_compact(f"rid-{i}"), count), "< 64",
         lambda b: b < 64),
        ("packed 4-token prompt", per_object(lambda i: pack_token_ids([11, 12, 13, i]), count), "< 320",
         lambda b: b < 320),
        ("SGLang request, 2,000-token prompt", per_object(_sglang_request(prompt), max(count // 10, 1)),
         "< 24,000", lambda b: b < 24_000),
    ]
    print(f"{'piece':<38} {'bytes each':>11}  goal")
    for piece, each, goal, met in rows:
        print(f"{piece:<38} {each:>11,.0f}  {goal}{'' if met(each) else '  NOT MET'}")


if __name__ == "__main__":
    main()
