"""Overload side by side: this frontend with ``--admission``, without it, and
sglang-router with its concurrency limit and queue, in front of simulators
playing their engines' capacity.

Each cell starts 4 simulated SGLang workers with the capacity model on
(``--max-running-requests 4``, a 1536-token KV pool, a roofline step:
4 ms + 0.15 ms per running sequence + 2 µs per prefill token: 16 sequences
for the whole fleet, small enough for a 2-core machine to overload) and one
hop in front of them, then runs one workload:

- ``grpo``: 24 GRPO groups of 8 samples (``x-group-id`` / ``x-group-size``,
  class ``rollout``, ``x-preemptible: 1``), all at once (12x the fleet), with
  an eval stream beside it (class ``eval``, one request every 100 ms);
- ``tenants``: two tenants of equal weight (``x-tenant``), one sending ten
  times the other's requests (300 and 30), all at once;
- ``agents``: 6 multi-turn agent sessions (class ``agent``, 4 turns, each
  turn's prompt the last prompt, its answer and 8 new tokens) beside a bulk
  backfill of 240 preemptible streams (class ``bulk``).

The high-priority stream (eval, agent turns) is sent by a client process of
its own, so its TTFT does not include the client work of the hundreds of
streams beside it (this client's own event-loop lag is printed too); it
also runs alone on an idle fleet through the same hop first: its TTFT there
is the reference.

Printed per cell: the high-priority TTFT p50/p99 loaded and idle; goodput
(output tokens per second of requests answered whole within their deadline,
``DEADLINE_S``, over the workload's wall time) and throughput (every
answered token); the tenants' shares of weighted tokens (prompt + 2 x output)
completed while both were backlogged, and Jain's index over them; groups
split (a member finished before another member's first token: the group
did not run as a unit); streams preempted and resumed (``/stats``) and
answers that differ from the simulator model's (every answer is checked
token for token, so a resumed stream that is not exact shows here); sheds
and how many carried ``Retry-After``; the engines' retractions and queue
peaks (``/sim/stats`` ``capacity``); with admission, its engine load
readings (those at the fast pace) and requests placed on a worker without
room of its own; the client's own event-loop lag (a TTFT measured here
includes it); and the hop's CPU per request (``/proc``), and per second with
no request (read for 2 s before the loaded run: with admission, its load
readings, whose CPU is the difference from the hop without it).

With ``--profile``, the admission hop's loaded run is also taken under
cProfile (``bench/_profiled.py``) and admission's own share of the hop's
CPU is printed from it, by part (the queue and grant of each request, its
placement by room, its release, the engines' load readings): measured in
one process, that share does not carry the run-to-run noise of the
difference between two hops' CPU (the profiler's overhead is per call, so
read it as a share, not as time).

Usage: ``.venv/bin/python bench/bench_overload.py [--workloads grpo,tenants,agents]
[--hops admission,none,router] [--profile]``. sglang-router is installed on first use
into ``bench/.venv-router`` (bench_frontend.py's helper); when it cannot be,
its cells print "not available" and why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import multiprocessing
import os
import pathlib
import pstats
import signal
import sys
import time
from dataclasses import dataclass, field

import httpx
import orjson

from _procs import Child, LogDir, free_port, listening_socket, run_main, wait_ready

HERE = pathlib.Path(__file__).resolve().parent
WORKERS = 4
SIM_ARGS = ["--ttft-ms", "0", "--itl-ms", "0", "--max-running-requests", "4", "--max-total-tokens", "1536",
            "--step-ms", "4", "--step-us-per-seq", "150", "--step-us-per-prefill-token", "2"]
FLEET_SEQUENCES = 16
ADMISSION_ARGS = ["--admission", "--admission-preemption", "--admission-worker-requests", "4",
                  "--admission-queue-depth", "4096", "--admission-queue-wait", "60"]
#: sglang-router's limit at the fleet's sequences; its token bucket refilled
#: fast enough to be a pure concurrency limit (it defaults to the limit per second).
ROUTER_ARGS = ["--max-concurrent-requests", str(FLEET_SEQUENCES), "--queue-size", "4096",
               "--queue-timeout-secs", "60", "--rate-limit-tokens-per-second", "100000"]
#: Seconds the hop's CPU is read with no request, before the loaded run.
IDLE_CPU_S = 2.0
#: Each request's deadline (``x-deadline-ms``): high-priority ones 2 s, the rest 30 s.
DEADLINE_S = {"eval": 2.0, "agent": 2.0, "rollout": 30.0, "bulk": 30.0}


@functools.lru_cache(maxsize=None)
def expected(prompt: tuple[int, ...], n: int) -> list[int]:
    """The simulator model's greedy continuation of ``prompt``, ``n`` tokens (``ignore_eos``)."""
    from asgi_generate.sim.model import version_origin
    from asgi_generate.sim.tokenizer import SimTokenizer

    model = SimTokenizer().model()
    state, out = model.fold(list(prompt), version_origin("default")), []
    while len(out) < n:
        out.append(model.step(model.sampled(state, 0)).token)
        state = model.advance(state, out[-1])
    return out


