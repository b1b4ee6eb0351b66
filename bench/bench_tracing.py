"""What request-end tracing costs: the frontend with tracing off vs on.

One simulated SGLang worker (zero TTFT and ITL) serves three asgi-generate
frontends (hypercorn, ``--worker-class``, asyncio by default) side by side:

- ``off``: no tracing (the default);
- ``on``: ``--trace-file`` (JSONL): every record built, replay-hashed,
  serialized and written;
- ``parsers``: as ``on``, plus ``--tokenizer`` (the bundled tokenizer.json),
  ``--reasoning-parser qwen3`` and ``--tool-call-parser hermes``, so every
  record's output is also decoded and parsed.

For each input size (128 and 16384 token ids; 32 output tokens with
``ignore_eos``, unary, with an ``x-session-id`` header) it runs ``--reps``
repetitions (3), each a closed loop of ``--seconds`` at ``--concurrency``
keep-alive connections from an asyncio client in this process against each
frontend in turn (the order rotates every repetition). Measured per cell:
completed requests/s, the frontend process's CPU seconds (user + system, all
threads, ``/proc/<pid>/task/*/schedstat``, nanoseconds) per request, and the
1-minute load average. It prints per size the cells, then on/off and
parsers/off ratios of the medians with the spread of the ratios paired
within each repetition (min-max), and checks that the tracing frontends
wrote one record per request and dropped none.

Side by side on a shared machine, CPU per request moves by several percent
between repetitions. So the run also times, in this process, the work the
writer adds per record (build: hash, decode, parse; serialize; write, in
batches of 16 as under load) with ``time.process_time``, and prints it as a
share of the ``off`` frontend's CPU per request: a figure that other load on
the machine barely moves.

Usage: ``.venv/bin/python bench/bench_tracing.py [--seconds 5] [--concurrency 8] [--reps 3]``.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import array
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

from _keepalive import keepalive_client  # noqa: E402
from support import Proc, start_frontend, start_sim  # noqa: E402

from asgi_generate.tracing.state import RequestState  # noqa: E402
from asgi_generate.assets import TOKENIZER_PATH  # noqa: E402
from asgi_generate.tracing.state import LegRecord as Attempt  # noqa: E402
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


def thread_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds of ``pid``'s main thread (the event loop) and of all its
    other threads together (the trace writer's, the tokenizer's), from the
    scheduler's nanosecond counters (``/proc/<pid>/task/*/schedstat``)."""
    loop = others = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError):
            continue  # a thread that just ended
        if int(tid) == pid:
            loop += ns
        else:
            others += ns
    return loop / 1e9, others / 1e9


def measure(fe: Proc, request: bytes, seconds: float, concurrency: int) -> tuple[float, float, float]:
    """Run one cell; return (requests/s, frontend CPU ms per request, of
    which ms per request in threads other than the event loop's)."""
    done = [0]

    async def main() -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(keepalive_client(fe.port, request, stop_at, done) for _ in range(concurrency)))

    (loop0, others0), t0 = thread_cpu_seconds(fe.proc.pid), time.monotonic()
    asyncio.run(main())
    (loop1, others1), t1 = thread_cpu_seconds(fe.proc.pid), time.monotonic()
    n = done[0]
    return n / (t1 - t0), (loop1 - loop0 + others1 - others0) * 1000.0 / n, (others1 - others0) * 1000.0 / n


def trace_states(input_len: int) -> list[RequestState]:
    """16 finished requests of this shape, as the writer gets them: the
    prompt packed (as the SGLang codec hands it on), 32 output tokens."""
    states = []
    for i in range(16):
        st = RequestState(f"{i:032x}", "sglang", "/generate", "POST", t_received=1.0, stream=False,
                          input_ids=array.array("I", input_ids(input_len)), input_length=input_len, status="ok", http_status=200,
                          finish_reason="length", output_tokens=OUTPUT_TOKENS,
                          output_ids=list(range(500, 500 + OUTPUT_TOKENS)), engine_completion_tokens=OUTPUT_TOKENS,
                          prompt_tokens=input_len, cached_tokens=0, headers={b"x-session-id": b"bench"},
                          t_dispatched=1.001, t_first_token=1.01, t_last_token=1.05, t_done=1.06)
        st.attempts.append(Attempt(f"{i + 100:032x}", "aggregated", "w0", outcome="finished"))
        states.append(st)
    return states


def write_records(states: list[RequestState], analyzer: OutputAnalyzer | None, sink: JsonlFileSink, rounds: int) -> None:
    """The writer's work for ``rounds`` batches of ``states``: build (hash;
    with an analyzer also decode and parse), serialize, write."""
    for _ in range(rounds):
        sink.write(b"\n".join([*(orjson.dumps(build_record(st, 64, analyzer)) for st in states), b""]))


