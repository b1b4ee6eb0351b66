"""Side-by-side benchmark: the simulator directly, through asgi-generate
(hypercorn trio, asyncio and uvloop worker classes), through sglang-router,
and the floor: hypercorn alone serving a fixed answer.

One run starts one simulated SGLang worker (zero TTFT and ITL) and, for each
hop in turn, measures with wrk:

- unary requests/s: 128-token ``input_ids``, 16 output tokens;
- SSE events/s: the same input, 256 output tokens, one event per token;

(``ignore_eos`` so every answer has exactly that many tokens) at
``--concurrency`` keep-alive connections, then latency per request at one
connection, and the CPU seconds each process used. Every response under load
is checked by the wrk script (status, event count and order, final
``output_ids``); a sample sent concurrently through each hop is compared,
event for event, with the simulator's direct answer. It prints Markdown
tables and ratios: through/direct, ours/router, added latency ours/router,
and the frontend's CPU per request.

The ``floor-*`` hops (``bench/_floor.py``) are hypercorn with each worker
class, configured as ``serve`` configures it, answering the simulator's own
answer (recorded once) with no engine behind it: what hypercorn and the event
loop cost per request; a hop's CPU per request minus its worker class's
floor is ours (handler, codec, worker client, pool, metrics). The sampled
answers are not compared for the floor (it has one answer for every prompt);
every response under load is checked as for the other hops.

A saturated floor serves several times the requests per second that a hop
held back by the simulator does, and an event loop's cost per request falls
as its load rises (more requests a wake-up), so the **paced** unary cell
(``--paced-rate``, 1,000 requests/s) also runs every hop at one arrival
rate: wrk's connections each wait ``concurrency / rate`` between requests.
There the floor costs what hypercorn costs at the hop's own load, and hop
minus floor is ours at the same rate.

Usage: ``.venv/bin/python bench/bench_frontend.py [--seconds 10]
[--concurrency 32]`` (see ``--help``). sglang-router is installed on first
use into its own venv, ``bench/.venv-router``; wrk must be on PATH (when it
is not, the benchmark prints how to install it and stops).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import pathlib
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Callable, Collection

import orjson

from _check import answer, check_direct, compare
from _loadgen import WRK_INSTALL, LoadResult, paced_script, run_wrk, write_script, wrk_path
from _procs import (Child, LogDir, cpus_busy_seconds, free_port, http_request, listening_socket, run_main,
                    wait_ready)

HERE = pathlib.Path(__file__).resolve().parent
ROUTER_REQUIREMENT = "sglang-router>=0.3,<0.4"
HOPS = {
    "trio": "asgi-generate (trio)",
    "asyncio": "asgi-generate (asyncio)",
    "uvloop": "asgi-generate (uvloop)",
    "router": "sglang-router",
    "floor-trio": "floor: hypercorn alone (trio)",
    "floor-asyncio": "floor: hypercorn alone (asyncio)",
    "floor-uvloop": "floor: hypercorn alone (uvloop)",
    "baseline-trio": "asgi-generate (trio, baseline)",
    "baseline-asyncio": "asgi-generate (asyncio, baseline)",
    "baseline-uvloop": "asgi-generate (uvloop, baseline)",
}
FLOOR = "floor-"
#: A hop served by the code of ``--baseline`` (another checkout of the
#: repository, first on ``PYTHONPATH``): before and after in one run.
BASELINE = "baseline-"
DIRECT = "direct (simulator)"
# Token ids well inside the bundled tokenizer's 4096-entry vocabulary.
ID_LOW, ID_SPAN = 100, 3900
# A 1-minute load average above this before the run means other work shares the cores.
BUSY_LOAD = 0.5
# Cores' worth of CPU that others may take from the pinned cores in a cell
# before the run is called noisy.
NOISE_CORES = 0.05


@dataclass(frozen=True)
class Workload:
    """One request shape: unary or SSE, with a fixed output length."""

    name: str
    stream: bool
    tokens: int


@dataclass
class HopResult:
    """Everything measured for one hop (or for the simulator directly)."""

    label: str
    load: dict[str, LoadResult] = field(default_factory=dict)
    latency: dict[str, LoadResult] = field(default_factory=dict)
    sample_problems: list[str] = field(default_factory=list)
    samples: int = 0
    #: The unary cell at ``--paced-rate`` (None: not run).
    paced: LoadResult | None = None


def parse_hops(text: str, known: Collection[str], baseline: pathlib.Path | None) -> list[str]:
    """The hops of ``--hops`` (comma-separated), checked.

    Raises:
        ValueError: a hop not in ``known`` (the message names the known
            ones), or a ``baseline-*`` hop without a ``baseline`` checkout.
    """
    hops = [h.strip() for h in text.split(",") if h.strip()]
    unknown = [h for h in hops if h not in known]
    if unknown:
        raise ValueError(f"unknown hop(s) {unknown}; choose from {list(known)}")
    if baseline is None and any(h.startswith(BASELINE) for h in hops):
        raise ValueError("the baseline-* hops need --baseline DIR")
    return hops


def request_body(input_len: int, tokens: int, stream: bool, variant: int) -> bytes:
    """An SGLang ``/generate`` body: ``input_len`` ids (a different prompt
    per ``variant``), exactly ``tokens`` output tokens."""
    ids = [ID_LOW + (11 + 977 * variant + 7 * i) % ID_SPAN for i in range(input_len)]
    return orjson.dumps(
        {"input_ids": ids, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}, "stream": stream}
    )


def ensure_router(venv: pathlib.Path) -> tuple[str, str]:
    """The router venv's python and sglang-router's version, creating the
    venv and installing sglang-router on first use."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import sglang_router"]
    if not python.exists() or subprocess.run(probe, capture_output=True).returncode != 0:
        print(f"installing {ROUTER_REQUIREMENT} into {venv} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", ROUTER_REQUIREMENT], check=True)
    out = subprocess.run(
        [str(python), "-c", "from importlib.metadata import version; print(version('sglang-router'))"],
        capture_output=True, text=True, check=True,
    )
    return str(python), out.stdout.strip()


