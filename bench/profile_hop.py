"""Where a hop's CPU goes, per request, in measures other load does not move.

Starts one simulated SGLang worker (zero TTFT/ITL) and one hop in front of
it (``asgi-generate serve --worker-class X``, or bench_frontend.py's
``floor``: hypercorn serving a fixed answer), sends ``--warmup`` requests,
then ``--requests`` more over ``--concurrency`` keep-alive connections
(the bench_frontend.py bodies: 128-token ``input_ids``, unary 16 tokens or
SSE 256 events), every answer checked for status and size, and reports:

- ``--tool callgrind``: the hop runs under ``valgrind --tool=callgrind``;
  its counters are zeroed after the warm-up and dumped after the measured
  requests (``callgrind_control``): instructions per request, and the
  functions with the most (exclusive, and inclusive) per request.
- ``--tool cprofile``: the hop runs under cProfile (``bench/_profiled.py``)
  for the measured requests only: calls per request (exact) and each
  function's share of the profiled time (own and cumulative).
- ``--tool strace``: ``strace -f -c`` attaches to the hop (all its threads)
  after the warm-up and detaches after the measured requests: system calls
  per request by kind. The counts move a little with timing (whether a read
  finds its bytes already there, how many sockets one ``epoll_wait``
  returns), not with the machine's load as such; ``--concurrency 1`` gives
  the per-request sequence without batching.

``--trace on`` serves with ``--trace-file`` (a JSONL file in the run's
folder), ``--trace parsers`` also with bench_tracing.py's tokenizer and
parsers: the counts then include the trace writer's thread, which is given
a second after the warm-up and after the measured requests to write their
records (the figure of bench_tracing.py's ``on`` and ``parsers`` modes,
without the load's noise). ``--input-len`` and ``--unary-tokens`` set the
request's shape.

Usage: ``.venv/bin/python bench/profile_hop.py --hop asyncio --workload
unary --tool callgrind`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import time

import h11

from _procs import Child, http_request, listening_socket, wait_ready
from bench_frontend import HOPS, python_args, request_body, start_sim

from asgi_generate.assets import TOKENIZER_PATH

HERE = pathlib.Path(__file__).resolve().parent
#: Seconds the trace writer is given to write what it holds (it gathers
#: records for 0.1 s; a hop under callgrind runs about 50x slower).
TRACE_SETTLE_S = 1.0


def trace_args(trace: str, log_dir: pathlib.Path) -> list[str]:
    """``serve`` arguments for ``--trace`` ``off``, ``on`` or ``parsers``."""
    if trace == "off":
        return []
    args = ["--trace-file", str(log_dir / "trace.jsonl")]
    if trace == "parsers":
        args += ["--tokenizer", str(TOKENIZER_PATH), "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"]
    return args


async def _one_connection(port: int, body: bytes, count: int, want_bytes: int, failures: list[str]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    headers = [("host", "127.0.0.1"), ("content-type", "application/json"), ("content-length", str(len(body)))]
    try:
        for _ in range(count):
            writer.write(conn.send(h11.Request(method="POST", target="/generate", headers=headers))
                         + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            size, status = 0, None
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    size += len(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
            if status != 200 or size < want_bytes:
                failures.append(f"status {status}, {size} bytes")
            conn.start_next_cycle()
    finally:
        writer.close()


def send_requests(port: int, body: bytes, requests: int, concurrency: int, want_bytes: int) -> list[str]:
    """``requests`` POSTs of ``body`` over ``concurrency`` connections;
    the failures (status other than 200 or a short body)."""
    failures: list[str] = []

    async def main() -> None:
        per = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
        await asyncio.gather(*(_one_connection(port, body, n, want_bytes, failures) for n in per if n))

    asyncio.run(main())
    return failures


def callgrind_report(out: pathlib.Path, requests: int, top: int) -> None:
    """Print instructions per request and the top functions of a dump."""
    text = out.read_text(errors="replace")
    total = int(re.search(r"^summary:\s+(\d+)", text, re.M).group(1))
    print(f"instructions per request: {total / requests:,.0f} ({total:,} for {requests} requests)")
    for inclusive in ("no", "yes"):
        ann = subprocess.run(["callgrind_annotate", f"--inclusive={inclusive}", "--threshold=90", str(out)],
                             capture_output=True, text=True, check=True).stdout
        rows = [line for line in ann.splitlines() if re.match(r"^\s*[\d,]+ \(", line)][1:top + 1]
        print(f"\ntop {top} functions, {'inclusive' if inclusive == 'yes' else 'exclusive'}, per request:")
        for line in rows:
            count, rest = line.strip().split(" ", 1)
            print(f"{int(count.replace(',', '')) / requests:>12,.0f}  {rest}")


def cprofile_report(out: pathlib.Path, requests: int, top: int) -> None:
    """Print calls per request and time shares of a pstats dump."""
    stats = pstats.Stats(str(out))
    total = stats.total_tt or 1.0
    print(f"function calls per request: {stats.total_calls / requests:,.1f}")
    rows = stats.stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    for key, label in ((2, "own"), (3, "cumulative")):
        print(f"\ntop {top} by {label} time (share of profiled time; calls per request):")
        for func, data in sorted(rows.items(), key=lambda kv: -kv[1][key])[:top]:
            file, line, name = func
            where = f"{pathlib.Path(file).parent.name}/{pathlib.Path(file).name}:{line}" if line else file
            print(f"{100 * data[key] / total:6.1f}%  {data[1] / requests:8.2f}  {name}  {where}")


def strace_attach(pid: int, out: pathlib.Path) -> subprocess.Popen:
    """``strace -f -c`` attached to every thread of ``pid``, counting into
    ``out``; returns once it is attached (its "attached" lines on stderr)."""
    tracer = subprocess.Popen(["strace", "-f", "-c", "-o", str(out), "-p", str(pid)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    threads = len(os.listdir(f"/proc/{pid}/task"))
    attached = 0
    while attached < threads:
        line = tracer.stderr.readline()
        if not line:
            raise RuntimeError(f"strace exited with {tracer.wait()}")
        attached += b"attached" in line
    return tracer


def strace_detach(tracer: subprocess.Popen) -> None:
    """Detach (SIGINT) and wait for the summary to be written."""
    tracer.send_signal(signal.SIGINT)
    tracer.communicate(timeout=30)


def strace_report(out: pathlib.Path, requests: int, top: int) -> None:
    """Print system calls per request by kind from ``strace -c``'s table."""
    rows = []
    for line in out.read_text().splitlines():
        cells = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(cells) >= 5 and cells[0][0].isdigit() and cells[3].isdigit():
            errors = int(cells[4]) if len(cells) == 6 else 0
            rows.append((cells[-1], int(cells[3]), errors))
    total = next((calls for name, calls, _ in rows if name == "total"), 0)
    print(f"system calls per request: {total / requests:.2f} ({total:,} for {requests} requests)")
    print("\n| syscall | per request | errors per request |\n|---|---:|---:|")
    for name, calls, errors in sorted((r for r in rows if r[0] != "total"), key=lambda r: -r[1])[:top]:
        print(f"| {name} | {calls / requests:.2f} | {errors / requests:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hop", default="asyncio", choices=[h for h in HOPS if h != "router"],
                   help="asgi-generate's worker class, or a floor hop (hypercorn alone, bench_frontend.py)")
    p.add_argument("--workload", choices=("unary", "sse"), default="unary")
    p.add_argument("--tool", choices=("callgrind", "cprofile", "strace"), default="callgrind")
    p.add_argument("--requests", type=int, default=None, help="measured requests (default 300 unary, 40 SSE)")
    p.add_argument("--warmup", type=int, default=None, help="requests before measuring (default 60 / 10)")
    p.add_argument("--concurrency", type=int, default=8, help="keep-alive connections")
    p.add_argument("--top", type=int, default=30, help="functions listed")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--unary-tokens", type=int, default=16)
    p.add_argument("--sse-tokens", type=int, default=256)
    p.add_argument("--baseline", type=pathlib.Path, default=None,
                   help="the checkout a baseline-* hop runs (bench_frontend.py --baseline)")
    p.add_argument("--trace", choices=("off", "on", "parsers"), default="off",
                   help="request-end tracing: off, on (JSONL file), on with the tokenizer and both parsers")
    args = p.parse_args(argv)
    stream = args.workload == "sse"
    requests = args.requests or (40 if stream else 300)
    warmup = args.warmup if args.warmup is not None else (10 if stream else 60)
    tokens = args.sse_tokens if stream else args.unary_tokens
    body = request_body(args.input_len, tokens, stream, 0)
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="asgi-generate-profile-"))
    out = log_dir / {"callgrind": "callgrind.out", "cprofile": "profile.pstats", "strace": "strace.txt"}[args.tool]
    with contextlib.ExitStack() as stack:
        sim_port, _sim = start_sim(stack, None, log_dir,
                                   context_length=args.input_len + max(args.unary_tokens, args.sse_tokens) + 1024)
        sse_answer = http_request(sim_port, "POST", "/generate", request_body(args.input_len, args.sse_tokens,
                                                                            True, 0))[1]
        unary_answer = http_request(sim_port, "POST", "/generate", request_body(args.input_len,
                                                                              args.unary_tokens, False, 0))[1]
        want = len(sse_answer if stream else unary_answer) * 9 // 10
        sock = listening_socket()
        port = sock.getsockname()[1]
        (log_dir / "unary.json").write_bytes(unary_answer)
        (log_dir / "sse.txt").write_bytes(sse_answer)
        cmd = python_args(args.hop, sim_port, sock.fileno(), log_dir)
        if args.trace != "off":
            if args.hop.startswith("floor"):
                p.error("--trace is for asgi-generate's hops")
            cmd += trace_args(args.trace, log_dir)
        if args.tool == "callgrind":
            argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
                    "--collect-atstart=yes", sys.executable, *cmd]
        elif args.tool == "cprofile":
            argv = [sys.executable, str(HERE / "_profiled.py"), *cmd]
        else:
            argv = [sys.executable, *cmd]
        os.environ["PROFILED_OUT"] = str(out)
        if args.hop.startswith("baseline-"):
            if args.baseline is None:
                p.error("a baseline-* hop needs --baseline DIR")
            os.environ["PYTHONPATH"] = str(args.baseline)
            # -m would put the working directory (this checkout, when run
            # from its root) before PYTHONPATH.
            os.environ["PYTHONSAFEPATH"] = "1"
        hop = Child(f"hop-{args.hop}", argv, None, log_dir, pass_fds=(sock.fileno(),))
        sock.close()
        stack.callback(hop.stop, 60.0)
        wait_ready(hop, port, "GET", "/health", timeout=600.0)
        failures = send_requests(port, body, warmup, args.concurrency, want)
        if args.trace != "off":
            time.sleep(TRACE_SETTLE_S)
        if args.tool == "callgrind":
            subprocess.run(["callgrind_control", "--zero", str(hop.pid)], check=True, capture_output=True)
        elif args.tool == "strace":
            tracer = strace_attach(hop.pid, out)
            stack.callback(tracer.kill)
        else:
            os.kill(hop.pid, signal.SIGUSR1)
            time.sleep(0.5)
        started = time.monotonic()
        failures += send_requests(port, body, requests, args.concurrency, want)
        elapsed = time.monotonic() - started
        if args.trace != "off":
            time.sleep(TRACE_SETTLE_S)
        if args.tool == "callgrind":
            subprocess.run(["callgrind_control", "--dump", str(hop.pid)], check=True, capture_output=True)
            dumps = sorted(log_dir.glob("callgrind.out*"), key=lambda f: f.stat().st_mtime)
            out = dumps[-1]
        elif args.tool == "strace":
            strace_detach(tracer)
        else:
            os.kill(hop.pid, signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
    print(f"hop {args.hop}, {args.workload}, {args.tool}, trace {args.trace}, input {args.input_len} tokens: "
          f"{requests} requests after {warmup} warm-up, "
          f"{args.concurrency} connections, {elapsed:.1f} s; 1-min load average {os.getloadavg()[0]:.2f}; "
          f"failures: {len(failures)}{' (' + failures[0] + ')' if failures else ''}")
    report = {"callgrind": callgrind_report, "cprofile": cprofile_report, "strace": strace_report}[args.tool]
    report(out, requests, args.top)
    print(f"(dump kept: {out})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