@dataclass
class Result:
    """One request's outcome, times in seconds from the workload's start."""

    cls: str
    prompt: tuple[int, ...]
    n: int
    sent: float
    status: int = 0
    retry_after: str | None = None
    first: float | None = None
    end: float = 0.0
    tokens: list[int] = field(default_factory=list)
    tenant: str = ""
    group: str = ""
    error: str = ""

    @property
    def whole(self) -> bool:
        return self.status == 200 and len(self.tokens) == self.n

    @property
    def exact(self) -> bool:
        return self.tokens == expected(self.prompt, self.n)

    @property
    def on_time(self) -> bool:
        return self.whole and self.end - self.sent <= DEADLINE_S[self.cls]


async def generate(client: httpx.AsyncClient, t0: float, cls: str, prompt: list[int], n: int,
                   headers: dict[str, str] | None = None, stream: bool = True, **tags) -> Result:
    """POST one SGLang ``/generate`` (streamed unless ``stream`` is False) and time it."""
    res = Result(cls, tuple(prompt), n, time.monotonic() - t0, **tags)
    body = {"input_ids": prompt, "stream": stream, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
    hdrs = {"content-type": "application/json", "x-priority-class": cls, "x-deadline-ms": str(int(DEADLINE_S[cls] * 1000)), **(headers or {})}
    try:
        async with client.stream("POST", "/generate", content=orjson.dumps(body), headers=hdrs) as r:
            res.status, res.retry_after = r.status_code, r.headers.get("retry-after")
            if r.status_code != 200:
                await r.aread()
            elif not stream:
                res.tokens = orjson.loads(await r.aread())["output_ids"]
            else:
                last = None
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if res.first is None:
                            res.first = time.monotonic() - t0
                        last = line
                if last is not None:
                    final = orjson.loads(last[6:])
                    if "output_ids" in final:
                        res.tokens = final["output_ids"]
                    else:  # an in-band error ends the stream
                        res.status, res.error = 599, str(final)[:200]
    except httpx.HTTPError:
        res.status = -1
    res.end = time.monotonic() - t0
    if res.first is None and res.status == 200:
        res.first = res.end
    return res


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 3900 + 50 for i in range(length)]


async def eval_stream(client, t0, until, count: int) -> list[Result]:
    """Eval requests every 100 ms: ``count`` of them, or while ``until`` (an
    event, of this process or another) is unset (at least ``count``)."""
    tasks, i = [], 0
    while i < count or (until is not None and not until.is_set()):
        tasks.append(asyncio.create_task(generate(client, t0, "eval", _prompt(10_000 + i, 16), 16)))
        i += 1
        await asyncio.sleep(0.1)
    return list(await asyncio.gather(*tasks))


async def sessions(client, t0, until, count: int) -> list[Result]:
    """``count`` agent sessions of 4 turns at once."""
    done = await asyncio.gather(*(session(client, t0, s, 4) for s in range(count)))
    return [r for s in done for r in s]


#: The high-priority streams, each run by a client process of its own
#: (:func:`apart`), so that its TTFT does not include the burst's client work.
HIGH_STREAMS = {"eval": eval_stream, "agent": sessions}


def _high_child(name: str, url: str, t0: float, count: int, until, out) -> None:
    async def main() -> list[Result]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
            out.put("ready")
            return await HIGH_STREAMS[name](client, t0, until, count)

    out.put([dataclasses.asdict(r) for r in asyncio.run(main())])