def writer_cpu_us(input_len: int, tmp: pathlib.Path, parsers: bool, records: int = 2000) -> float:
    """CPU microseconds the trace writer spends per record of this shape:
    build (hash; with ``parsers`` also decode and parse), serialize, write,
    in batches of 16 (:func:`trace_states`, :func:`write_records`)."""
    analyzer = OutputAnalyzer(str(TOKENIZER_PATH), "qwen3", "hermes") if parsers else None
    sink = JsonlFileSink(str(tmp / f"direct-{input_len}-{parsers}.jsonl"), 0)
    sink.open()
    states = trace_states(input_len)
    rounds = records // len(states)
    t0 = time.process_time()
    write_records(states, analyzer, sink, rounds)
    spent = time.process_time() - t0
    sink.close()
    return spent * 1e6 / (rounds * len(states))


MODES = ("off", "on", "parsers")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per cell (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="connections (default %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default %(default)s)")
    parser.add_argument("--worker-class", default="asyncio", help="hypercorn worker class (default %(default)s)")
    args = parser.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    load_before = os.getloadavg()[0]
    sim = start_sim()
    fronts: dict[str, Proc] = {}
    extra = {
        "off": [],
        "on": ["--trace-file", str(tmp / "on" / "trace.jsonl")],
        "parsers": ["--trace-file", str(tmp / "parsers" / "trace.jsonl"), "--tokenizer", str(TOKENIZER_PATH),
                    "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"],
    }
    try:
        for mode in MODES:
            (tmp / mode).mkdir()
            fronts[mode] = start_frontend([f"sglang={sim.url}"], worker_class=args.worker_class,
                                          extra=[*DEFAULT_HEALTH, *extra[mode]])
        results: dict[tuple[int, str], list[tuple[float, float, float, float]]] = {}
        for size in SIZES:
            request = request_bytes(size)
            for fe in fronts.values():  # warm up: connections, caches
                measure(fe, request, min(1.0, args.seconds), args.concurrency)
            for rep in range(args.reps):
                order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]
                for mode in order:
                    rps, cpu, threads = measure(fronts[mode], request, args.seconds, args.concurrency)
                    results.setdefault((size, mode), []).append((rps, cpu, os.getloadavg()[0], threads))
        traces = {m: httpx.get(fronts[m].url + "/stats", timeout=10).json()["trace"] for m in ("on", "parsers")}
    finally:
        for fe in fronts.values():
            fe.stop()
        sim.stop()

    print(f"# tracing off vs on: {OUTPUT_TOKENS} output tokens, unary, concurrency {args.concurrency}, "
          f"{args.seconds:g} s per cell, {args.reps} interleaved repetitions, {os.cpu_count()} CPUs, "
          f"worker class {args.worker_class}; 1-min load average {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after\n")
    print("| input tokens | mode | req/s median (per rep) | frontend CPU ms/req median (per rep) "
          "| of which other threads µs/req (per rep) | load (per rep) |")
    print("|---|---|---|---|---|---|")
    for size in SIZES:
        for mode in MODES:
            cells = results[(size, mode)]
            rps = " ".join(f"{c[0]:.1f}" for c in cells)
            cpu = " ".join(f"{c[1]:.3f}" for c in cells)
            threads = " ".join(f"{c[3] * 1000:.1f}" for c in cells)
            load = " ".join(f"{c[2]:.1f}" for c in cells)
            print(f"| {size} | {mode} | {statistics.median(c[0] for c in cells):.1f} ({rps}) | "
                  f"{statistics.median(c[1] for c in cells):.3f} ({cpu}) | "
                  f"{statistics.median(c[3] for c in cells) * 1000:.1f} ({threads}) | {load} |")
    print("\n| input tokens | mode | CPU/request vs off: median ratio (paired per rep, min-max) "
          "| throughput vs off: median ratio (paired, min-max) |")
    print("|---|---|---|---|")
    for size in SIZES:
        off = results[(size, "off")]
        for mode in ("on", "parsers"):
            on = results[(size, mode)]
            cpu = statistics.median(c[1] for c in on) / statistics.median(c[1] for c in off)
            tput = statistics.median(c[0] for c in on) / statistics.median(c[0] for c in off)
            pcpu = [a[1] / b[1] for a, b in zip(on, off)]
            ptput = [a[0] / b[0] for a, b in zip(on, off)]
            print(f"| {size} | {mode}/off | {cpu:.3f} ({(cpu - 1) * 100:+.1f}%; {min(pcpu):.3f}-{max(pcpu):.3f}) | "
                  f"{tput:.3f} ({(tput - 1) * 100:+.1f}%; {min(ptput):.3f}-{max(ptput):.3f}) |")
    print("\n| input tokens | mode | writer CPU µs/record (in process) | share of the off frontend's CPU/request |")
    print("|---|---|---|---|")
    for size in SIZES:
        off_ms = statistics.median(c[1] for c in results[(size, "off")])
        for mode in ("on", "parsers"):
            us = writer_cpu_us(size, tmp, parsers=mode == "parsers")
            print(f"| {size} | {mode} | {us:.1f} | {us / 10 / off_ms:+.2f}% |")
    ok = True
    for mode, trace in traces.items():
        records = sum(len(p.read_bytes().splitlines()) for p in (tmp / mode).glob("trace.*.jsonl"))
        print(f"\ntrace ({mode}): {trace['submitted']} requests, {records} records in files, dropped {trace['dropped']}")
        ok = ok and records == trace["submitted"] and not any(trace["dropped"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
