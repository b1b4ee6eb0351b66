"""Large request bodies at once: the frontend's peak and settled RSS.

One simulated SGLang worker (context length 32768) serves an asgi-generate
frontend at its defaults (``--max-body-bytes`` 32 MiB, ``--body-budget-bytes``
sized for the machine, ``--health-interval`` 2 s), once per worker class.
After a warm-up of small requests, ``--clients`` (50) connections each send
one ``POST /generate`` of about 30 MiB at the same moment: valid JSON with
``--ids`` (6.3M) token ids, far longer than the model's context, so every
one must get SGLang's 400 and none reach the worker.

Measured per worker class, from ``/proc/<pid>/status`` of the frontend
sampled every 10 ms:

- RSS at baseline (after the warm-up), its peak while the bodies arrive and
  are decoded, and RSS after (once every answer is in, the lowest sample in
  the following ``--settle`` seconds);
- the status of every answer (any 5xx fails the run);
- whether the worker was ever seen down (``/v1/models`` polled every 100 ms
  during the run) or the simulator received a generate request;
- how long the 50 answers took.

The goals (bounded request bodies): peak below 2 GiB, RSS after within 100 MiB of the
baseline, no 5xx, worker never marked down. Exit status 1 if one is missed.

Usage: ``python bench/bench_bodies.py [--clients 50] [--ids 6300000]``.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import socket
import sys
import threading
import time

import httpx
import orjson

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support import start_frontend, start_sim  # noqa: E402

MiB = 1024 * 1024
GOAL_PEAK = 2048 * MiB
GOAL_SETTLE = 100 * MiB


def rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class Sampler(threading.Thread):
    """Samples ``pid``'s RSS every 10 ms into ``samples`` until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.monotonic(), rss(self.pid)))
            time.sleep(0.01)


def body(n_ids: int) -> bytes:
    ids = [1000 + (i * 7919) % 3000 for i in range(n_ids)]  # 4 digits: 5 bytes an id
    return orjson.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 8}})


async def upload(port: int, payload: bytes) -> int:
    """Send one request without copying ``payload`` into a buffer; the status."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    head = (b"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(payload))
    try:
        await loop.sock_sendall(sock, head)
        await loop.sock_sendall(sock, memoryview(payload))
        data = b""
        while chunk := await loop.sock_recv(sock, 65536):
            data += chunk
    finally:
        sock.close()
    return int(data.split(b" ", 2)[1])


async def watch_worker(url: str, stop: asyncio.Event, seen_down: list[str]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            for w in (await client.get(url + "/v1/models")).json()["workers"]:
                if w["state"] != "up":
                    seen_down.append(w["last_error"] or "down")
            await asyncio.sleep(0.1)


async def campaign(fe, payload: bytes, clients: int) -> tuple[list[int], float, list[str]]:
    stop = asyncio.Event()
    seen_down: list[str] = []
    watcher = asyncio.create_task(watch_worker(fe.url, stop, seen_down))
    t0 = time.monotonic()
    statuses = await asyncio.gather(*(upload(fe.port, payload) for _ in range(clients)))
    elapsed = time.monotonic() - t0
    stop.set()
    await watcher
    return list(statuses), elapsed, seen_down


def run_one(worker_class: str, sim, payload: bytes, clients: int, settle: float) -> dict:
    fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class, extra=["--health-interval", "2"])
    try:
        for _ in range(20):  # warm-up: imports, pools, allocator
            r = httpx.post(fe.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 200, r.text
        arrived = httpx.get(sim.url + "/sim/stats").json()["generate_requests"]
        time.sleep(0.5)
        baseline = rss(fe.proc.pid)
        sampler = Sampler(fe.proc.pid)
        sampler.start()
        statuses, elapsed, seen_down = asyncio.run(campaign(fe, payload, clients))
        t_done = time.monotonic()
        time.sleep(settle)
        sampler.done.set()
        sampler.join()
        peak = max(v for _, v in sampler.samples)
        after = min(v for t, v in sampler.samples if t >= t_done)
        budget = httpx.get(fe.url + "/stats").json()["body_budget"]
        reached = httpx.get(sim.url + "/sim/stats").json()["generate_requests"] - arrived
    finally:
        fe.stop()
    return {
        "worker_class": worker_class, "baseline": baseline, "peak": peak, "after": after,
        "statuses": statuses, "elapsed": elapsed, "seen_down": seen_down, "reached": reached,
        "budget": budget["capacity_bytes"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50, help="bodies sent at once (default %(default)s)")
    parser.add_argument("--ids", type=int, default=6_300_000, help="token ids per body (default %(default)s)")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds to watch RSS after the last answer (default %(default)s)")
    parser.add_argument("--worker-classes", default="asyncio,trio", help="(default %(default)s)")
    args = parser.parse_args()
    payload = body(args.ids)
    print(f"{args.clients} bodies of {len(payload) / MiB:.1f} MiB ({args.ids:,} token ids) at once\n")
    sim = start_sim("sglang")
    rows = []
    try:
        for wc in args.worker_classes.split(","):
            rows.append(run_one(wc, sim, payload, args.clients, args.settle))
    finally:
        sim.stop()
    print("| worker class | budget MiB | baseline MiB | peak MiB | after MiB | after - baseline MiB "
          "| answers | took s | worker seen down | reached the worker |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---|---:|")
    ok = True
    for r in rows:
        counts: dict[int, int] = {}
        for s in r["statuses"]:
            counts[s] = counts.get(s, 0) + 1
        answers = ", ".join(f"{n} x {s}" for s, n in sorted(counts.items()))
        print(f"| {r['worker_class']} | {r['budget'] / MiB:.0f} | {r['baseline'] / MiB:.0f} | {r['peak'] / MiB:.0f} "
              f"| {r['after'] / MiB:.0f} | {(r['after'] - r['baseline']) / MiB:+.0f} | {answers} "
              f"| {r['elapsed']:.1f} | {'yes' if r['seen_down'] else 'no'} | {r['reached']} |")
        goals = {
            "peak below 2 GiB": r["peak"] < GOAL_PEAK,
            "after within 100 MiB of baseline": r["after"] - r["baseline"] < GOAL_SETTLE,
            "no 5xx": all(s < 500 for s in r["statuses"]),
            "worker never seen down": not r["seen_down"],
            "no body reached the worker": r["reached"] == 0,
        }
        missed = [name for name, met in goals.items() if not met]
        if missed:
            ok = False
            print(f"  {r['worker_class']}: MISSED {', '.join(missed)}", file=sys.stderr)
    print("\nall goals met" if ok else "\nsome goals missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