async def apart(url: str, t0: float, name: str, count: int, until=None) -> list[Result]:
    """Run the high-priority stream ``name`` in a client process of its own
    (the monotonic clock is the machine's: ``t0`` holds across processes);
    returns once it is running (await the result's second half)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_high_child, args=(name, url, t0, count, until, out), daemon=True)
    child.start()
    assert await asyncio.to_thread(out.get, True, 60) == "ready"

    async def results() -> list[Result]:
        rows = await asyncio.to_thread(out.get, True, 300)
        await asyncio.to_thread(child.join, 10)
        return [Result(**{**row, "prompt": tuple(row["prompt"])}) for row in rows]

    return asyncio.ensure_future(results())


async def grpo(client, t0, loaded: bool, url: str) -> list[Result]:
    if not loaded:
        return await (await apart(url, t0, "eval", 20))
    done = multiprocessing.get_context("spawn").Event()
    evals = await apart(url, t0, "eval", 20, done)
    await asyncio.sleep(0.2)
    burst = [generate(client, t0, "rollout", _prompt(g, 32), 48, group=f"g{g}",
                      headers={"x-group-id": f"g{g}", "x-group-size": "8", "x-preemptible": "1"})
             for g in range(24) for _ in range(8)]
    out = list(await asyncio.gather(*burst))
    done.set()
    return out + await evals


async def tenants(client, t0, loaded: bool, url: str) -> list[Result]:
    if not loaded:
        return []
    reqs = [generate(client, t0, "rollout", _prompt(20_000 + i, 16), 32, stream=False, tenant=tenant,
                     headers={"x-tenant": tenant})
            for tenant, count in (("heavy", 300), ("light", 30)) for i in range(count)]
    return list(await asyncio.gather(*reqs))


async def session(client, t0, s: int, turns: int) -> list[Result]:
    prompt, out = _prompt(30_000 + s, 24), []
    for turn in range(turns):
        res = await generate(client, t0, "agent", prompt, 16)
        out.append(res)
        prompt = prompt + (res.tokens or expected(tuple(prompt), 16)) + _prompt(31_000 + s * 10 + turn, 8)
        await asyncio.sleep(0.05)
    return out


async def agents(client, t0, loaded: bool, url: str) -> list[Result]:
    bulk = [generate(client, t0, "bulk", _prompt(40_000 + i, 32), 48, headers={"x-preemptible": "1"})
            for i in range(240)] if loaded else []
    backfill = asyncio.gather(*bulk)
    await asyncio.sleep(0.2 if loaded else 0)
    turns = await (await apart(url, t0, "agent", 6))
    return list(await backfill) + turns


WORKLOADS = {"grpo": grpo, "tenants": tenants, "agents": agents}
HIGH = {"grpo": "eval", "tenants": None, "agents": "agent"}


#: Seconds between the client's own event-loop lag samples.
LAG_TICK_S = 0.01


async def _lag(out: list[float]) -> None:
    """Sample how late this client's event loop wakes a 10 ms sleep: what
    of a TTFT measured here is the client's own (it parses every stream)."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(LAG_TICK_S)
        out.append(time.monotonic() - t - LAG_TICK_S)


async def run(url: str, workload: str, loaded: bool, lags: list[float] | None = None) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        lag = asyncio.create_task(_lag(lags if lags is not None else []))
        t0 = time.monotonic()
        results = await WORKLOADS[workload](client, t0, loaded, url)
        wall = time.monotonic() - t0
        lag.cancel()
        return results, wall


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def tenant_shares(results: list[Result]) -> tuple[dict[str, float], float]:
    """Each tenant's share of the weighted tokens (prompt + 2 x output)
    completed while both were backlogged (until the first tenant's last
    answer), and Jain's index over them."""
    by = {t: [r for r in results if r.tenant == t] for t in ("heavy", "light")}
    until = min(max(r.end for r in rs) for rs in by.values())
    work = {t: sum(len(r.prompt) + 2 * len(r.tokens) for r in rs if r.whole and r.end <= until) for t, rs in by.items()}
    total = sum(work.values()) or 1
    return {t: w / total for t, w in work.items()}, jain(list(work.values()))


