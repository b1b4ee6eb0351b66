"""What migration's bookkeeping costs the happy path: the frontend with
``--migration-limit 0`` (off) vs the default 3 (on), side by side.

One simulated SGLang worker (zero TTFT and ITL) serves two asgi-generate
frontends (hypercorn, asyncio), identical but for the limit. With migration
on, every streamed request keeps the output ids it sent (what a resumed leg
would carry) and every leg is checked against the migration rules when it
fails; no worker fails here, so the difference is the bookkeeping alone.

Cells: unary (128-token prompt, 16 output tokens) and SSE (256 output
tokens, one event per token), each a closed loop of ``--seconds`` at
``--concurrency`` keep-alive connections from an asyncio client in this
process, three repetitions alternating off and on (the order flips every
repetition). Measured per cell: requests/s and the frontend process's CPU
seconds (user + system, from ``/proc/<pid>/stat``) per request. Every
answer is checked (status 200; SSE: ends with ``data: [DONE]``).

Usage: ``.venv/bin/python bench/bench_migration.py [--seconds 5] [--concurrency 8]``.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import time

import orjson

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _keepalive import keepalive_client  # noqa: E402
from _procs import tree_cpu_seconds  # noqa: E402
from support import Proc, start_frontend, start_sim  # noqa: E402

PROMPT = [100 + (i * 7919) % 3900 for i in range(128)]
SHAPES = {"unary": (False, 16), "sse": (True, 256)}
DEFAULT_HEALTH = ["--health-interval", "2", "--worker-class", "asyncio"]


def request_bytes(stream: bool, tokens: int) -> bytes:
    body = orjson.dumps({"input_ids": PROMPT, "stream": stream,
                         "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}})
    return (b"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body


def measure(fe: Proc, shape: str, seconds: float, concurrency: int) -> tuple[float, float]:
    """Run one cell; return (requests/s, frontend CPU ms per request)."""
    stream, tokens = SHAPES[shape]
    request = request_bytes(stream, tokens)
    done = [0]

    async def main() -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(keepalive_client(fe.port, request, stop_at, done, stream) for _ in range(concurrency)))

    cpu0, t0 = tree_cpu_seconds(fe.proc.pid), time.monotonic()
    asyncio.run(main())
    cpu1, t1 = tree_cpu_seconds(fe.proc.pid), time.monotonic()
    return done[0] / (t1 - t0), (cpu1 - cpu0) * 1000.0 / done[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per cell (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="connections (default %(default)s)")
    args = parser.parse_args()
    sim = start_sim()
    fronts: dict[str, Proc] = {}
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        fronts["off"] = start_frontend([f"sglang={sim.url}"], extra=[*DEFAULT_HEALTH, "--migration-limit", "0"])
        fronts["on"] = start_frontend([f"sglang={sim.url}"], extra=DEFAULT_HEALTH)
        for shape in SHAPES:
            for fe in fronts.values():  # warm up: connections, caches
                measure(fe, shape, min(1.0, args.seconds), args.concurrency)
            for rep in range(3):
                for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                    results.setdefault((shape, mode), []).append(
                        measure(fronts[mode], shape, args.seconds, args.concurrency))
    finally:
        for fe in fronts.values():
            fe.stop()
        sim.stop()

    print(f"# migration off vs on (happy path): concurrency {args.concurrency}, {args.seconds:g} s per cell, "
          f"3 interleaved repetitions, {os.cpu_count()} CPUs\n")
    print("| shape | mode | req/s (per rep) | frontend CPU ms/req (per rep) |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        for mode in ("off", "on"):
            cells = results[(shape, mode)]
            rps = " ".join(f"{r:.1f}" for r, _ in cells)
            cpu = " ".join(f"{c:.3f}" for _, c in cells)
            print(f"| {shape} | {mode} | {statistics.median(r for r, _ in cells):.1f} ({rps}) | "
                  f"{statistics.median(c for _, c in cells):.3f} ({cpu}) |")
    print("\n| shape | CPU/request on/off | throughput on/off |")
    print("|---|---|---|")
    for shape in SHAPES:
        off, on = results[(shape, "off")], results[(shape, "on")]
        cpu = statistics.median(c for _, c in on) / statistics.median(c for _, c in off)
        tput = statistics.median(r for r, _ in on) / statistics.median(r for r, _ in off)
        print(f"| {shape} | {cpu:.3f} ({(cpu - 1) * 100:+.1f}%) | {tput:.3f} ({(tput - 1) * 100:+.1f}%) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
