"""Frontend CPU per request as the work grows, tracing off and on.

One simulated SGLang worker (zero TTFT and ITL, ``--context-length``
raised for the longest prompt) serves two asgi-generate frontends
(hypercorn, ``--worker-class``, asyncio by default) side by side: ``off``
(no tracing) and ``on`` (``--trace-file``: every record built,
replay-hashed, serialized and written). Two sweeps of unary requests with
``ignore_eos``, so every answer has exactly the output length asked for:

- prompt length: 128, 2,048, 16,384 and 131,072 ``input_ids``, 16 output
  tokens;
- output length: 16, 256 and 4,096 output tokens, a 128-token prompt.

Each cell (shape and mode) is a closed loop of ``--seconds`` at
``--concurrency`` keep-alive connections from an asyncio client in this
process (bench_tracing.py's), ``--reps`` repetitions, the two modes'
order alternating. Measured: the frontend process's CPU per request (all
threads, ``/proc/<pid>/task/*/schedstat``). Per sweep it prints the
median per cell with the repetitions' spread (min-max), the on/off ratio,
and the marginal CPU per token: (cell - the sweep's first cell) /
(tokens - its tokens), in µs. Work that grows linearly has a flat
marginal cost; a copy per event, a re-hash or a re-encode of the whole
prompt shows as a marginal cost rising with the length. The run fails
(exit 1) when the last cell's marginal cost per token exceeds 1.5x the
second's (prompt: 131,072 vs 2,048; output: 4,096 vs 256), or a tracing
frontend dropped a record.

CPU time on a shared machine moves by more than a 2K prompt's work, so
``--callgrind`` counts instructions instead, which other load does not
move: each cell is then profile_hop.py's count of the frontend under
callgrind (``--trace off``/``on``), per request, its trace writer's thread
included (under callgrind a batch holds a few records, so the writer's
per-batch work weighs more than at full speed).

Usage: ``.venv/bin/python bench/bench_cost_curves.py [--seconds 3] [--reps 3] [--concurrency 4]``
(about 3 minutes), or ``... --callgrind`` (about 15 minutes; needs valgrind).
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

import httpx
import orjson

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from bench_tracing import DEFAULT_HEALTH, input_ids, measure  # noqa: E402
from support import Proc, start_frontend, start_sim  # noqa: E402

PROMPTS = (128, 2048, 16384, 131072)
OUTPUTS = (16, 256, 4096)
MODES = ("off", "on")
#: The marginal cost per token of a sweep's last cell may be at most this
#: many times its second cell's (the bound: 128K against 2K).
MAX_GROWTH = 1.5


def request_bytes(prompt: int, output: int) -> bytes:
    """A raw keep-alive SGLang ``/generate`` request: ``prompt`` ids, exactly
    ``output`` tokens back (unary)."""
    body = orjson.dumps({
        "input_ids": input_ids(prompt),
        "sampling_params": {"max_new_tokens": output, "ignore_eos": True},
    })
    return (b"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body


def sweeps() -> dict[str, list[tuple[int, int]]]:
    """Each sweep's cells as (prompt tokens, output tokens), by the length swept."""
    return {
        "prompt": [(p, OUTPUTS[0]) for p in PROMPTS],
        "output": [(PROMPTS[0], o) for o in OUTPUTS],
    }


def marginal_us(cells: list[tuple[int, float]]) -> list[float | None]:
    """Cost per token past the first cell, a thousandth of the unit:
    ``(cost - first) * 1000 / (tokens - first tokens)`` for each cell of
    ``cells`` (tokens, cost per request: CPU ms, or M instructions);
    ``None`` for the first."""
    t0, c0 = cells[0]
    return [None] + [(c - c0) * 1000.0 / (t - t0) for t, c in cells[1:]]


