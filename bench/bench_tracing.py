"""What request-end tracing costs: the frontend with tracing off vs on.

One simulated SGLang worker (zero TTFT and ITL) serves two asgi-generate
frontends (hypercorn, trio) side by side:

- ``off``: no tracing (the default);
- ``on``: ``--trace-file`` (JSONL) with ``--tokenizer`` (the bundled
  tokenizer.json), ``--reasoning-parser qwen3`` and ``--tool-call-parser
  hermes``, so every record is hashed, decoded and parsed.

For each input size (128 and 16384 token ids; 32 output tokens with
``ignore_eos``, unary, with an ``x-session-id`` header) it runs three
repetitions, alternating ``off`` and ``on`` within each (the order flips
every repetition), each a closed loop of ``--seconds`` at ``--concurrency``
keep-alive connections from an asyncio client in this process. Measured per
cell: completed requests/s, and the frontend process's CPU seconds (user +
system, all threads, from ``/proc/<pid>/stat``) per request. It prints a
table per size and the on/off ratios, and checks that the ``on`` frontend
wrote one record per request and dropped none.

Side by side on a shared machine, CPU per request moves by several percent
between repetitions. So the run also times, in this process, the work the
writer adds per record (build: hash, decode, parse; serialize; write, in
batches of 16 as under load) with ``time.process_time``, and prints it as a
share of the ``off`` frontend's CPU per request: a figure that other load on
the machine barely moves.

Usage: ``.venv/bin/python bench/bench_tracing.py [--seconds 5] [--concurrency 8]``.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import tempfile
import time

import httpx
import orjson

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _procs import tree_cpu_seconds  # noqa: E402
from support import Proc, start_frontend, start_sim  # noqa: E402

from asgi_generate.accounting import RequestState  # noqa: E402
from asgi_generate.assets import TOKENIZER_PATH  # noqa: E402
from asgi_generate.codec import Attempt  # noqa: E402
from asgi_generate.tracing.analysis import OutputAnalyzer  # noqa: E402
from asgi_generate.tracing.record import build_record  # noqa: E402
from asgi_generate.tracing.sinks import JsonlFileSink  # noqa: E402

OUTPUT_TOKENS = 32
SIZES = (128, 16384)
# Both frontends probe their worker at the serving default, not the tests' 0.2 s.
DEFAULT_HEALTH = ["--health-interval", "2"]


def input_ids(input_len: int) -> list[int]:
    return [100 + (i * 7919) % 3900 for i in range(input_len)]


def request_bytes(input_len: int) -> bytes:
    body = orjson.dumps({
        "input_ids": input_ids(input_len),
        "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True},
    })
    return (b"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"x-session-id: bench\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


async def connection(port: int, request: bytes, stop_at: float, done: list[int]) -> None:
    """One keep-alive connection sending ``request`` until ``stop_at``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop_at:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"bad answer: {head[:200]!r}")
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            done[0] += 1
    finally:
        writer.close()


def measure(fe: Proc, request: bytes, seconds: float, concurrency: int) -> tuple[float, float]:
    """Run one cell; return (requests/s, frontend CPU ms per request)."""
    done = [0]

    async def main() -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(connection(fe.port, request, stop_at, done) for _ in range(concurrency)))

    cpu0, t0 = tree_cpu_seconds(fe.proc.pid), time.monotonic()
    asyncio.run(main())
    cpu1, t1 = tree_cpu_seconds(fe.proc.pid), time.monotonic()
    return done[0] / (t1 - t0), (cpu1 - cpu0) * 1000.0 / done[0]


