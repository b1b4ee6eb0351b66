"""What a unary client's engine leg costs the frontend: a unary leg (today)
vs a streamed leg whose events would be assembled into the unary answer
(what would let a unary request resume mid-answer).

In this process, with the frontend's own worker client
(:class:`asgi_generate.workers.http.ConnectionPool`, httptools on anyio) and
codecs, against one simulator (TTFT = ITL = 0) per worker kind, it runs
each leg kind the way :class:`asgi_generate.request.generation.Generation` does:

- ``unary``: the client's unary body, ``resp.read()``, one ``Exchange.feed``;
- ``streamed``: the same request with ``stream`` on, ``resp.read_some()``
  until the end, :class:`~asgi_generate.request.framing.SSEDecoder`, one
  ``Exchange.feed`` per event (one event per token).

It counts only this process's CPU (``time.process_time``), i.e. the
frontend's share: the engine's cost of streaming is not in it. The streamed
side leaves out the per-event client bookkeeping of the real loop, so its
figure is a lower bound. Repetitions alternate the two kinds (the order
flips each time); the table gives CPU ms per request and streamed/unary.

Usage: ``.venv/bin/python bench/bench_unary_leg.py [--requests 400] [--concurrency 8]``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import anyio
import orjson

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support import start_sim  # noqa: E402

from asgi_generate.sdk import _ids as ids  # noqa: E402
from asgi_generate.sdk._codec import Attempt  # noqa: E402
from asgi_generate.request.framing import SSEDecoder  # noqa: E402
from asgi_generate.sdk._registry import load_codecs  # noqa: E402
from asgi_generate.workers.http import ConnectionPool  # noqa: E402

PROMPT = [100 + (i * 7919) % 3900 for i in range(128)]
KINDS = (("sglang", False), ("sglang", True), ("vllm", False))


def client_body(protocol: str, tokens: int, stream: bool) -> bytes:
    if protocol == "sglang":
        return orjson.dumps({"input_ids": PROMPT, "stream": stream,
                             "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}})
    return orjson.dumps({"token_ids": PROMPT, "stream": stream,
                         "sampling_params": {"max_tokens": tokens, "ignore_eos": True}})


async def one(pool: ConnectionPool, codec, info: dict, body: bytes, tokens: int) -> None:
    req = codec.decode(body, {b"content-type": b"application/json"})
    ex = codec.exchange(req, "0" * 32)
    attempt = Attempt(ids.mint(), "aggregated", "w0", info)
    wreq = ex.worker_request(attempt)
    got = 0
    async with pool.request(b"POST", wreq.path, wreq.body, wreq.headers) as resp:
        if not wreq.stream:
            got = len(ex.feed(attempt, await resp.read()).token_ids)
        else:
            decoder = SSEDecoder()
            while (data := await resp.read_some()) is not None:
                for payload in decoder.feed(data):
                    if payload != b"[DONE]":
                        got += len(ex.feed(attempt, payload).token_ids)
    if got != tokens:
        raise RuntimeError(f"expected {tokens} tokens, got {got}")


async def cell(pool, codec, info, body: bytes, tokens: int, requests: int, concurrency: int) -> float:
    """CPU ms per request of ``requests`` requests at ``concurrency``."""
    left = [requests]

    async def loop() -> None:
        while left[0] > 0:
            left[0] -= 1
            await one(pool, codec, info, body, tokens)

    t0 = time.process_time()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(loop)
    return (time.process_time() - t0) * 1000.0 / requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per cell (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent legs (default %(default)s)")
    parser.add_argument("--reps", type=int, default=4, help="repetitions per cell (default %(default)s)")
    args = parser.parse_args()
    codecs = {c.codec.name: c.codec for c in load_codecs()}
    rows = []
    for protocol, incremental in KINDS:
        sim = start_sim(protocol, incremental=incremental)
        try:
            info = {"incremental_streaming_output": incremental, "version": "0.33.0"}
            for tokens in (16, 256):
                results: dict[bool, list[float]] = {False: [], True: []}

                async def run() -> None:
                    pool = ConnectionPool("127.0.0.1", sim.port, max_idle=args.concurrency)
                    try:
                        for stream in (False, True):  # warm-up
                            await cell(pool, codecs[protocol], info, client_body(protocol, tokens, stream),
                                       tokens, args.requests // 4, args.concurrency)
                        for rep in range(args.reps):
                            for stream in ((False, True) if rep % 2 == 0 else (True, False)):
                                results[stream].append(await cell(
                                    pool, codecs[protocol], info, client_body(protocol, tokens, stream),
                                    tokens, args.requests, args.concurrency))
                    finally:
                        await pool.aclose()

                anyio.run(run)
                name = protocol + (" incremental" if incremental else "")
                rows.append((name, tokens, results[False], results[True]))
        finally:
            sim.stop()
    print(f"# unary vs streamed engine leg for a unary client: frontend CPU ms/request "
          f"({args.requests} requests per cell, concurrency {args.concurrency}, {args.reps} alternating reps)\n")
    print("| worker | output tokens | unary leg | streamed leg | streamed/unary |")
    print("|---|---:|---:|---:|---:|")
    for name, tokens, unary, streamed in rows:
        u, s = statistics.median(unary), statistics.median(streamed)
        print(f"| {name} | {tokens} | {u:.3f} | {s:.3f} | {s / u:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