def callgrind_counts(args: argparse.Namespace) -> dict[tuple[tuple[int, int], str], list[float]]:
    """Each cell's instructions per request, in millions (one repetition:
    the counts do not move), from profile_hop.py."""
    counts = {}
    for prompt, output in sorted({cell for cells in sweeps().values() for cell in cells}):
        requests = max(8, min(40, 2_000_000 // (prompt * 4 + output * 50)))
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, str(ROOT / "bench" / "profile_hop.py"), "--hop", args.worker_class,
                 "--workload", "unary", "--input-len", str(prompt), "--unary-tokens", str(output),
                 "--requests", str(requests), "--warmup", str(max(2, requests // 4)), "--trace", mode,
                 "--top", "0"], capture_output=True, text=True, check=True).stdout
            counts[((prompt, output), mode)] = [
                int(re.search(r"instructions per request: ([\d,]+)", out).group(1).replace(",", "")) / 1e6]
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per cell (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=4, help="connections (default %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default %(default)s)")
    parser.add_argument("--worker-class", default="asyncio", help="hypercorn worker class (default %(default)s)")
    parser.add_argument("--callgrind", action="store_true",
                        help="count instructions per request (profile_hop.py) instead of timing")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()[0]
    if args.callgrind:
        cpu, trace, unit = callgrind_counts(args), None, "M instructions"
    else:
        cpu, trace = timed(args)
        unit = "CPU ms"
    ok = report(args, cpu, unit, started, load_before)
    if trace is not None:
        records, submitted = trace
        print(f"trace (on): {submitted['submitted']} requests, {records} records in files, "
              f"dropped {submitted['dropped']}")
        ok = ok and records == submitted["submitted"] and not any(submitted["dropped"].values())
    return 0 if ok else 1


def timed(args: argparse.Namespace) -> tuple[dict, tuple[int, dict]]:
    """Each cell's frontend CPU ms per request, per repetition; and the
    traced frontend's records in files and ``/stats`` trace block."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-cost-"))
    sim = start_sim(extra=["--context-length", str(PROMPTS[-1] + OUTPUTS[-1] + 1024)])
    fronts: dict[str, Proc] = {}
    try:
        for mode in MODES:
            extra = ["--trace-file", str(tmp / "trace.jsonl")] if mode == "on" else []
            fronts[mode] = start_frontend([f"sglang={sim.url}"], worker_class=args.worker_class,
                                          extra=[*DEFAULT_HEALTH, *extra])
        shapes = sorted({cell for cells in sweeps().values() for cell in cells})
        cpu: dict[tuple[tuple[int, int], str], list[float]] = {}
        for shape in shapes:
            request = request_bytes(*shape)
            for fe in fronts.values():  # warm up: connections, caches
                measure(fe, request, min(1.0, args.seconds), args.concurrency)
            for rep in range(args.reps):
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                    _, ms, _ = measure(fronts[mode], request, args.seconds, args.concurrency)
                    cpu.setdefault((shape, mode), []).append(ms)
        trace = httpx.get(fronts["on"].url + "/stats", timeout=10).json()["trace"]
    finally:
        for fe in fronts.values():
            fe.stop()
        sim.stop()
    records = sum(len(p.read_bytes().splitlines()) for p in tmp.glob("trace.*.jsonl"))
    return cpu, (records, trace)


def report(args: argparse.Namespace, cpu: dict, unit: str, started: datetime.datetime, load_before: float) -> bool:
    """Print both sweeps' tables; whether every marginal cost per token
    stayed within ``MAX_GROWTH``."""
    how = ("instructions (callgrind)" if args.callgrind else
           f"concurrency {args.concurrency}, {args.seconds:g} s per cell, {args.reps} repetitions")
    print(f"# frontend {unit} per request as the work grows ({started:%Y-%m-%d %H:%M} UTC): unary, {how}, "
          f"{os.cpu_count()} CPUs, worker class {args.worker_class}; 1-min load average {load_before:.2f} "
          f"before, {os.getloadavg()[0]:.2f} after\n")
    per_token = "µs" if unit == "CPU ms" else "K instructions"
    ok = True
    for name, cells in sweeps().items():
        swept = 0 if name == "prompt" else 1
        print(f"| {name} tokens | off {unit}/req median (min-max) | on {unit}/req median (min-max) | on/off "
              f"| off marginal {per_token}/token | on marginal {per_token}/token |")
        print("|---:|---:|---:|---:|---:|---:|")
        medians = {m: [statistics.median(cpu[(c, m)]) for c in cells] for m in MODES}
        marginal = {m: marginal_us([(c[swept], v) for c, v in zip(cells, medians[m])]) for m in MODES}
        for i, cell in enumerate(cells):
            row = [f"{cell[swept]:,}"]
            for m in MODES:
                reps = cpu[(cell, m)]
                row.append(f"{medians[m][i]:.3f} ({min(reps):.3f}-{max(reps):.3f})")
            row.append(f"{medians['on'][i] / medians['off'][i]:.3f}")
            row += ["-" if marginal[m][i] is None else f"{marginal[m][i]:.3f}" for m in MODES]
            print("| " + " | ".join(row) + " |")
        for m in MODES:
            growth = marginal[m][-1] / marginal[m][1]
            ok = ok and growth <= MAX_GROWTH
            print(f"\n{name}, tracing {m}: marginal µs/token at {cells[-1][swept]:,} over at "
                  f"{cells[1][swept]:,}: {growth:.2f} (bound {MAX_GROWTH})", end="")
        print("\n")
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
