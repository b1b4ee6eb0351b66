"""How soon every frontend process acts on a change the engines made, and
what reading the engines costs (asgi_generate/workers/fleet_state.py).

Two SGLang and two vLLM simulators; in front of them ``serve --workers 4``,
then three ``serve`` replicas sharing them. The changes are made on the
engines themselves (as a trainer talking to them directly, or through
another replica, would): a pause (SGLang ``/pause_generation`` in place,
vLLM ``/pause?mode=keep``), a new weight version
(``/update_weight_version``), the resume; over and over, at a random moment
of the reading interval. A process acts when it logs that it learned the
change (``asgi_generate.fleet_state``: the pause begun, the resume, the
fleet's new weight version); the latency of a change is from the moment
the engines made it (all are asked at once; a fleet is paused, or at a
new version, once its first engine answered, resumed once its last one
did) to the moment the last process acted on it, the later of the two
protocols.
Prints p50 and max per kind and over all changes.

Then the frontends' CPU per second (every process, from ``/proc``), the
reading on (the default intervals) and off (``--fleet-state-interval 0``):
idle, while the fleet is paused (read every
``--fleet-state-paused-interval``), and busy (32 streams running
without end). The simulators' CPU is shown beside: the readings cost the
engines too.

Usage: ``.venv/bin/python bench/bench_fleet_state.py [--changes 100]
[--seconds 8] [--worker-class trio]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import random
import re
import statistics
import sys
import threading
import time

import httpx

from _procs import Child, LogDir, listening_socket, run_main, wait_ready

PROTOCOLS = ("sglang", "sglang", "vllm", "vllm")
LEARNED = re.compile(r"^(\S+ \S+) \[(\d+)\] WARNING asgi_generate\.fleet_state: fleet (\w+): (.*)$")
KINDS = {"pause": "the engines report a pause", "resume": "the engines report the resume",
         "version": "moved to weight version"}


def start_sims(stack: contextlib.ExitStack, logs) -> list[tuple[str, str]]:
    sims = []
    for i, protocol in enumerate(PROTOCOLS):
        sock = listening_socket()
        port = sock.getsockname()[1]
        child = Child(f"sim-{protocol}-{i}", [sys.executable, "-m", "asgi_generate", "sim", "--protocol", protocol,
                                              "--itl-ms", "20", "--fd", str(sock.fileno())], None, logs.path,
                      pass_fds=(sock.fileno(),))
        sock.close()
        stack.callback(child.stop)
        wait_ready(child, port, "GET", "/health")
        sims.append((protocol, f"http://127.0.0.1:{port}", child))
    return sims


def start_frontends(stack: contextlib.ExitStack, logs, sims, processes: int, replicas: int, worker_class: str,
                    interval: float | None, tag: str) -> list[tuple[Child, int]]:
    out = []
    for r in range(replicas):
        sock = listening_socket(reuse_port=processes > 1)
        port = sock.getsockname()[1]
        argv = [sys.executable, "-m", "asgi_generate", "serve", "--worker-class", worker_class,
                "--log-level", "warning", "--no-access-log", "--fd", str(sock.fileno()),
                *(["--workers", str(processes)] if processes > 1 else []),
                *(["--fleet-state-interval", str(interval)] if interval is not None else [])]
        for protocol, url, _ in sims:
            argv += ["--worker", f"{protocol}={url}"]
        child = Child(f"frontend-{tag}-{r}", argv, None, logs.path, pass_fds=(sock.fileno(),))
        sock.close()
        stack.callback(child.stop)
        wait_ready(child, port, "GET", "/health")
        out.append((child, port))
    return out


def _post(url: str, path: str, body: dict) -> None:
    r = httpx.post(url + path, json=body, timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"{url}{path}: {r.status_code} {r.text}")


def change(sims, kind: str, version: str) -> dict[str, list[float]]:
    """Make ``kind`` on every engine, all at once; the wall times (s) at
    which each engine of each protocol answered."""
    answered: dict[str, list[float]] = {}

    def one(protocol: str, url: str) -> None:
        if kind == "pause":
            _post(url, *(("/pause_generation", {"mode": "in_place"}) if protocol == "sglang" else ("/pause?mode=keep", {})))
        elif kind == "resume":
            _post(url, *(("/continue_generation", {}) if protocol == "sglang" else ("/resume", {})))
        else:
            _post(url, "/update_weight_version", {"new_version": version})
        answered.setdefault(protocol, []).append(time.time())

    threads = [threading.Thread(target=one, args=(protocol, url)) for protocol, url, _ in sims]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if sum(map(len, answered.values())) != len(sims):
        raise RuntimeError(f"{kind}: not every engine answered")
    return answered


def learned(frontends) -> list[tuple[float, int, str, str]]:
    """Every fleet_state line the processes logged: (wall time, pid, protocol, kind)."""
    out = []
    for child, _ in frontends:
        for line in child.tail(10_000_000).splitlines():
            m = LEARNED.match(line)
            if m is None:
                continue
            when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            kind = next((k for k, text in KINDS.items() if text in m.group(4)), None)
            if kind is not None:
                out.append((when, int(m.group(2)), m.group(3), kind))
    return out


def pids(frontends, processes: int) -> set[int]:
    """Every process of ``frontends``: asked on fresh connections until each
    frontend's ``processes`` answered (bounded)."""
    seen: set[int] = set()
    for _, port in frontends:
        mine: set[int] = set()
        for _ in range(400):
            with httpx.Client(timeout=10) as client:
                mine.add(client.get(f"http://127.0.0.1:{port}/stats").json()["pid"])
            if len(mine) == processes:
                break
        seen |= mine
    return seen