def groups_split(results: list[Result]) -> tuple[int, int]:
    """(groups that did not run as a unit, groups): a member ended before
    another member's first token."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        if r.group:
            groups.setdefault(r.group, []).append(r)
    split = sum(1 for rs in groups.values()
                if min(r.end for r in rs) < max((r.first or r.end) for r in rs) or not all(r.whole for r in rs))
    return split, len(groups)


@dataclass
class Cell:
    workload: str
    hop: str
    note: str = ""
    lines: dict[str, str] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)


def start_fleet(stack: contextlib.ExitStack, logs: pathlib.Path, tag: str) -> list[str]:
    urls, sims = [], []
    for i in range(WORKERS):
        sock = listening_socket()
        port = sock.getsockname()[1]
        sim = Child(f"{tag}-sim{i}", [sys.executable, "-m", "asgi_generate", "sim", "--protocol", "sglang",
                                      "--fd", str(sock.fileno()), *SIM_ARGS], None, logs, pass_fds=(sock.fileno(),))
        sock.close()
        stack.callback(sim.stop)
        sims.append((sim, port))
        urls.append(f"http://127.0.0.1:{port}")
    for sim, port in sims:
        wait_ready(sim, port, "GET", "/health")
    return urls


#: Admission's entry points in the hop (module, function): their inclusive
#: time under cProfile is admission's CPU; none calls another.
ADMISSION_PARTS = {
    "queue and grant": [("request/handler.py", "_queue")],
    "placement by room": [("request/gate.py", "free_on")],
    "release": [("request/gate.py", "release"), ("request/gate.py", "parking"), ("request/gate.py", "done")],
    "load readings": [("request/saturation.py", "read")],
    "preemption": [("request/gate.py", "run"), ("request/gate.py", "park")],
}


def admission_share(path: pathlib.Path) -> tuple[float, dict[str, float]]:
    """Admission's share of the hop's CPU in a pstats dump, and by part."""
    stats = pstats.Stats(str(path)).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    total = sum(row[2] for row in stats.values())
    parts = {part: sum(row[3] for (file, _, name), row in stats.items()
                       if any(file.endswith(mod) and name == fn for mod, fn in where)) / total
             for part, where in ADMISSION_PARTS.items()}
    return sum(parts.values()), parts


def start_hop(stack, logs, tag: str, hop: str, urls: list[str], router_python: str | None,
              profiled: bool = False) -> tuple[Child, str]:
    if hop == "router":
        port = free_port()
        argv = [router_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--log-level", "warn", "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port()), *ROUTER_ARGS]
        child = Child(f"{tag}-router", argv, None, logs)
        stack.callback(child.stop)
        body = orjson.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
        wait_ready(child, port, "POST", "/generate", body)
        return child, f"http://127.0.0.1:{port}"
    sock = listening_socket()
    port = sock.getsockname()[1]
    runner = [sys.executable, str(HERE / "_profiled.py"), "-m"] if profiled else [sys.executable, "-m"]
    argv = [*runner, "asgi_generate", "serve", "--fd", str(sock.fileno()), "--log-level", "warning",
            *[a for u in urls for a in ("--worker", f"sglang={u}")], *(ADMISSION_ARGS if hop == "admission" else [])]
    child = Child(f"{tag}-{hop}", argv, None, logs, pass_fds=(sock.fileno(),))
    sock.close()
    stack.callback(child.stop)
    wait_ready(child, port, "GET", "/health")
    if hop == "admission":  # the room is read from every engine before the first request
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{port}/stats").json()["admission"]["saturation"]["readings"] < WORKERS:
            if time.monotonic() > deadline:
                raise RuntimeError("admission never read every engine")
            time.sleep(0.05)
    return child, f"http://127.0.0.1:{port}"


def measure(workload: str, hop: str, logs: pathlib.Path, router_python: str | None, profile: bool = False) -> Cell:
    cell = Cell(workload, hop)
    tag = f"{workload}-{hop}"
    high = HIGH[workload]
    with contextlib.ExitStack() as stack:
        urls = start_fleet(stack, logs, tag)
        child, url = start_hop(stack, logs, tag, hop, urls, router_python)
        idle = []
        if high:
            idle, _ = asyncio.run(run(url, workload, loaded=False))
        # A fresh fleet for the loaded run: the engines' peaks are their own.
        stack.close()
        urls = start_fleet(stack, logs, tag + "-loaded")
        profiled = profile and hop == "admission"
        dump = logs / f"{tag}.pstats"
        os.environ["PROFILED_OUT"] = str(dump)
        child, url = start_hop(stack, logs, tag + "-loaded", hop, urls, router_python, profiled)
        # The hop's CPU with no request (admission's load readings, health checks).
        idle0 = child.cpu_seconds()
        time.sleep(IDLE_CPU_S)
        idle_cpu = (child.cpu_seconds() - idle0) / IDLE_CPU_S
        cpu0 = child.cpu_seconds()
        lags: list[float] = []
        if profiled:
            os.kill(child.pid, signal.SIGUSR1)
        results, wall = asyncio.run(run(url, workload, loaded=True, lags=lags))
        cpu = child.cpu_seconds() - cpu0
        if profiled:
            os.kill(child.pid, signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while not dump.exists() or dump.stat().st_size == 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("the profiled hop wrote no pstats")
                time.sleep(0.05)
            time.sleep(0.5)  # the dump is written in one call; let it finish
        sims = [httpx.get(u + "/sim/stats", timeout=10).json()["capacity"] for u in urls]
        adm = httpx.get(url + "/stats", timeout=10).json().get("admission", {}) if hop != "router" else {}
        adm = adm if adm.get("enabled") else {}
    hp = [r.first - r.sent for r in results if r.cls == high and r.whole]
    hp_idle = [r.first - r.sent for r in idle if r.cls == high and r.whole]
    answered = [r for r in results if r.whole]
    shed = [r for r in results if r.status not in (200,)]
    f = cell.figures
    f["hp_p50"], f["hp_p99"] = _pct(hp, 0.5) or 0, _pct(hp, 0.99) or 0
    f["idle_p50"], f["idle_p99"] = _pct(hp_idle, 0.5) or 0, _pct(hp_idle, 0.99) or 0
    f["goodput"] = sum(len(r.tokens) for r in results if r.on_time) / wall
    f["throughput"] = sum(len(r.tokens) for r in answered) / wall
    f["cpu_per_request_ms"] = cpu / len(results) * 1000
    inexact = sum(1 for r in answered if not r.exact)
    f["inexact"] = inexact
    L = cell.lines
    errors = sorted({r.error for r in results if r.error})
    if errors:
        print(f"{tag}: in-band errors (599 here), e.g. {errors[:3]}", file=sys.stderr)
    L["requests"] = (f"{len(results)} sent, {len(answered)} answered whole, {len(shed)} not "
                     f"({sum(1 for r in shed if r.retry_after)} with Retry-After; statuses "
                     f"{sorted({r.status for r in shed})}), {wall:.1f} s")
    if high:
        n_high = sum(1 for r in results if r.cls == high)
        L[f"{high} TTFT ms p50/p99"] = (f"{_ms(f['hp_p50'])} / {_ms(f['hp_p99'])} loaded ({len(hp)} of {n_high} "
                                        f"whole) vs {_ms(f['idle_p50'])} / {_ms(f['idle_p99'])} idle: p99 "
                                        f"{f['hp_p99'] / f['idle_p99']:.1f}x" if f["idle_p99"] and hp else "-")
    if high and adm:
        row = adm["protocols"]["sglang"]["classes"].get(high, {})
        if row.get("admitted"):
            L[f"{high} mean wait in the frontend's queue ms"] = f"{row['wait_seconds_total'] / row['admitted'] * 1000:.0f}"
    L["goodput tok/s (on time)"] = f"{f['goodput']:.0f} of {f['throughput']:.0f} answered"
    if workload == "tenants":
        shares, j = tenant_shares(results)
        f["jain"] = j
        L["tenant shares (weighted tokens)"] = f"heavy {shares['heavy']:.3f}, light {shares['light']:.3f}; Jain {j:.3f}"
    if workload == "grpo":
        split, groups = groups_split(results)
        f["split"] = split
        L["groups split"] = f"{split} of {groups}"
    L["preempted / resumed"] = (f"{adm.get('preemptions', 0)} / {adm.get('resumed_parked', 0)} "
                                f"(expired {adm.get('parked_expired', 0)}); answers not exact: {inexact}"
                                if adm else f"- ; answers not exact: {inexact}")
    L["engines: retractions, peak waiting, peak running"] = (
        f"{sum(s['retractions'] for s in sims)}, {max(s['peak_waiting'] for s in sims)}, "
        f"{max(s['peak_running'] for s in sims)}")
    if adm:
        sat = adm["saturation"]
        L["admission: engine load readings (at the fast pace); placed without room"] = (
            f"{sat['readings']} ({sat.get('fast_readings', '-')}); {adm.get('placed_without_room', '-')}")
    L["client's own event-loop lag ms p50/p99"] = f"{_ms(_pct(lags, 0.5))} / {_ms(_pct(lags, 0.99))}"
    L["hop CPU per request ms"] = f"{f['cpu_per_request_ms']:.2f}"
    f["idle_cpu_ms_s"] = idle_cpu * 1000
    L["hop CPU with no request ms/s"] = f"{idle_cpu * 1000:.0f}"
    if profiled:
        share, parts = admission_share(dump)
        f["profiled_share"] = share
        L["admission's share of the hop's CPU under cProfile"] = (
            f"{share:.1%} (" + ", ".join(f"{part} {v:.1%}" for part, v in parts.items()) + ")")
    return cell


def print_cells(cells: list[Cell]) -> None:
    for workload in dict.fromkeys(c.workload for c in cells):
        row = [c for c in cells if c.workload == workload]
        print(f"\n### {workload}\n")
        print("| | " + " | ".join(c.hop for c in row) + " |")
        print("|---" * (len(row) + 1) + "|")
        keys = list(dict.fromkeys(k for c in row for k in c.lines))
        for k in keys:
            print(f"| {k} | " + " | ".join(c.note or c.lines.get(k, "-") for c in row) + " |")
    print("\n### the goals\n")
    by = {(c.workload, c.hop): c.figures for c in cells if not c.note}
    adm = by.get(("grpo", "admission"))
    if adm:
        print(f"- eval TTFT p99 under the burst / idle (admission): {adm['hp_p99'] / adm['idle_p99']:.2f} (goal <= 1.5)")
        print(f"- groups split (admission): {adm['split']:.0f} (goal 0)")
    if t := by.get(("tenants", "admission")):
        print(f"- Jain's index (admission): {t['jain']:.3f} (goal >= 0.95)")
    print("- answers not exact (any cell with admission; preempted streams included): "
          f"{sum(f['inexact'] for (w, h), f in by.items() if h == 'admission'):.0f} (goal 0)")
    for w in WORKLOADS:
        a, n = by.get((w, "admission")), by.get((w, "none"))
        if a and n and n["throughput"]:
            print(f"- {w}: goodput with admission / throughput without: {a['goodput'] / n['throughput']:.2f} "
                  f"(goal >= 0.95); CPU per request {a['cpu_per_request_ms']:.2f} ms on, "
                  f"{n['cpu_per_request_ms']:.2f} ms off: admission's share "
                  f"{max(0.0, a['cpu_per_request_ms'] - n['cpu_per_request_ms']) / a['cpu_per_request_ms']:.1%} "
                  f"(goal <= 5%); with no request {a['idle_cpu_ms_s']:.0f} ms/s on, {n['idle_cpu_ms_s']:.0f} ms/s off: "
                  f"the idle readings' CPU {max(0.0, a['idle_cpu_ms_s'] - n['idle_cpu_ms_s']):.0f} ms/s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--hops", default="admission,none,router")
    p.add_argument("--router-venv", type=pathlib.Path, default=HERE / ".venv-router")
    p.add_argument("--profile", action="store_true",
                   help="also measure admission's share of the hop's CPU under cProfile (its loaded runs)")
    args = p.parse_args()
    hops = args.hops.split(",")
    router_python, router_note = None, ""
    if "router" in hops:
        try:
            from bench_frontend import ensure_router

            router_python, router_version = ensure_router(args.router_venv)
            print(f"sglang-router {router_version}: {' '.join(ROUTER_ARGS)}")
        except Exception as exc:  # noqa: BLE001 - any install failure makes the cell unavailable
            router_note = f"not available: sglang-router could not be installed ({exc})"
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    cells = []
    with LogDir("bench-overload-") as logs:
        for workload in args.workloads.split(","):
            for hop in hops:
                if hop == "router" and router_note:
                    cells.append(Cell(workload, hop, note=router_note))
                    continue
                started = time.monotonic()
                cells.append(measure(workload, hop, logs.path, router_python, args.profile))
                print(f"{workload} / {hop}: {time.monotonic() - started:.0f} s", file=sys.stderr)
        logs.ok = True
    print_cells(cells)
    return 0


if __name__ == "__main__":
    run_main(main)
