"""What a frontend costs as its fleet grows: 4, 64 and 256 simulated SGLang
workers (one ``asgi-generate sim --workers N`` process, publishing KV
events), one ``serve`` process in front of them per routing policy.

For each fleet size and policy, side by side in one run:

- **idle**: the frontend's CPU per second and the requests per second it
  sends to the engines (health probes, fleet-state reads, load readings,
  info reads: counted by route on the simulated workers' own
  ``/sim/stats`` ``requests``), over ``--idle-seconds`` with no client;
- **busy**: a fixed unary workload (``--requests`` requests of 64 prompt
  tokens, 32 prompt prefixes shared among them, ``max_new_tokens`` 4, at
  ``--concurrency`` keep-alive connections): the frontend's CPU per request
  (``raw``), the same less its idle CPU per second over the busy seconds
  (``net``: what the requests cost, the background taken out), and the
  requests per second it sent the engines other than the generate requests;
- the frontend's RSS after the busy phase, its threads and open files (the
  KV-event subscribers: a ZMQ socket per worker for ``kv-aware``).

Routing CPU per request is measured from outside: ``net`` at N workers
minus ``net`` at 4 is what N workers add to a request (the ratio table);
and in process, first: ``Router.pick`` over N healthy workers
(``time.process_time`` over ``--picks`` calls), with idle workers and no
key, with every worker busy and no key, and keyed under cache-aware
(:func:`pick_us`; ``--picks-only`` prints these alone, in a few seconds).
bench_kv_routing_cpu.py ``--workers N`` times the cache-aware and kv-aware
policies' own choice in process.
The simulator process is pinned to CPU 0 with this benchmark's client, the
frontend to CPU 1. ``--profile``: the frontend of the largest fleet runs
under cProfile (bench/_profiled.py) over its idle and busy phases, and
its top functions are printed.

Usage: ``.venv/bin/python bench/bench_fleet_size.py [--sizes 4,64,256]
[--policies least-outstanding,cache-aware,kv-aware] [--idle-seconds 8]
[--requests 1500] [--concurrency 8] [--worker-class asyncio]``
(about 5 minutes with the defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import os
import pathlib
import signal
import sys
import time

import httpx
import orjson

from asgi_generate.config import Settings

from _procs import Child, LogDir, listening_socket, run_main, wait_ready

KV_EVENTS = '{"publisher": "zmq", "endpoint": "tcp://*:0"}'
#: The requests this benchmark makes itself (not the frontend's).
OURS = ("GET /sim/stats",)
GENERATE = "POST /generate"
OUTPUT_TOKENS = 4


def load() -> str:
    return open("/proc/loadavg").read().split()[0]


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """The process's CPU time, every thread's (``/proc/PID/task/*/schedstat``:
    nanoseconds, where ``/proc/PID/stat``'s ticks are 10 ms, too coarse for
    an idle process over a few seconds); threads that ended are not counted."""
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def threads(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def start_fleet(stack: contextlib.ExitStack, logs: LogDir, n: int) -> tuple[Child, list[str]]:
    urls_file = logs.path / f"urls-{n}"
    child = Child(f"sim-{n}", [sys.executable, "-m", "asgi_generate", "sim", "--workers", str(n), "--port", "0",
                               "--urls-file", str(urls_file), "--kv-events-config", KV_EVENTS],
                  {0}, logs.path)
    stack.callback(child.stop)
    deadline = time.monotonic() + 60
    while not urls_file.exists():
        child.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the simulator wrote no URLs:\n{child.tail()}")
        time.sleep(0.05)
    urls = urls_file.read_text().split()
    for url in urls:
        wait_ready(child, int(url.rsplit(":", 1)[1]), "GET", "/health")
    return child, urls


def sims_requests(pool: concurrent.futures.Executor, urls: list[str]) -> tuple[dict[str, int], float]:
    """Every worker's requests by route, summed (this benchmark's own left
    out), and the middle of the time it took to read them (monotonic)."""
    start = time.monotonic()
    total: dict[str, int] = {}
    for stats in pool.map(lambda u: httpx.get(u + "/sim/stats", timeout=30).json()["requests"], urls):
        for key, count in stats.items():
            if key not in OURS:
                total[key] = total.get(key, 0) + count
    return total, (start + time.monotonic()) / 2


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def start_frontend(stack: contextlib.ExitStack, logs: LogDir, urls: list[str], policy: str, worker_class: str,
                   profile: pathlib.Path | None) -> tuple[Child, int]:
    sock = listening_socket()
    port = sock.getsockname()[1]
    serve = ["serve", "--worker-class", worker_class, "--policy", policy, "--log-level", "warning",
             "--no-access-log", "--fd", str(sock.fileno()), *(f"--worker=sglang={u}" for u in urls)]
    head = [sys.executable, *([str(pathlib.Path(__file__).with_name("_profiled.py"))] if profile else []),
            "-m", "asgi_generate"]
    if profile:
        os.environ["PROFILED_OUT"] = str(profile)
    child = Child(f"frontend-{len(urls)}-{policy}", [*head, *serve], {1}, logs.path, pass_fds=(sock.fileno(),))
    sock.close()
    stack.callback(child.stop)
    wait_ready(child, port, "GET", "/health")
    return child, port


async def unary_load(port: int, requests: int, concurrency: int) -> None:
    """``requests`` unary generate requests over ``concurrency`` keep-alive
    connections, each answer checked (200, :data:`OUTPUT_TOKENS` tokens)."""
    todo = iter(range(requests))

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in todo:
                prompt = [100 + i % 32] * 48 + [1000 + (i * 7 + j) % 3000 for j in range(16)]
                body = orjson.dumps({"input_ids": prompt, "sampling_params": {
                    "max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True}})
                writer.write(b"POST /generate HTTP/1.1\r\nhost: b\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                head = (await reader.readuntil(b"\r\n\r\n")).lower()
                if not head.startswith(b"http/1.1 200"):
                    raise RuntimeError(f"bad answer: {head[:200]!r}")
                length = int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
                answer = orjson.loads(await reader.readexactly(length))
                if len(answer["output_ids"]) != OUTPUT_TOKENS:
                    raise RuntimeError(f"bad answer: {answer!r}")
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(concurrency)))


def cell(stack: contextlib.ExitStack, logs: LogDir, pool, urls: list[str], policy: str, args,
         profile: pathlib.Path | None) -> dict:
    fe, port = start_frontend(stack, logs, urls, policy, args.worker_class, profile)
    # Settled: every worker probed once, the KV subscribers connected.
    deadline = time.monotonic() + 60
    while True:
        fe.check_alive()
        per_worker = [httpx.get(u + "/sim/stats", timeout=30).json()["requests"].get("GET /health", 0) for u in urls]
        if min(per_worker) >= 1:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the frontend did not probe every worker:\n{fe.tail()}")
        time.sleep(0.2)
    time.sleep(1.0)
    out = {"workers": len(urls), "policy": policy, "load_before": load()}
    if profile:  # the idle and the busy phase (bench/_profiled.py)
        os.kill(fe.pid, signal.SIGUSR1)
    (r0, m0), c0, t0 = sims_requests(pool, urls), cpu_seconds(fe.pid), time.monotonic()
    time.sleep(args.idle_seconds)
    c1, t1 = cpu_seconds(fe.pid), time.monotonic()
    r1, m1 = sims_requests(pool, urls)
    out["idle_cpu_ms_s"] = (c1 - c0) / (t1 - t0) * 1000
    out["idle_routes"] = {k: v / (m1 - m0) for k, v in delta(r1, r0).items()}
    out["idle_s"] = m1 - m0
    out["idle_req_s"] = sum(out["idle_routes"].values())
    c0, t0 = cpu_seconds(fe.pid), time.monotonic()
    asyncio.run(unary_load(port, args.requests, args.concurrency))
    c1, t1 = cpu_seconds(fe.pid), time.monotonic()
    r2, m2 = sims_requests(pool, urls)
    busy_s = t1 - t0
    busy = delta(r2, r1)
    if busy.get(GENERATE, 0) != args.requests:
        raise RuntimeError(f"the engines got {busy.get(GENERATE, 0)} generate requests, not {args.requests}")
    out["busy_s"] = busy_s
    out["req_s"] = args.requests / busy_s
    out["raw_ms_req"] = (c1 - c0) / args.requests * 1000
    out["net_ms_req"] = ((c1 - c0) - out["idle_cpu_ms_s"] / 1000 * busy_s) / args.requests * 1000
    busy.pop(GENERATE)
    # From the middle of the idle phase's last read to the middle of this
    # one: the busy phase and the reads around it.
    out["busy_routes"] = {k: v / (m2 - m1) for k, v in busy.items()}
    out["busy_s"] = m2 - m1
    out["busy_req_s"] = sum(out["busy_routes"].values())
    out["rss_mb"] = rss_mb(fe.pid)
    out["threads"] = threads(fe.pid)
    out["fds"] = open_files(fe.pid)
    out["load_after"] = load()
    if profile:
        os.kill(fe.pid, signal.SIGUSR2)
        wait_until_file(profile)
    fe.stop()
    return out


def wait_until_file(path: pathlib.Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # written whole by now


#: What ``pick_us`` times: its fleet's load and the policy, as ``--picks-only`` lists them.
PICKS = ("idle", "busy", "cache-aware")


def pick_us(n: int, picks: int, kind: str = "idle") -> float:
    """CPU µs per ``Router.pick`` among ``n`` healthy SGLang workers (no
    connection is made), ``kind`` one of :data:`PICKS`:

    - ``idle``: one request outstanding on every third worker, no key;
    - ``busy``: every worker with 1 to 4 requests outstanding (counts
      varied, none idle), no key;
    - ``cache-aware``: the busy fleet under ``--policy cache-aware``, each
      pick keyed by one of 64 prompts of 256 token ids sharing a 128-token
      prefix, each routed once before (an affinity hit on its worker).
    """
    import random

    from asgi_generate.sdk._codec import GenerateRequest
    from asgi_generate.workers.policies.cache_aware import CacheAwarePolicy
    from asgi_generate.workers.router import Router

    policy = CacheAwarePolicy() if kind == "cache-aware" else None
    router = Router([("sglang", f"http://127.0.0.1:{20000 + i}") for i in range(n)], policy=policy)
    rng = random.Random(n)
    for i, w in enumerate(router.workers):
        w.healthy = True
        for _ in range((i % 3 != 0) if kind == "idle" else rng.randint(1, 4)):
            w.inflight.add(object())
    keys = [None]
    if policy is not None:
        system = [rng.randrange(1, 150_000) for _ in range(128)]
        keys = [router.routing_key(GenerateRequest(stream=False, input_ids=system + [
            rng.randrange(1, 150_000) for _ in range(128)]), {}) for _ in range(64)]
        for key in keys:
            router.pick("sglang", key=key)
    keys = keys * (picks // len(keys))
    start = time.process_time()
    for key in keys:
        router.pick("sglang", key=key)
    return (time.process_time() - start) / len(keys) * 1e6


def picks_table(sizes: list[int], picks: int) -> None:
    """Print :func:`pick_us` for each kind and fleet size, and each size's
    ratio to the smallest."""
    print(f"In process, CPU µs per Router.pick ({picks} picks; load {load()}):\n")
    print("| fleet | " + " | ".join(f"{n} workers" for n in sizes) + f" | {max(sizes)} / {min(sizes)} |")
    print("|---|" + "---:|" * (len(sizes) + 1))
    for kind in PICKS:
        us = {n: pick_us(n, picks, kind) for n in sizes}
        print(f"| {kind} | " + " | ".join(f"{us[n]:.2f}" for n in sizes)
              + f" | {us[max(sizes)] / us[min(sizes)]:.2f}x |", flush=True)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,64,256")
    parser.add_argument("--policies", default="least-outstanding,cache-aware,kv-aware")
    parser.add_argument("--idle-seconds", type=float, default=8.0)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--worker-class", default="asyncio")
    parser.add_argument("--picks", type=int, default=20000, help="in-process Router.pick calls per fleet size")
    parser.add_argument("--picks-only", action="store_true", help="print the in-process Router.pick figures alone")
    parser.add_argument("--profile", action="store_true",
                        help="run the largest fleet's frontends under cProfile and print their top functions")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")
    os.sched_setaffinity(0, {0})
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"# bench_fleet_size: {started:%Y-%m-%d %H:%M} UTC, load {load()}, worker class {args.worker_class}, "
          f"{args.requests} requests at {args.concurrency} connections, idle {args.idle_seconds:g} s")
    picks_table(sizes, args.picks)
    if args.picks_only:
        return 0
    rows: list[dict] = []
    sim_rss: dict[int, float] = {}
    with LogDir("bench-fleet-size-") as logs, concurrent.futures.ThreadPoolExecutor(16) as pool:
        for n in sizes:
            with contextlib.ExitStack() as stack:
                sim, urls = start_fleet(stack, logs, n)
                sim_rss[n] = rss_mb(sim.pid)
                for policy in policies:
                    profile = logs.path / f"profile-{n}-{policy}" if args.profile and n == max(sizes) else None
                    row = cell(stack, logs, pool, urls, policy, args, profile)
                    rows.append(row)
                    print(f"  {n} workers, {policy}: idle {row['idle_cpu_ms_s']:.1f} ms/s, "
                          f"{row['idle_req_s']:.0f} req/s to the engines; busy {row['net_ms_req']:.3f} ms/req net "
                          f"(load {row['load_before']}-{row['load_after']})", flush=True)
                    if profile is not None:
                        import pstats
                        print(f"\n  cProfile of the frontend ({n} workers, {policy}): the project's functions, "
                              "top 20 by cumulative time")
                        pstats.Stats(str(profile)).sort_stats("cumulative").print_stats("asgi_generate", 20)
        logs.ok = True
    print("\nSimulator RSS at start (one process): "
          + ", ".join(f"{n} workers {mb:.1f} MB" for n, mb in sim_rss.items()))
    print("\n| workers | policy | idle CPU ms/s | idle req/s to engines (per worker) | req/s | busy CPU ms/req raw / net "
          "| busy req/s to engines (per worker) | RSS MB | threads | fds | load |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        n = r["workers"]
        print(f"| {n} | {r['policy']} | {r['idle_cpu_ms_s']:.1f} | {r['idle_req_s']:.0f} ({r['idle_req_s'] / n:.2f}) "
              f"| {r['req_s']:.0f} | {r['raw_ms_req']:.3f} / {r['net_ms_req']:.3f} | {r['busy_req_s']:.0f} ({r['busy_req_s'] / n:.2f}) "
              f"| {r['rss_mb']:.1f} | {r['threads']} | {r['fds']} | {r['load_before']}-{r['load_after']} |")
    base = min(sizes)
    print(f"\nRatios against {base} workers (idle CPU, idle req/s, busy net CPU per request, RSS):\n")
    print("| policy | workers | idle CPU | idle req/s | net CPU/req | RSS |")
    print("|---|---:|---:|---:|---:|---:|")
    for policy in policies:
        b = next(r for r in rows if r["policy"] == policy and r["workers"] == base)
        for r in rows:
            if r["policy"] == policy and r["workers"] != base:
                print(f"| {policy} | {r['workers']}/{base} | {ratio(r['idle_cpu_ms_s'], b['idle_cpu_ms_s'])} "
                      f"| {ratio(r['idle_req_s'], b['idle_req_s'])} | {ratio(r['net_ms_req'], b['net_ms_req'])} "
                      f"| {ratio(r['rss_mb'], b['rss_mb'])} |")
    for phase, title in (("idle", "Idle requests"), ("busy", "Busy requests (generate left out)")):
        print(f"\n{title} per second to the engines, per worker, by route:\n")
        routes = sorted({k for r in rows for k in r[f"{phase}_routes"]})
        print("| workers | policy | " + " | ".join(routes) + " |")
        print("|---:|---|" + "---:|" * len(routes))
        for r in rows:
            n, got = r["workers"], r[f"{phase}_routes"]
            print(f"| {n} | {r['policy']} | " + " | ".join(f"{got.get(k, 0) / n:.2f}" for k in routes) + " |")
    failed = background_goals(rows)
    print(f"\nload at the end {load()}")
    return 1 if failed else 0


def bounds(policy: str, busy: bool) -> dict[str, float]:
    """Requests per second per worker each background route may take, by
    the default settings ``serve`` ran with here: health every
    ``health_interval``, pause state and weight version every
    ``fleet_state_interval``, and kv-aware's load reading every
    ``kv_load_interval`` when busy, ``kv_load_idle_interval`` when idle."""
    s = Settings()
    out = {"GET /health": 1 / s.health_interval, "GET /ready": 1 / s.fleet_state_interval,
           "GET /model_info": 1 / s.fleet_state_interval}
    if policy == "kv-aware":
        out["GET /v1/loads"] = 1 / (s.kv_load_interval if busy else s.kv_load_idle_interval)
    return out


def background_goals(rows: list[dict]) -> bool:
    """Print, per cell, each background route's requests per worker
    against its bound (:func:`bounds` over the phase's seconds, plus one:
    a turn that falls in the window's edge); return whether any route went
    past it or has no bound (a poll the settings do not declare)."""
    print("\nGoal: background requests per worker within the settings' bounds "
          "(rate x phase seconds + 1):\n")
    failed = False
    for r in rows:
        n = r["workers"]
        for phase in ("idle", "busy"):
            routes, seconds = r[f"{phase}_routes"], r[f"{phase}_s"]
            limit = bounds(r["policy"], phase == "busy")
            over = [f"{k} {v * seconds / n:.1f} in {seconds:.1f} s"
                    + (f" (bound {limit[k] * seconds + 1:.1f})" if k in limit else " (no bound)")
                    for k, v in sorted(routes.items()) if k not in limit or v * seconds / n > limit[k] * seconds + 1]
            failed |= bool(over)
            print(f"- {n} workers, {r['policy']}, {phase}: " + ("; ".join(over) + ": MISSED" if over else "met"))
    return failed


if __name__ == "__main__":
    run_main(main)