def latencies(sims, frontends, every: set[int], changes: int, interval: float) -> dict[str, list[float]]:
    """Seconds from each change on the engines to the last of ``every``
    process acting on it, by kind."""
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    kinds = ("pause", "version", "resume")
    for i in range(changes):
        kind = kinds[i % 3]
        time.sleep(random.uniform(0, interval))  # any moment of the reading interval
        start = time.time() - 0.002  # the log's times are to the millisecond
        answered = change(sims, kind, f"v{i}")
        deadline = time.monotonic() + 30
        while True:
            lines = [line for line in learned(frontends) if line[0] >= start]
            acted = {(pid, protocol) for when, pid, protocol, k in lines if k == kind}
            if all((pid, p) in acted for pid in every for p in ("sglang", "vllm")):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"change {i} ({kind}): not every process acted: {sorted(acted)}")
            time.sleep(0.02)
        # A fleet is paused, or at a new version, once one engine is; resumed once all are.
        at = {p: (max(t) if kind == "resume" else min(t)) for p, t in answered.items()}
        out[kind].append(max(when - at[protocol] for when, pid, protocol, k in lines if k == kind))
    return out


def cpu_per_second(children: list[Child], seconds: float) -> float:
    before = sum(c.cpu_seconds() for c in children)
    time.sleep(seconds)
    return (sum(c.cpu_seconds() for c in children) - before) / seconds


def streams(port: int, n: int, stop: threading.Event) -> list[threading.Thread]:
    """``n`` SGLang streams, each started anew when it ends, until ``stop``."""
    def one(i: int) -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                body = {"input_ids": [100 + i, 7, 8], "stream": True,
                        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
                with client.stream("POST", f"http://127.0.0.1:{port}/generate", json=body) as r:
                    for _ in r.iter_bytes():
                        if stop.is_set():
                            break

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def cpu_table(sims, logs, worker_class: str, seconds: float) -> list[tuple[str, str, float, float]]:
    rows = []
    for label, interval in (("on", None), ("off", 0)):
        with contextlib.ExitStack() as stack:
            fes = start_frontends(stack, logs, sims, 4, 1, worker_class, interval, f"cpu-{label}")
            (child, port), = fes
            time.sleep(2)  # started: probes and first readings done
            sim_children = [c for _, _, c in sims]
            rows.append(("idle", label, cpu_per_second([child], seconds), cpu_per_second(sim_children, seconds)))
            change(sims, "pause", "")
            time.sleep(1)
            rows.append(("paused", label, cpu_per_second([child], seconds), cpu_per_second(sim_children, seconds)))
            change(sims, "resume", "")
            stop = threading.Event()
            threads = streams(port, 32, stop)
            time.sleep(2)
            fe_cpu = cpu_per_second([child], seconds)
            rows.append(("busy (32 streams)", label, fe_cpu, cpu_per_second(sim_children, 0.5)))
            stop.set()
            for t in threads:
                t.join(30)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=100, help="changes per topology (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per CPU window (default %(default)s)")
    parser.add_argument("--worker-class", choices=("trio", "asyncio"), default="trio")
    args = parser.parse_args()
    with LogDir("bench-fleet-state-") as logs, contextlib.ExitStack() as stack:
        sims = start_sims(stack, logs)
        print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load "
              f"{open('/proc/loadavg').read().split()[0]}, worker class {args.worker_class}, reading every 1 s "
              f"(every 0.1 s while paused)\n")
        print("| frontends | change | n | p50 ms | max ms |\n|---|---|---|---|---|")
        for label, processes, replicas in (("serve --workers 4", 4, 1), ("3 replicas", 1, 3)):
            with contextlib.ExitStack() as fronts:
                fes = start_frontends(fronts, logs, sims, processes, replicas, args.worker_class, None, label[:5])
                every = pids(fes, processes)
                if len(every) != processes * replicas:
                    raise RuntimeError(f"{label}: {len(every)} processes answered")
                time.sleep(2)
                got = latencies(sims, fes, every, args.changes, 1.0)
                change(sims, "resume", "")  # the next frontends start on a running fleet
                for kind, values in got.items():
                    print(f"| {label} | {kind} | {len(values)} | {statistics.median(values) * 1000:.0f} | "
                          f"{max(values) * 1000:.0f} |")
                everything = [v for values in got.values() for v in values]
                print(f"| {label} | all | {len(everything)} | {statistics.median(everything) * 1000:.0f} | "
                      f"{max(everything) * 1000:.0f} |")
        print("\n`serve --workers 4`, CPU seconds per second (all 4 processes; the 4 simulators beside):\n")
        print("| state | reading | frontend | simulators |\n|---|---|---|---|")
        for state, label, fe, sim in cpu_table(sims, logs, args.worker_class, args.seconds):
            print(f"| {state} | {label} | {fe:.4f} | {sim:.4f} |")
        logs.ok = True
    return 0


if __name__ == "__main__":
    run_main(main)