def writer_cpu_us(input_len: int, tmp: pathlib.Path, records: int = 2000) -> float:
    """CPU microseconds the trace writer spends per record of this shape:
    build (hash, decode, parse), serialize, write, in batches of 16."""
    analyzer = OutputAnalyzer(str(TOKENIZER_PATH), "qwen3", "hermes")
    sink = JsonlFileSink(str(tmp / f"direct-{input_len}.jsonl"), 0)
    sink.open()
    states = []
    for i in range(16):
        st = RequestState(f"{i:032x}", "sglang", "/generate", "POST", t_received=1.0, stream=False,
                          input_ids=input_ids(input_len), input_length=input_len, status="ok", http_status=200,
                          finish_reason="length", output_tokens=OUTPUT_TOKENS,
                          output_ids=list(range(500, 500 + OUTPUT_TOKENS)), engine_completion_tokens=OUTPUT_TOKENS,
                          prompt_tokens=input_len, cached_tokens=0, headers={b"x-session-id": b"bench"},
                          t_dispatched=1.001, t_first_token=1.01, t_last_token=1.05, t_done=1.06)
        st.attempts.append(Attempt(f"{i + 100:032x}", "aggregated", "w0", outcome="finished"))
        states.append(st)
    t0 = time.process_time()
    for _ in range(records // len(states)):
        sink.write(b"\n".join(orjson.dumps(build_record(st, 64, analyzer)) for st in states) + b"\n")
    spent = time.process_time() - t0
    sink.close()
    return spent * 1e6 / (records // len(states) * len(states))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per cell (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="connections (default %(default)s)")
    args = parser.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    sim = start_sim()
    fronts: dict[str, Proc] = {}
    try:
        fronts["off"] = start_frontend([f"sglang={sim.url}"], extra=DEFAULT_HEALTH)
        fronts["on"] = start_frontend([f"sglang={sim.url}"], extra=[
            *DEFAULT_HEALTH, "--trace-file", str(tmp / "trace.jsonl"), "--tokenizer", str(TOKENIZER_PATH),
            "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
        ])
        results: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for size in SIZES:
            request = request_bytes(size)
            for fe in fronts.values():  # warm up: connections, caches
                measure(fe, request, min(1.0, args.seconds), args.concurrency)
            for rep in range(3):
                order = ("off", "on") if rep % 2 == 0 else ("on", "off")
                for mode in order:
                    results.setdefault((size, mode), []).append(
                        measure(fronts[mode], request, args.seconds, args.concurrency))
        trace = httpx.get(fronts["on"].url + "/stats", timeout=10).json()["trace"]
    finally:
        for fe in fronts.values():
            fe.stop()
        sim.stop()

    print(f"# tracing off vs on: {OUTPUT_TOKENS} output tokens, unary, concurrency {args.concurrency}, "
          f"{args.seconds:g} s per cell, 3 interleaved repetitions, {os.cpu_count()} CPUs\n")
    print("| input tokens | mode | req/s (per rep) | frontend CPU ms/req (per rep) |")
    print("|---|---|---|---|")
    for size in SIZES:
        for mode in ("off", "on"):
            cells = results[(size, mode)]
            rps = " ".join(f"{r:.1f}" for r, _ in cells)
            cpu = " ".join(f"{c:.3f}" for _, c in cells)
            print(f"| {size} | {mode} | {statistics.median(r for r, _ in cells):.1f} ({rps}) | "
                  f"{statistics.median(c for _, c in cells):.3f} ({cpu}) |")
    print("\n| input tokens | CPU/request on/off | throughput on/off |")
    print("|---|---|---|")
    for size in SIZES:
        off, on = results[(size, "off")], results[(size, "on")]
        cpu_ratio = statistics.median(c for _, c in on) / statistics.median(c for _, c in off)
        tput_ratio = statistics.median(r for r, _ in on) / statistics.median(r for r, _ in off)
        print(f"| {size} | {cpu_ratio:.3f} ({(cpu_ratio - 1) * 100:+.1f}%) | "
              f"{tput_ratio:.3f} ({(tput_ratio - 1) * 100:+.1f}%) |")
    print("\n| input tokens | writer CPU µs/record (in process) | share of the off frontend's CPU/request |")
    print("|---|---|---|")
    for size in SIZES:
        us = writer_cpu_us(size, tmp)
        off_ms = statistics.median(c for _, c in results[(size, "off")])
        print(f"| {size} | {us:.1f} | {us / 10 / off_ms:+.1f}% |")
    records = sum(len(p.read_bytes().splitlines()) for p in tmp.glob("trace.*.jsonl"))
    print(f"\ntrace (on): {trace['submitted']} requests, {records} records in files, dropped {trace['dropped']}")
    return 0 if records == trace["submitted"] and not any(trace["dropped"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
