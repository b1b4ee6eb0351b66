"""Scale-out of ``serve --workers N``: how evenly its processes share the
connections, and what a request costs with one process and with two,
beside sglang-router.

One simulated SGLang worker (zero TTFT and ITL) is measured directly, then
through each hop in turn, unary requests only (128-token ``input_ids``, 16
output tokens, ``ignore_eos``; every answer checked by the wrk script), under
three loads:

- **keep-alive**: wrk's ``--concurrency`` connections, kept open, as fast as
  the hop answers;
- **short**: the same number of clients, each request on a connection of its
  own (``Connection: close``, wrk connects anew);
- **paced**: the keep-alive connections, each waiting between requests so
  that every process of ours gets ``--paced-rate`` requests/s (2 processes:
  twice the rate in all). An event loop's CPU per request falls as its load
  rises (more requests a wake-up), so comparing 1 process with 2 at one total
  rate charges the 2 with half the load each; at one rate per process the
  comparison is what adding a core with its own process gives.

The hops: asgi-generate with 1 process, with 2 processes sharing one
listening socket (the kernel wakes whichever it likes: ``serve --workers 2
--fd`` with a plain socket, how every ``--workers N`` served before), with 2
processes each on a socket of its own (``SO_REUSEPORT``: the kernel spreads
connections by hash; what ``serve --workers N --port P`` does on Linux, and
``--fd`` with a socket that has the option), and sglang-router. For each
cell: requests/s, the hop's CPU per request, requests per busy core (requests
per CPU second of the hop), through/direct, and for ours the requests each
process served (from its ``/stats``) and their max/min.

Usage: ``.venv/bin/python bench/bench_scaleout.py [--seconds 10]
[--concurrency 32] [--hop-cpus 1]`` (see ``--help``). Needs wrk on PATH and
sglang-router (installed on first use into ``bench/.venv-router``, as for
bench_frontend.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import pathlib
import sys
import threading

import orjson

from _check import answer, check_direct
from _loadgen import WRK_INSTALL, LoadResult, paced_script, run_wrk, write_script, wrk_path
from _procs import Child, LogDir, cpus_busy_seconds, http_request, listening_socket, run_main, wait_ready
from bench_frontend import (DIRECT, HERE, _fmt, _ratio, ensure_router, parse_hops, request_body, settle, start_hop,
                             start_sim)

#: hop -> (label, processes, SO_REUSEPORT); the router has no processes of ours.
HOPS = {
    "n1": ("asgi-generate, 1 process", 1, False),
    "n2-shared": ("asgi-generate, 2 processes, one shared socket", 2, False),
    "n2": ("asgi-generate, 2 processes, a socket each (SO_REUSEPORT)", 2, True),
    "router": ("sglang-router", 0, False),
}
LOADS = ("keep-alive", "short", "paced")


def start_ours(stack: contextlib.ExitStack, processes: int, reuse_port: bool, sim_port: int, cpus: set[int] | None,
               log_dir: pathlib.Path, worker_class: str) -> tuple[Child, int]:
    """``serve --workers processes`` on a loopback socket it inherits (with
    ``SO_REUSEPORT`` when ``reuse_port``); the supervisor and its port once
    it serves."""
    sock = listening_socket(reuse_port=reuse_port)
    port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "asgi_generate", "serve", "--workers", str(processes),
            "--worker", f"sglang=http://127.0.0.1:{sim_port}", "--fd", str(sock.fileno()),
            "--worker-class", worker_class, "--log-level", "warning"]
    child = Child(f"asgi-generate-{processes}-{'reuseport' if reuse_port else 'shared'}", argv, cpus, log_dir,
                  pass_fds=(sock.fileno(),))
    sock.close()
    stack.callback(child.stop)
    wait_ready(child, port, "GET", "/health")
    return child, port


def per_process(port: int, processes: int, tries: int = 400) -> dict[int, int]:
    """Requests each process served so far (its ``/stats`` ``request_items``),
    asking on fresh connections until every one of ``processes`` answered.

    Raises:
        RuntimeError: some process never answered.
    """
    seen: dict[int, int] = {}
    for _ in range(tries):
        stats = orjson.loads(http_request(port, "GET", "/stats")[1])
        seen[stats["pid"]] = stats["request_items"]
        if len(seen) == processes:
            return seen
    raise RuntimeError(f"only {len(seen)} of {processes} processes answered /stats in {tries} connections")


def connections(pids: list[int], port: int) -> dict[int, int]:
    """Established TCP connections to ``port`` that each of ``pids`` holds
    (its descriptors' socket inodes matched against ``/proc/net/tcp``)."""
    established = set()
    for line in pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":
            established.add(fields[9])
    out = {}
    for pid in pids:
        held = 0
        for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                held += target.startswith("socket:[") and target[8:-1] in established
        out[pid] = held
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    cpus = sorted(os.sched_getaffinity(0))
    sim_cpu, hop_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag, default, what in (("--seconds", 10, "measured seconds per cell"),
                                ("--warmup", 1, "unmeasured seconds before each cell"),
                                ("--concurrency", 32, "wrk connections (keep-alive) or clients (short)"),
                                ("--paced-rate", 500, "requests/s per process of ours in the paced cell (0: none)"),
                                ("--sim-cpu", sim_cpu, "CPU for the simulator"),
                                ("--loadgen-cpu", hop_cpu, "CPU for wrk (default: the hop's, as in bench_frontend.py)")):
        p.add_argument(flag, type=int, default=default, help=what)
    p.add_argument("--hops", default=",".join(HOPS), help=f"comma-separated hops besides direct: {', '.join(HOPS)}")
    p.add_argument("--worker-class", default="asyncio", help="our processes' hypercorn worker class")
    p.add_argument("--hop-cpus", default="" if hop_cpu is None else str(hop_cpu),
                   help="comma-separated CPUs for the frontend's processes or the router (empty: any)")
    p.add_argument("--router-venv", type=pathlib.Path, default=HERE / ".venv-router",
                   help="virtual environment for sglang-router (created on first use)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every answer checked out, 1 otherwise."""
    args = build_parser().parse_args(argv)
    try:
        hops = parse_hops(args.hops, HOPS, None)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    wrk = wrk_path()
    if wrk is None:
        print(f"bench_scaleout.py needs wrk on PATH; install it ({WRK_INSTALL}) and run it again", file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    router_python, router_version = ensure_router(args.router_venv) if "router" in hops else (None, None)
    sim_cpus = {args.sim_cpu} if args.sim_cpu is not None else None
    hop_cpus = {int(c) for c in args.hop_cpus.split(",") if c.strip()} or None
    loadgen = {args.loadgen_cpu} if args.loadgen_cpu is not None else None
    cores = {c for c in (args.sim_cpu, args.loadgen_cpu, *(hop_cpus or ())) if c is not None} \
        or os.sched_getaffinity(0)
    logs = LogDir("asgi-generate-scaleout-")
    rows: list[tuple[str, str, LoadResult, dict[int, int] | None, dict[int, int]]] = []
    with logs, contextlib.ExitStack() as stack:
        sim_port, sim = start_sim(stack, sim_cpus, logs.path)
        body = request_body(128, 16, False, 0)
        final = answer(sim_port, body)
        check_direct(final, 16, False)
        scripts = {}
        for load in LOADS[:2]:
            scripts[load] = logs.path / f"{load}.lua"
            write_script(scripts[load], body, False, 16, final[0]["output_ids"], close=load == "short")
        loads = LOADS if args.paced_rate > 0 else LOADS[:2]

        def cell(label: str, port: int, meters: dict, processes: int) -> None:
            for load in loads:
                # Paced: --paced-rate for each process of ours (direct and the router count as one).
                script = (paced_script(scripts["keep-alive"], args.concurrency, args.paced_rate * max(1, processes))
                          if load == "paced" else scripts[load])
                print(f"  {label}: {load}, warm-up then {args.seconds} s", file=sys.stderr)
                run_wrk(wrk, script, port, args.concurrency, args.warmup, loadgen, logs.path, meters)
                settle(meters)
                before = per_process(port, processes) if processes else None
                held: dict[int, int] = {}
                if before is not None and load == "keep-alive":  # the connections' split, a second in
                    threading.Timer(1.0, lambda: held.update(connections(list(before), port))).start()
                measured = run_wrk(wrk, script, port, args.concurrency, args.seconds, loadgen, logs.path,
                                   {**meters, "cores": lambda: cpus_busy_seconds(cores)})
                settle(meters)
                served = None
                if before is not None:
                    after = per_process(port, processes)
                    served = {pid: after[pid] - before.get(pid, 0) for pid in after}
                rows.append((label, load, measured, served, held))

        print(f"{DIRECT}:", file=sys.stderr)
        cell(DIRECT, sim_port, {"sim": sim.cpu_seconds}, 0)
        for hop in hops:
            label, processes, reuse_port = HOPS[hop]
            print(f"{label}:", file=sys.stderr)
            if hop == "router":
                child, port = start_hop(stack, "router", sim_port, hop_cpus, logs.path, router_python,
                                        request_body(4, 1, False, 0))
            else:
                child, port = start_ours(stack, processes, reuse_port, sim_port, hop_cpus, logs.path,
                                         args.worker_class)
            with contextlib.ExitStack() as hop_stack:
                hop_stack.callback(child.stop)  # one hop at a time on the hop's cores
                cell(label, port, {"sim": sim.cpu_seconds, "hop": child.cpu_seconds}, processes)
        logs.ok = all(lr.bad == 0 and lr.errors == 0 for _, _, lr, *_ in rows)
    report(rows, args, load_before, router_version)
    return 0 if logs.ok else 1


def report(rows: list, args: argparse.Namespace, load_before: float, router_version: str | None) -> None:
    """Print the context and the Markdown table."""
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), "")
    print(f"- bench_scaleout.py, {datetime.datetime.now().isoformat(timespec='seconds')}: {os.cpu_count()} x {model}; "
          f"1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; sglang-router "
          f"{router_version or 'not run'}.")
    print(f"- Pinning: simulator on CPU {args.sim_cpu}, the hop's processes on CPUs {args.hop_cpus or 'any'}, "
          f"wrk on CPU {args.loadgen_cpu}; {args.concurrency} connections (keep-alive) or clients (short, one "
          f"connection per request), {args.seconds} s per cell; paced: {args.paced_rate:,} requests/s per process "
          f"of ours (direct and the router: one); unary, 128-token input_ids, 16 output tokens; "
          f"our worker class {args.worker_class}.")
    print()
    print("| path | load | req/s | through/direct | hop CPU ms/req | hop busy (cores) | req per busy core "
          "| others (cores) | requests per process | max/min | connections per process |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|")
    direct = {load: lr for label, load, lr, *_ in rows if label == DIRECT}
    for label, load, lr, served, held in rows:
        hop = label != DIRECT
        cpu = lr.cpu_ms_per_request("hop") if hop else None
        per_core = lr.requests / lr.cpu["hop"] if hop and lr.cpu["hop"] > 0 else None
        spread = " / ".join(f"{served[pid]:,}" for pid in sorted(served, key=served.get, reverse=True)) \
            if served else "-"
        split = " / ".join(str(held.get(pid, 0)) for pid in sorted(served, key=served.get, reverse=True)) \
            if held and served else "-"
        balance = _fmt(_ratio(max(served.values()), min(served.values())), 3) if served else "-"
        busy = f"{lr.busy('hop'):.2f}" if hop else "-"
        # Paced, 2 processes were offered twice the direct cell's rate.
        offered = direct[load].rps * (len(served) if load == "paced" and served else 1)
        print(f"| {label} | {load} | {_fmt(lr.rps)} | {_fmt(_ratio(lr.rps, offered)) if hop else '-'} "
              f"| {_fmt(cpu, 3) if hop else '-'} | {busy} "
              f"| {_fmt(per_core) if hop else '-'} | {lr.others_busy():.2f} | {spread} | {balance} | {split} |")
    cpu = {(label, load): lr.cpu_ms_per_request("hop") for label, load, lr, *_ in rows if label != DIRECT}
    one = HOPS["n1"][0]
    for hop in ("n2", "n2-shared"):
        ratios = [f"{load} {_fmt(_ratio(cpu[HOPS[hop][0], load], cpu[one, load]), 3)}"
                  for load in LOADS if (HOPS[hop][0], load) in cpu and (one, load) in cpu]
        if ratios:
            print(f"\nCPU per request, {HOPS[hop][0]} over 1 process: {', '.join(ratios)}.")
    bad = [(label, load, lr) for label, load, lr, *_ in rows if lr.bad or lr.errors]
    print()
    print(f"Every response checked by the wrk script: {sum(lr.ok + lr.bad for _, _, lr, *_ in rows):,}, "
          f"{'all good' if not bad else 'PROBLEMS:'}")
    for label, load, lr in bad:
        print(f"- {label} {load}: {lr.bad} bad ({lr.first_bad or 'n/a'}), {lr.errors} wrk errors")


if __name__ == "__main__":
    run_main(main)
