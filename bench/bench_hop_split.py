"""Where a hop's CPU time goes per unary request: user vs system time,
context switches, and (with ``--perf``) kernel vs user-space samples by
function, for ours, the floor and a byte relay, side by side in one run.

One simulated SGLang worker (zero TTFT/ITL, pinned to the first CPU) and,
on the second CPU with wrk, each hop in turn:

- ``asyncio`` (``trio``, ``uvloop``, ``baseline-*``): asgi-generate as
  bench_frontend.py serves it;
- ``floor-asyncio`` (...): hypercorn alone with a fixed answer
  (``bench/_floor.py``): one TCP connection, the client's;
  ``baseline-floor-asyncio`` (...) serves it with the ``--baseline``
  checkout's server;
- ``direct``: the simulator itself (for the latency column; its
  "hop" figures are the simulator's);
- ``relay``: ``bench/_relay.py``, asyncio protocols passing bytes between
  the client's connection and one engine connection each, nothing parsed:
  the kernel work of the second TCP connection (its system time less the
  floor's) and a minimal loop's turns for it.

Each cell runs wrk at ``--concurrency`` keep-alive connections for
``--seconds`` after a warm-up, with bench_frontend.py's unary request and
its answer checked by wrk's script, and reads ``/proc/PID/stat`` (utime,
stime) and ``/proc/PID/status`` (voluntary and involuntary context
switches) of the hop and the simulator before and after: microseconds of
user and system time, and switches, per request, with wrk's p50 latency
(at ``--concurrency 1``, the latency per request). On loopback the kernel
runs the receiver's TCP processing in the sender's system call, so the
hop's system time includes the engine side's receive of what the hop
sends (and the simulator's includes the hop's receive of the answer).

With ``--perf`` each hop gets a second cell under ``perf record -e
cpu-clock`` (software sampling, so it works in a VM without hardware
counters): the share of samples in the kernel and in user space, and the
kernel functions with the most samples. ``--reps N`` repeats every hop's
cell N times in rotating order and reports each repetition.

Usage: ``.venv/bin/python bench/bench_hop_split.py --hops
asyncio,floor-asyncio,relay --reps 3`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import os
import pathlib
import shutil
import subprocess
import sys
from dataclasses import dataclass

from _check import answer, check_direct
from _loadgen import WRK_INSTALL, run_wrk, write_script, wrk_path
from _procs import (Child, LogDir, cpus_busy_seconds, http_request, listening_socket, run_main,
                    user_system_seconds, wait_ready)
from bench_frontend import BASELINE, HOPS, parse_hops, request_body, start_hop, start_sim

HERE = pathlib.Path(__file__).resolve().parent
RELAY = "relay"
DIRECT = "direct"
LABELS = {**HOPS, RELAY: "byte relay (asyncio protocols)", DIRECT: "direct (the simulator; hop = simulator)",
          # The floor served by the --baseline checkout: the server's own change, before and after.
          **{BASELINE + h: f"{HOPS[h]}, baseline" for h in HOPS if h.startswith("floor-")}}


@dataclass
class Counters:
    """One process's counters at one moment (seconds, switches)."""

    user: float
    system: float
    voluntary: int
    involuntary: int

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(self.user - other.user, self.system - other.system,
                        self.voluntary - other.voluntary, self.involuntary - other.involuntary)


def read_counters(pid: int) -> Counters:
    """utime/stime (``/proc/PID/stat``, every thread) and context switches
    (``/proc/PID/task/*/status``, summed over threads)."""
    user, system = user_system_seconds(pid)
    voluntary = involuntary = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    voluntary += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    involuntary += int(line.split()[1])
    return Counters(user, system, voluntary, involuntary)


@dataclass
class Cell:
    """One measured cell of one hop."""

    hop: str
    requests: int
    seconds: float
    hop_use: Counters
    sim_use: Counters
    others: float
    bad: int
    p50_ms: float

    def per_request_us(self, c: Counters) -> tuple[float, float]:
        """(user, system) microseconds per request of counters ``c``."""
        return 1e6 * c.user / self.requests, 1e6 * c.system / self.requests