def start_sim(stack: contextlib.ExitStack, cpus: set[int] | None, log_dir: pathlib.Path,
              context_length: int | None = None) -> tuple[int, Child]:
    """Start the simulator with zero TTFT/ITL (and ``--context-length`` when
    given); return its port and process."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "asgi_generate", "sim", "--protocol", "sglang",
            "--fd", str(sock.fileno()), "--ttft-ms", "0", "--itl-ms", "0"]
    if context_length is not None:
        argv += ["--context-length", str(context_length)]
    sim = Child("sim", argv, cpus, log_dir, pass_fds=(sock.fileno(),))
    sock.close()
    stack.callback(sim.stop)
    wait_ready(sim, port, "GET", "/health")
    return port, sim


def python_args(hop: str, sim_port: int, fd: int, log_dir: pathlib.Path) -> list[str]:
    """The Python arguments that serve ``hop`` (ours or a ``floor-*`` hop,
    which answers ``log_dir``'s recorded ``unary.json`` / ``sse.txt``) on
    the listening socket ``fd``, in front of the simulator at ``sim_port``
    (a ``baseline-*`` hop's are its worker class's)."""
    hop = hop.removeprefix(BASELINE)
    if hop.startswith(FLOOR):
        return [str(HERE / "_floor.py"), "--fd", str(fd), "--worker-class", hop[len(FLOOR):],
                "--unary", str(log_dir / "unary.json"), "--sse", str(log_dir / "sse.txt")]
    return ["-m", "asgi_generate", "serve", "--worker", f"sglang=http://127.0.0.1:{sim_port}",
            "--fd", str(fd), "--worker-class", hop, "--log-level", "warning"]


def start_hop(
    stack: contextlib.ExitStack,
    hop: str,
    sim_port: int,
    cpus: set[int] | None,
    log_dir: pathlib.Path,
    router_python: str | None,
    probe_body: bytes,
    baseline: pathlib.Path | None = None,
) -> tuple[Child, int]:
    """Start ``hop`` (``trio``, ``asyncio``, ``uvloop``, ``router``, a
    ``floor-*`` hop answering the recorded ``unary.json`` / ``sse.txt`` in
    ``log_dir``, or a ``baseline-*`` hop running the checkout ``baseline``)
    in front of the simulator; return it and its port once it serves."""
    worker = f"http://127.0.0.1:{sim_port}"
    if hop == "router":
        port = free_port()
        argv = [router_python, "-m", "sglang_router.launch_router",
                "--host", "127.0.0.1", "--port", str(port), "--worker-urls", worker,
                "--policy", "round_robin", "--log-level", "warn",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        child = Child("sglang-router", argv, cpus, log_dir)
        stack.callback(child.stop)
        # The router registers its worker in the background: wait for a generate.
        wait_ready(child, port, "POST", "/generate", probe_body)
        return child, port
    sock = listening_socket()
    port = sock.getsockname()[1]
    argv = [sys.executable, *python_args(hop, sim_port, sock.fileno(), log_dir)]
    if hop.startswith(BASELINE):
        # PYTHONSAFEPATH: -m would put the working directory (this
        # checkout, when run from its root) before PYTHONPATH.
        argv = ["env", f"PYTHONPATH={baseline_path(baseline)}", "PYTHONSAFEPATH=1", *argv]
    child = Child(f"asgi-generate-{hop}", argv, cpus, log_dir, pass_fds=(sock.fileno(),))
    sock.close()
    stack.callback(child.stop)
    wait_ready(child, port, "GET", "/health")
    return child, port


def baseline_path(baseline: pathlib.Path) -> str:
    """``PYTHONPATH`` for a ``baseline-*`` hop: the checkout, then its codec
    distributions (``codecs/*``), so that the engines the entry points name
    are imported from the checkout too, not from this one's editable
    installs, whose code may need what the baseline's core lacks."""
    codecs = sorted(str(d) for d in (baseline / "codecs").glob("*") if d.is_dir())
    return os.pathsep.join([str(baseline), *codecs])


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def print_report(results: list[HopResult], args: argparse.Namespace, context: list[str]) -> None:
    """Print the Markdown tables and ratios."""
    direct = results[0]
    hops = results[1:]
    router = next((r for r in hops if r.label == HOPS["router"]), None)
    floors = {r.label: r for r in hops if r.label.startswith("floor")}
    ours = [r for r in hops if r is not router and r.label not in floors]

    print("\n".join(f"- {line}" for line in context))
    print()
    print(f"Throughput at {args.concurrency} connections, {args.seconds} s per cell "
          "(busy = cores' worth of CPU used during the run; others = CPU that processes "
          "not started by the benchmark took from the pinned cores):")
    print()
    print("| path | unary req/s | SSE events/s | SSE req/s | hop CPU ms/req unary / SSE "
          "| hop busy unary / SSE | sim busy unary / SSE | wrk busy unary / SSE | others unary / SSE |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        u, s = r.load["unary"], r.load["sse"]
        hop_cpu = "-" if r is direct else f"{_fmt(u.cpu_ms_per_request('hop'), 3)} / {_fmt(s.cpu_ms_per_request('hop'))}"
        hop_busy = "-" if r is direct else f"{u.busy('hop'):.2f} / {s.busy('hop'):.2f}"
        print(f"| {r.label} | {_fmt(u.rps)} | {_fmt(s.eps)} | {_fmt(s.rps)} | {hop_cpu} | {hop_busy} "
              f"| {u.busy('sim'):.2f} / {s.busy('sim'):.2f} | {u.busy('wrk'):.2f} / {s.busy('wrk'):.2f} "
              f"| {u.others_busy():.2f} / {s.others_busy():.2f} |")
    print()
    print(f"Latency per request at 1 connection, {args.latency_seconds} s per cell, ms "
          "(added = minus the direct figure):")
    print()
    print("| path | unary p50 | unary p99 | SSE p50 | SSE p99 | added unary p50 / p99 | added SSE p50 / p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        u, s = r.latency["unary"], r.latency["sse"]
        du, ds = direct.latency["unary"], direct.latency["sse"]
        added_u = "-" if r is direct else f"{u.p50_ms - du.p50_ms:+.3f} / {u.p99_ms - du.p99_ms:+.3f}"
        added_s = "-" if r is direct else f"{s.p50_ms - ds.p50_ms:+.2f} / {s.p99_ms - ds.p99_ms:+.2f}"
        print(f"| {r.label} | {u.p50_ms:.3f} | {u.p99_ms:.3f} | {s.p50_ms:.2f} | {s.p99_ms:.2f} "
              f"| {added_u} | {added_s} |")
    print()
    print("Ratios (added latency: ours over the router's; 0 = ours added nothing measurable, "
          "n/a = the router added nothing measurable):")
    print()
    print("| path | through/direct unary | through/direct SSE | ours/router unary | ours/router SSE "
          "| added latency ours/router unary p50 / p99 | SSE p50 / p99 | CPU per request ours/router unary / SSE |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")

    def added(r: HopResult, wl: str, pct: str) -> float:
        return getattr(r.latency[wl], pct) - getattr(direct.latency[wl], pct)

    for r in [*ours, *([router] if router else [])]:
        cells = [_fmt(_ratio(r.load[wl].rps if wl == "unary" else r.load[wl].eps,
                             direct.load[wl].rps if wl == "unary" else direct.load[wl].eps))
                 for wl in ("unary", "sse")]
        if router is None or r is router:
            cells += ["-"] * 5
        else:
            cells.append(_fmt(_ratio(r.load["unary"].rps, router.load["unary"].rps)))
            cells.append(_fmt(_ratio(r.load["sse"].eps, router.load["sse"].eps)))
            for wl in ("unary", "sse"):
                cells.append(" / ".join(
                    "0" if added(r, wl, p) <= 0 else _fmt(_ratio(added(r, wl, p), added(router, wl, p)))
                    for p in ("p50_ms", "p99_ms")))
            cells.append(" / ".join(
                _fmt(_ratio(r.load[wl].cpu_ms_per_request("hop"), router.load[wl].cpu_ms_per_request("hop")))
                for wl in ("unary", "sse")))
        print(f"| {r.label} | " + " | ".join(cells) + " |")
    print()
    if floors:
        print_floor(ours, floors, router)

    checked = sum(lr.ok + lr.bad for r in results for lr in [*r.load.values(), *r.latency.values()])
    bad = [(r.label, name, lr) for r in results for name, lr in [*r.load.items(), *r.latency.items()]
           if lr.bad or lr.errors]
    samples = sum(r.samples for r in results)
    problems = [(r.label, p) for r in results for p in r.sample_problems]
    through = [_ratio(r.load["unary"].rps, direct.load["unary"].rps) for r in ours]
    through += [_ratio(r.load["sse"].eps, direct.load["sse"].eps) for r in ours]
    through = [t for t in through if t is not None]
    print("Goals:")
    print()
    noise = max(lr.others_busy() for r in results for lr in [*r.load.values(), *r.latency.values()])
    if noise > NOISE_CORES:
        print(f"- NOISY RUN: other processes took up to {noise:.2f} cores' worth of the pinned cores "
              "in a cell; rerun on a quiet machine before trusting these figures")
    if through:
        print(f"- through/direct above 0.5 on one core each: lowest {_fmt(min(through))} "
              f"-> {'met' if min(through) > 0.5 else 'NOT met'}")
    if router is not None and ours:
        vs_router = [_ratio(r.load["unary"].rps, router.load["unary"].rps) for r in ours]
        vs_router += [_ratio(r.load["sse"].eps, router.load["sse"].eps) for r in ours]
        worst = min((v for v in vs_router if v is not None), default=None)
        print(f"- throughput within 2x of sglang-router: lowest ours/router {_fmt(worst)} "
              f"-> {'met' if worst is not None and worst >= 0.5 else 'NOT met'}")
    if router is not None:  # the hop-CPU goal: ours within 2.5x (unary) and 1.5x (SSE) of the router
        for r in ours:
            cpu = [_ratio(r.load[wl].cpu_ms_per_request("hop"), router.load[wl].cpu_ms_per_request("hop"))
                   for wl in ("unary", "sse")]
            met = cpu[0] is not None and cpu[0] <= 2.5 and cpu[1] is not None and cpu[1] <= 1.5
            print(f"- {r.label}: hop CPU per request ours/router at most 2.5 unary, 1.5 SSE: "
                  f"{_fmt(cpu[0])} / {_fmt(cpu[1])} -> {'met' if met else 'NOT met'}")
    by_label = {r.label: r for r in ours}
    trio = by_label.get(HOPS["trio"])
    for other in ("asyncio", "uvloop"):
        base = by_label.get(HOPS[other])
        if trio is not None and base is not None:
            cpu = [_ratio(trio.load[wl].cpu_ms_per_request("hop"), base.load[wl].cpu_ms_per_request("hop"))
                   for wl in ("unary", "sse")]
            met = all(c is not None and c <= 1.2 for c in cpu)
            print(f"- trio CPU per request at most 1.2x {other}'s: {_fmt(cpu[0])} unary / {_fmt(cpu[1])} SSE "
                  f"-> {'met' if met else 'NOT met'}")
    for r in ours:
        floor = floors.get(HOPS[FLOOR + next(k for k, v in HOPS.items() if v == r.label).removeprefix(BASELINE)])
        if floor is None:
            continue
        unary, sse, paced = ours_over_floor(r, floor)
        print(f"- {r.label}: ours (hop - floor) at most 1.5x the floor unary, 0.8x SSE: unary {_fmt(unary)} "
              f"against the saturated floor, {_fmt(paced)} with both at {args.paced_rate:,} requests/s; "
              f"SSE {_fmt(sse)} -> unary {'met' if paced is not None and paced <= 1.5 else 'NOT met'} "
              f"at the same rate, SSE {'met' if sse is not None and sse <= 0.8 else 'NOT met'}")
    for r in ours:
        extra = added(r, "unary", "p50_ms")
        print(f"- {r.label}: added unary p50 at most +0.3 ms: {extra:+.3f} ms -> {'met' if extra <= 0.3 else 'NOT met'}")
    print(f"- never loses or reorders an event: {checked:,} responses checked under load "
          f"(count, order, final output_ids), {samples} sampled answers compared event for event "
          f"with the direct answer -> {'met' if not bad and not problems else 'NOT met'}")
    for label, name, lr in bad:
        print(f"  - {label} {name}: {lr.bad} bad responses ({lr.first_bad or 'n/a'}), {lr.errors} wrk errors")
    for label, problem in problems:
        print(f"  - {label}: {problem}")


def ours_over_floor(hop: HopResult, floor: HopResult) -> tuple[float | None, float | None, float | None]:
    """Ours (the hop's CPU per request minus its floor's) over the floor's,
    for the saturated unary and SSE cells and the paced unary cell (``None``
    where either lacks it)."""
    def share(h: LoadResult | None, f: LoadResult | None) -> float | None:
        if h is None or f is None:
            return None
        base = f.cpu_ms_per_request("hop")
        return _ratio(h.cpu_ms_per_request("hop") - base, base)

    return share(hop.load["unary"], floor.load["unary"]), share(hop.load["sse"], floor.load["sse"]), \
        share(hop.paced, floor.paced)


def print_floor(ours: list[HopResult], floors: dict[str, HopResult], router: HopResult | None) -> None:
    """hypercorn alone (the floor) against each hop of its worker class:
    what is hypercorn's and what is ours, in CPU ms per request."""
    print("hypercorn alone (floor: a fixed answer, no engine) and what is ours "
          "(hop CPU ms/req minus its worker class's floor):")
    print()
    print("| worker class | floor CPU ms/req unary / SSE | hop CPU ms/req unary / SSE "
          "| ours = hop - floor, unary / SSE | ours/floor unary / SSE | floor/router unary / SSE "
          "| paced unary: floor / hop / ours (ms/req) | paced ours/floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for key in ("trio", "asyncio", "uvloop", *(BASELINE + k for k in ("trio", "asyncio", "uvloop"))):
        floor = floors.get(HOPS[FLOOR + key.removeprefix(BASELINE)])
        hop = next((r for r in ours if r.label == HOPS[key]), None)
        if floor is None or (hop is None and key.startswith(BASELINE)):
            continue
        f = [floor.load[wl].cpu_ms_per_request("hop") for wl in ("unary", "sse")]
        h = [hop.load[wl].cpu_ms_per_request("hop") for wl in ("unary", "sse")] if hop else [None, None]
        mine = [None if a is None else a - b for a, b in zip(h, f)]
        vs = [_ratio(a, router.load[wl].cpu_ms_per_request("hop")) if router else None
              for a, wl in zip(f, ("unary", "sse"))]
        share = ours_over_floor(hop, floor) if hop else (None, None, None)
        paced = "n/a / n/a / n/a"
        if floor.paced is not None and hop is not None and hop.paced is not None:
            pf, ph = floor.paced.cpu_ms_per_request("hop"), hop.paced.cpu_ms_per_request("hop")
            paced = f"{_fmt(pf, 3)} / {_fmt(ph, 3)} / {_fmt(ph - pf, 3)}"
        print(f"| {key} | {_fmt(f[0], 3)} / {_fmt(f[1])} | {_fmt(h[0], 3)} / {_fmt(h[1])} "
              f"| {_fmt(mine[0], 3)} / {_fmt(mine[1])} | {_fmt(share[0])} / {_fmt(share[1])} "
              f"| {_fmt(vs[0])} / {_fmt(vs[1])} | {paced} | {_fmt(share[2])} |")
    print()


def median_result(runs: list[HopResult]) -> HopResult:
    """One hop's repetitions folded: per workload, the load cell with the
    median hop CPU per request and the latency cell with the median p50."""
    def pick(cells: list[LoadResult], key: Callable[[LoadResult], float]) -> LoadResult:
        return sorted(cells, key=key)[len(cells) // 2]

    out = HopResult(runs[0].label, samples=sum(r.samples for r in runs),
                    sample_problems=[p for r in runs for p in r.sample_problems])
    for wl in runs[0].load:
        out.load[wl] = pick([r.load[wl] for r in runs], lambda lr: lr.cpu_ms_per_request("hop"))
        out.latency[wl] = pick([r.latency[wl] for r in runs], lambda lr: lr.p50_ms)
    if runs[0].paced is not None:
        out.paced = pick([r.paced for r in runs], lambda lr: lr.cpu_ms_per_request("hop"))
    return out


def print_spread(reps: dict[str, list[HopResult]], args: argparse.Namespace) -> None:
    """Per repetition: each hop's CPU per request and added unary p50, and
    ours/router CPU per request, so the spread shows next to the medians."""
    print(f"Spread over {args.reps} interleaved repetitions (per repetition, in order; others = cores' "
          "worth of the pinned cores that other processes took, unary / SSE):")
    print()
    print("| path | hop CPU ms/req unary | hop CPU ms/req SSE | paced unary hop CPU ms/req | unary p50 ms "
          "| ours/router CPU unary | ours/router CPU SSE | others unary / SSE |")
    print("|---|---|---|---|---|---|---|---|")
    router = reps.get("router")
    for hop, runs in reps.items():
        def per(f: Callable[[HopResult], float | None], digits: int = 3) -> str:
            return ", ".join(_fmt(f(r), digits) for r in runs)

        vs = ["-", "-"]
        if router is not None and hop != "router":
            vs = [", ".join(_fmt(_ratio(r.load[wl].cpu_ms_per_request("hop"),
                                        q.load[wl].cpu_ms_per_request("hop")))
                            for r, q in zip(runs, router)) for wl in ("unary", "sse")]
        others = ", ".join(f"{r.load['unary'].others_busy():.2f} / {r.load['sse'].others_busy():.2f}" for r in runs)
        print(f"| {HOPS[hop]} | {per(lambda r: r.load['unary'].cpu_ms_per_request('hop'))} "
              f"| {per(lambda r: r.load['sse'].cpu_ms_per_request('hop'))} "
              f"| {per(lambda r: r.paced.cpu_ms_per_request('hop') if r.paced else None)} "
              f"| {per(lambda r: r.latency['unary'].p50_ms)} | {vs[0]} | {vs[1]} | {others} |")
    print()


def measure(
    label: str,
    port: int,
    meters: dict,
    args: argparse.Namespace,
    wrk: str,
    scripts: dict[str, pathlib.Path],
    log_dir: pathlib.Path,
    samples: tuple[list[bytes], list[list]],
    paced: pathlib.Path | None = None,
) -> HopResult:
    """Check a sample, then run every workload's load and latency cells
    against ``port``, and the ``paced`` unary script's cell when given."""
    result = HopResult(label)
    bodies, expected = samples if not label.startswith("floor") else ([], [])
    result.samples = len(bodies)
    result.sample_problems = compare(port, bodies, expected, min(len(bodies), args.concurrency)) if bodies else []
    loadgen = {args.loadgen_cpu} if args.loadgen_cpu is not None else None
    cores = {c for c in (args.sim_cpu, args.hop_cpu, args.loadgen_cpu) if c is not None} or os.sched_getaffinity(0)
    cell_meters = {**meters, "cores": lambda: cpus_busy_seconds(cores)}

    def cell(script: pathlib.Path, connections: int, seconds: int) -> LoadResult:
        measured = run_wrk(wrk, script, port, connections, seconds, loadgen, log_dir, cell_meters)
        settle(meters)
        return measured

    for name, script in scripts.items():
        print(f"  {label}: {name} warm-up, then {args.seconds} s at {args.concurrency} connections",
              file=sys.stderr)
        cell(script, args.concurrency, args.warmup)
        result.load[name] = cell(script, args.concurrency, args.seconds)
    if paced is not None:
        print(f"  {label}: unary paced at {args.paced_rate:,} requests/s, warm-up, then {args.seconds} s",
              file=sys.stderr)
        cell(paced, args.concurrency, args.warmup)
        result.paced = cell(paced, args.concurrency, args.seconds)
    for name, script in scripts.items():
        print(f"  {label}: {name} latency, {args.latency_seconds} s at 1 connection", file=sys.stderr)
        result.latency[name] = cell(script, 1, args.latency_seconds)
    return result


def settle(meters: dict[str, Callable[[], float]], timeout: float = 30.0) -> None:
    """Wait until every metered process is idle (under 10% of a core over
    0.2 s): requests wrk abandoned at the end of a run are still being
    generated, and must not spill into the next cell."""
    deadline = time.monotonic() + timeout
    last = {label: meter() for label, meter in meters.items()}
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = {label: meter() for label, meter in meters.items()}
        if all(now[label] - last[label] < 0.02 for label in now):
            return
        last = now


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seconds", type=int, default=10, help="measured seconds per throughput cell")
    p.add_argument("--latency-seconds", type=int, default=5, help="measured seconds per latency cell")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured seconds before each throughput cell")
    p.add_argument("--concurrency", type=int, default=32, help="wrk keep-alive connections for throughput")
    p.add_argument("--reps", type=int, default=1,
                   help="interleaved repetitions of every hop's cells (medians reported, spread listed)")
    p.add_argument("--hops", default="trio,asyncio,uvloop,router,floor-trio,floor-asyncio,floor-uvloop",
                   help="comma-separated hops to measure besides direct: trio, asyncio, uvloop, router, "
                        "floor-trio, floor-asyncio, floor-uvloop, baseline-trio, baseline-asyncio, "
                        "baseline-uvloop (with --baseline)")
    p.add_argument("--baseline", type=pathlib.Path, default=None,
                   help="a checkout of the repository (e.g. from git worktree add or git archive) that the "
                        "baseline-trio, baseline-asyncio and baseline-uvloop hops run, first on PYTHONPATH "
                        "(its C extension built in place): before and after side by side")
    p.add_argument("--paced-rate", type=int, default=1000,
                   help="requests/s of the paced unary cell, every hop at the same arrival rate (0: none)")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--unary-tokens", type=int, default=16, help="output tokens of a unary request")
    p.add_argument("--sse-tokens", type=int, default=256, help="output tokens (= events) of an SSE request")
    p.add_argument("--samples", type=int, default=8,
                   help="prompts per workload compared event for event with the direct answer, per hop")
    p.add_argument("--sim-cpu", type=int, default=cpus[0] if pinned else None, help="CPU for the simulator")
    p.add_argument("--hop-cpu", type=int, default=cpus[1] if pinned else None,
                   help="CPU for the frontend or router")
    p.add_argument("--loadgen-cpu", type=int, default=cpus[1] if pinned else None,
                   help="CPU for wrk (default: the hop's, so the hop pays for the load generator, "
                        "and the direct run does not)")
    p.add_argument("--router-venv", type=pathlib.Path, default=HERE / ".venv-router",
                   help="virtual environment for sglang-router (created on first use)")
    return p


def _context(args: argparse.Namespace, wrk: str, router_version: str | None, load_before: float) -> list[str]:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.machine())
    wrk_version = subprocess.run([wrk, "-v"], capture_output=True, text=True).stdout.split(" Copyright")[0]
    lines = [
        f"bench_frontend.py, {datetime.datetime.now().isoformat(timespec='seconds')}: "
        f"{os.cpu_count()} x {model}; 1-min load average {load_before:.2f} before the run "
        f"(nothing of ours running), {os.getloadavg()[0]:.2f} at the end.",
        f"Pinning: simulator on CPU {args.sim_cpu}, frontend/router on CPU {args.hop_cpu}, "
        f"wrk on CPU {args.loadgen_cpu} (one thread, keep-alive).",
        f"Requests: {args.input_len}-token input_ids, ignore_eos; unary {args.unary_tokens} output tokens, "
        f"SSE {args.sse_tokens} output tokens (= events, cumulative chunks); simulator TTFT = ITL = 0.",
        f"Versions: Python {platform.python_version()}, asgi-generate {version('asgi-generate')}, "
        f"hypercorn {version('hypercorn')}, sglang-router {router_version or 'not run'} "
        f"(--policy round_robin --log-level warn), {wrk_version.strip()}.",
    ]
    if load_before > BUSY_LOAD:
        lines.append(f"WARNING: the machine was busy before the run (load {load_before:.2f}): "
                     "other processes shared the pinned cores, so these figures are noisy.")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every answer checked out, 1 otherwise."""
    args = build_parser().parse_args(argv)
    try:
        hops = parse_hops(args.hops, HOPS, args.baseline)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    wrk = wrk_path()
    if wrk is None:
        print(f"bench_frontend.py needs wrk on PATH; install it ({WRK_INSTALL}) and run it again", file=sys.stderr)
        return 2
    router_python, router_version = ensure_router(args.router_venv) if "router" in hops else (None, None)
    sim_cpus = {args.sim_cpu} if args.sim_cpu is not None else None
    hop_cpus = {args.hop_cpu} if args.hop_cpu is not None else None
    logs = LogDir("asgi-generate-bench-")
    log_dir = logs.path
    workloads = [Workload("unary", False, args.unary_tokens), Workload("sse", True, args.sse_tokens)]
    results: list[HopResult] = []
    with logs:
        with contextlib.ExitStack() as stack:
            sim_port, sim = start_sim(stack, sim_cpus, log_dir)
            scripts: dict[str, pathlib.Path] = {}
            bodies: list[bytes] = []
            expected: list[list] = []
            for wl in workloads:
                events = answer(sim_port, request_body(args.input_len, wl.tokens, wl.stream, 0))
                check_direct(events, wl.tokens, wl.stream)
                final = events[0] if not wl.stream else events[-2]
                # The floor hops answer the simulator's own bytes.
                raw = http_request(sim_port, "POST", "/generate",
                                   request_body(args.input_len, wl.tokens, wl.stream, 0))[1]
                (log_dir / ("sse.txt" if wl.stream else "unary.json")).write_bytes(raw)
                scripts[wl.name] = log_dir / f"{wl.name}.lua"
                write_script(scripts[wl.name], request_body(args.input_len, wl.tokens, wl.stream, 0),
                             wl.stream, wl.tokens, final["output_ids"])
                for k in range(1, args.samples + 1):
                    body = request_body(args.input_len, wl.tokens, wl.stream, k)
                    bodies.append(body)
                    expected.append(answer(sim_port, body))
            samples = (bodies, expected)
            paced = paced_script(scripts["unary"], args.concurrency, args.paced_rate) if args.paced_rate > 0 else None
            probe = request_body(4, 1, False, 0)
            print(f"{DIRECT}:", file=sys.stderr)
            results.append(measure(DIRECT, sim_port, {"sim": sim.cpu_seconds}, args, wrk, scripts,
                                   log_dir, samples))
            started = {hop: start_hop(stack, hop, sim_port, hop_cpus, log_dir, router_python, probe, args.baseline)
                       for hop in hops}
            reps: dict[str, list[HopResult]] = {hop: [] for hop in hops}
            for rep in range(args.reps):  # interleaved: the order rotates every repetition
                for hop in hops[rep % len(hops):] + hops[:rep % len(hops)]:
                    print(f"{HOPS[hop]} (repetition {rep + 1} of {args.reps}):", file=sys.stderr)
                    child, port = started[hop]
                    meters = {"sim": sim.cpu_seconds, "hop": child.cpu_seconds}
                    reps[hop].append(measure(HOPS[hop], port, meters, args, wrk, scripts, log_dir, samples, paced))
            results += [median_result(reps[hop]) for hop in hops]
        print_report(results, args, _context(args, wrk, router_version, load_before))
        if args.reps > 1:
            print_spread(reps, args)
        results += [r for hop in hops for r in reps[hop]]
        logs.ok = all(not r.sample_problems and all(lr.bad == 0 and lr.errors == 0
                                                   for lr in [*r.load.values(), *r.latency.values()])
                      for r in results)
    return 0 if logs.ok else 1


if __name__ == "__main__":
    run_main(main)