def start_relay(stack: contextlib.ExitStack, sim_port: int, cpus: set[int] | None,
                log_dir: pathlib.Path) -> tuple[Child, int]:
    """Start ``bench/_relay.py`` in front of the simulator; it and its port."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    argv = [sys.executable, str(HERE / "_relay.py"), "--fd", str(sock.fileno()), "--upstream", str(sim_port)]
    child = Child("relay", argv, cpus, log_dir, pass_fds=(sock.fileno(),))
    sock.close()
    stack.callback(child.stop)
    wait_ready(child, port, "GET", "/health")
    return child, port


def measure_cell(hop: str, child: Child, port: int, sim: Child, args: argparse.Namespace, wrk: str,
                 script: pathlib.Path, log_dir: pathlib.Path) -> Cell:
    """A warm-up, then one measured wrk cell with the counters around it."""
    loadgen = {args.loadgen_cpu} if args.loadgen_cpu is not None else None
    cores = {c for c in (args.sim_cpu, args.hop_cpu, args.loadgen_cpu) if c is not None} or os.sched_getaffinity(0)
    run_wrk(wrk, script, port, args.concurrency, args.warmup, loadgen, log_dir, {})
    hop0, sim0 = read_counters(child.pid), read_counters(sim.pid)
    meters = {"hop": child.cpu_seconds, "cores": lambda: cpus_busy_seconds(cores)}
    if child is not sim:
        meters["sim"] = sim.cpu_seconds
    result = run_wrk(wrk, script, port, args.concurrency, args.seconds, loadgen, log_dir, meters)
    hop_use, sim_use = read_counters(child.pid) - hop0, read_counters(sim.pid) - sim0
    return Cell(hop, result.requests, result.seconds, hop_use, sim_use, result.others_busy(),
                result.bad + result.errors, result.p50_ms)


def perf_cell(hop: str, child: Child, port: int, args: argparse.Namespace, wrk: str, script: pathlib.Path,
              log_dir: pathlib.Path) -> tuple[int, dict[str, int], int]:
    """One wrk cell with ``perf record -e cpu-clock`` on the hop: requests,
    samples by kernel function (``[k]``) or user-space object, total samples."""
    loadgen = {args.loadgen_cpu} if args.loadgen_cpu is not None else None
    data = log_dir / f"perf-{hop}.data"
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-p", str(child.pid),
                             "-o", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        result = run_wrk(wrk, script, port, args.concurrency, args.seconds, loadgen, log_dir, {})
    finally:
        perf.send_signal(2)
        perf.wait(30)
    report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort",
                             "dso,sym", "-F", "sample,dso,sym", "-t", "\t"],
                            capture_output=True, text=True).stdout
    samples: dict[str, int] = collections.Counter()
    for line in report.splitlines():
        parts = [p.strip() for p in line.split("\t")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        count, dso, sym = int(parts[0]), parts[1], parts[2]
        key = f"[k] {sym.removeprefix('[k] ')}" if sym.startswith("[k]") else f"[user] {dso}"
        samples[key] += count
    return result.requests, samples, sum(samples.values())


def print_cells(cells: list[Cell]) -> None:
    print("Per unary request, microseconds of CPU (user / system) and context switches "
          "(voluntary / involuntary); others = cores' worth of CPU other processes took from the pinned cores:")
    print()
    print("| hop | rep | req/s | p50 ms | hop user | hop system | hop total | hop switches vol / invol | "
          "sim user | sim system | others |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    seen: dict[str, int] = collections.Counter()
    for c in cells:
        seen[c.hop] += 1
        hu, hs = c.per_request_us(c.hop_use)
        su, ss = c.per_request_us(c.sim_use)
        print(f"| {LABELS[c.hop]} | {seen[c.hop]} | {c.requests / c.seconds:,.0f} | {c.p50_ms:.3f} | "
              f"{hu:.0f} | {hs:.0f} | "
              f"{hu + hs:.0f} | {c.hop_use.voluntary / c.requests:.2f} / {c.hop_use.involuntary / c.requests:.2f} | "
              f"{su:.0f} | {ss:.0f} | {c.others:.2f} |")
    print()
    medians: dict[str, tuple[float, float]] = {}
    for hop in dict.fromkeys(c.hop for c in cells):
        mine = sorted((c.per_request_us(c.hop_use) for c in cells if c.hop == hop), key=sum)
        medians[hop] = mine[len(mine) // 2]
    floors = [h for h in medians if h.startswith("floor-")]  # this checkout's
    if floors and RELAY in medians:
        floor = floors[0]
        fu, fs = medians[floor]
        ru, rs = medians[RELAY]
        print(f"Split against {LABELS[floor]} and the relay (medians by total, microseconds per request):")
        print()
        print("| hop | user over the floor | system over the floor | of which the second connection's kernel work "
              "(relay system - floor system) | system beyond the relay's |")
        print("|---|---:|---:|---:|---:|")
        for hop, (u, s) in medians.items():
            if hop in (floor, DIRECT) or hop.startswith(BASELINE + "floor-"):
                continue
            print(f"| {LABELS[hop]} | {u - fu:.0f} | {s - fs:.0f} | {rs - fs:.0f} | {s - rs:.0f} |")
        print()


def print_perf(hop: str, requests: int, samples: dict[str, int], total: int, top: int) -> None:
    if not total:
        print(f"{LABELS[hop]}: perf recorded no samples")
        return
    kernel = sum(v for k, v in samples.items() if k.startswith("[k]"))
    print(f"{LABELS[hop]}: {total:,} samples over {requests:,} requests; kernel {100 * kernel / total:.1f}%, "
          f"user space {100 * (total - kernel) / total:.1f}%")
    print()
    print("| where | share of samples |")
    print("|---|---:|")
    for key, count in sorted(samples.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {key} | {100 * count / total:.1f}% |")
    print()


def build_parser() -> argparse.ArgumentParser:
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hops", default="asyncio,floor-asyncio,relay",
                   help=f"comma-separated hops: {', '.join(h for h in LABELS if h != 'router')}")
    p.add_argument("--baseline", type=pathlib.Path, default=None, help="the checkout the baseline-* hops run")
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--perf", action="store_true", help="also a perf record cell per hop (needs perf)")
    p.add_argument("--top", type=int, default=25, help="rows of the perf tables")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--unary-tokens", type=int, default=16)
    p.add_argument("--sim-cpu", type=int, default=cpus[0] if pinned else None)
    p.add_argument("--hop-cpu", type=int, default=cpus[1] if pinned else None)
    p.add_argument("--loadgen-cpu", type=int, default=cpus[1] if pinned else None)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the cells; 0 when every answer checked out, 1 otherwise."""
    args = build_parser().parse_args(argv)
    try:
        hops = parse_hops(args.hops, [h for h in LABELS if h != "router"], args.baseline)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    wrk = wrk_path()
    if wrk is None:
        print(f"needs wrk on PATH ({WRK_INSTALL})", file=sys.stderr)
        return 2
    if args.perf and shutil.which("perf") is None:
        print("--perf needs perf on PATH (Debian: apt-get install linux-perf)", file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    sim_cpus = {args.sim_cpu} if args.sim_cpu is not None else None
    hop_cpus = {args.hop_cpu} if args.hop_cpu is not None else None
    logs = LogDir("asgi-generate-split-")
    cells: list[Cell] = []
    perfs: list[tuple[str, int, dict[str, int], int]] = []
    with logs, contextlib.ExitStack() as stack:
        log_dir = logs.path
        sim_port, sim = start_sim(stack, sim_cpus, log_dir)
        body = request_body(args.input_len, args.unary_tokens, False, 0)
        events = answer(sim_port, body)
        check_direct(events, args.unary_tokens, False)
        (log_dir / "unary.json").write_bytes(http_request(sim_port, "POST", "/generate", body)[1])
        sse_body = request_body(args.input_len, 4, True, 0)
        (log_dir / "sse.txt").write_bytes(http_request(sim_port, "POST", "/generate", sse_body)[1])
        script = log_dir / "unary.lua"
        write_script(script, body, False, args.unary_tokens, events[0]["output_ids"])
        started: dict[str, tuple[Child, int]] = {}
        for hop in hops:
            if hop == RELAY:
                started[hop] = start_relay(stack, sim_port, hop_cpus, log_dir)
            elif hop == DIRECT:
                started[hop] = (sim, sim_port)
            else:
                started[hop] = start_hop(stack, hop, sim_port, hop_cpus, log_dir, None,
                                         request_body(4, 1, False, 0), args.baseline)
        for rep in range(args.reps):
            for hop in hops[rep % len(hops):] + hops[:rep % len(hops)]:
                print(f"{LABELS[hop]}: repetition {rep + 1} of {args.reps}", file=sys.stderr)
                child, port = started[hop]
                cells.append(measure_cell(hop, child, port, sim, args, wrk, script, log_dir))
        if args.perf:
            for hop in hops:
                print(f"{LABELS[hop]}: perf record", file=sys.stderr)
                child, port = started[hop]
                perfs.append((hop, *perf_cell(hop, child, port, args, wrk, script, log_dir)))
        logs.ok = all(c.bad == 0 for c in cells)
    print(f"bench_hop_split.py, {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}: "
          f"{args.concurrency} connections, {args.seconds} s cells, {args.reps} repetition(s); 1-min load average "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after; simulator on CPU {args.sim_cpu}, hop and "
          f"wrk on CPU {args.hop_cpu}.")
    print()
    print_cells(cells)
    for hop, requests, samples, total in perfs:
        print_perf(hop, requests, samples, total, args.top)
    bad = sum(c.bad for c in cells)
    print(f"responses that failed wrk's checks or errors: {bad}")
    return 0 if logs.ok else 1


if __name__ == "__main__":
    run_main(main)
