"""Open SSE streams: how many one frontend process holds, what each costs in
RSS, and how fast an abort storm is acknowledged.

- **Abort storm** (per engine protocol and hypercorn worker class): one
  simulator (first token at once, then a minute of silence) behind one
  frontend; ``--storm`` (5,000) SSE streams are opened from this process
  (tests/swarm.py, raw asyncio sockets) and each gets its first event; then
  all hang up at once. Measured: the time until ``/stats`` shows every abort
  answered (and how many were acknowledged), the abort HTTP requests and
  connections the frontend used, the latency of one request sent right after
  the hang-up, and whether the worker stayed up.
- **Open-stream capacity** (per worker class): ``--streams`` (10,000, or
  fewer when the hard open-file limit cannot hold two sockets per stream)
  streams held open in one frontend; measured: the frontend's RSS
  (``VmRSS``) before and with them open, as KB per stream. Then
  ``--h2-streams`` (10,000) the same way over HTTP/2 (prior knowledge, 100
  streams per client connection, tests/swarm.py's ``H2Swarm``): a client
  socket per 100 streams, so 10,000 fit where the open-file limit is
  20,000.
- **Where the memory goes** (``--profile N``, per worker class): the
  frontend runs under tracemalloc (bench/_traced.py); the allocations still
  live with N streams open, minus those before, grouped by nearest caller
  and by source line, per stream.

Usage: ``python bench/bench_streams.py [--storm 5000] [--streams 10000]
[--h2-streams 10000] [--profile 2000] [--worker-classes asyncio,trio]``;
``--storm 0``, ``--streams 0``, ``--h2-streams 0`` or ``--profile 0``
skips that part. Linux only (``/proc``).
Every process it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import platform
import resource
import signal
import sys
import tempfile
import time

import orjson

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _procs import Child, listening_socket, wait_ready  # noqa: E402
from swarm import H2Swarm, Swarm, http_get, http_post, post_bytes, raise_fd_limit  # noqa: E402

PROMPT = [11, 12, 13, 14]
#: Sockets a frontend holds besides two per stream (listener, probes, aborts, ...).
FD_MARGIN = 64
PATHS = {"sglang": "/generate", "vllm": "/inference/v1/generate"}


def body(protocol: str, max_tokens: int, stream: bool) -> dict:
    if protocol == "sglang":
        return {"input_ids": PROMPT, "stream": stream,
                "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}
    return {"token_ids": PROMPT, "stream": stream, "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}


def rss_kb(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def raise_hard_fd_limit(need: int) -> int:
    """Raise this process's open-file limits (inherited by the frontend) to
    ``need`` where allowed (``CAP_SYS_RESOURCE``, e.g. root), else the soft
    one to the hard one; return the hard limit."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
        except (ValueError, OSError):
            pass
    return raise_fd_limit()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Stack:
    """One simulator and one frontend in front of it."""

    def __init__(self, tmp: pathlib.Path, label: str, protocol: str, worker_class: str,
                 traced: pathlib.Path | None = None):
        self.protocol = protocol
        sock = listening_socket()
        self.sim_port = sock.getsockname()[1]
        self.sim = Child(f"{label}-sim-{protocol}-{worker_class}", [
            sys.executable, "-m", "asgi_generate", "sim", "--protocol", protocol, "--itl-ms", "60000",
            "--fd", str(sock.fileno())], None, tmp, (sock.fileno(),))
        sock.close()
        wait_ready(self.sim, self.sim_port, "GET", "/health")
        sock = listening_socket()
        self.port = sock.getsockname()[1]
        head = [sys.executable, str(ROOT / "bench" / "_traced.py")] if traced else [sys.executable, "-m", "asgi_generate"]
        if traced:
            os.environ["TRACED_OUT"] = str(traced)
        self.fe = Child(f"{label}-frontend-{protocol}-{worker_class}", [
            *head, "serve", "--worker-class", worker_class, "--worker", f"{protocol}=http://127.0.0.1:{self.sim_port}",
            "--log-level", "warning", "--fd", str(sock.fileno())], None, tmp, (sock.fileno(),))
        sock.close()
        wait_ready(self.fe, self.port, "GET", "/health")
        self.request = post_bytes(PATHS[protocol], body(protocol, 30_000, True))

    def stop(self) -> None:
        self.fe.stop()
        self.sim.stop()

    async def stats(self) -> dict:
        status, raw = await http_get(self.port, "/stats", timeout=60)
        assert status == 200
        return orjson.loads(raw)

    async def open(self, n: int, http2: bool = False) -> tuple[Swarm | H2Swarm, float]:
        t0 = time.monotonic()
        if http2:
            swarm = H2Swarm(self.port)
            firsts = await swarm.open(PATHS[self.protocol], body(self.protocol, 30_000, True), n, timeout=120)
        else:
            swarm = Swarm(self.port)
            firsts = await swarm.open([self.request] * n, timeout=120)
        took = time.monotonic() - t0
        bad = [f for f in firsts if b'"error"' in f]
        if bad:
            raise RuntimeError(f"{len(bad)} streams failed: {bad[0][:300]!r}")
        return swarm, took

    async def settle(self, total: int, timeout: float = 300) -> tuple[dict, float]:
        """Wait until ``total`` aborts have an answer; the stats and the time it took."""
        t0 = time.monotonic()
        while True:
            s = await self.stats()
            answered = s["aborts_acknowledged"] + s["aborts_unacknowledged"] + s["aborts_worker_lost"]
            if answered >= total or time.monotonic() - t0 > timeout:
                return s, time.monotonic() - t0
            await asyncio.sleep(0.02)


async def storm(tmp: pathlib.Path, protocol: str, worker_class: str, n: int) -> dict:
    stack = Stack(tmp, "storm", protocol, worker_class)
    try:
        swarm, opened_in = await stack.open(n)
        t0 = time.monotonic()
        swarm.close_all()
        status, _body = await http_post(stack.port, PATHS[protocol], body(protocol, 1, False), timeout=60)
        during = time.monotonic() - t0
        s, _t = await stack.settle(n)
        acked_in = time.monotonic() - t0
        _, raw = await http_get(stack.port, "/v1/models")
        states = [w["state"] for w in orjson.loads(raw)["workers"]]
        aborts = s["workers"]["w0"]["aborts"]
        return {
            "protocol": protocol, "worker_class": worker_class, "streams": n, "opened_s": opened_in,
            "acked_s": acked_in, "acked": s["aborts_acknowledged"], "unacked": s["aborts_unacknowledged"],
            "lost": s["aborts_worker_lost"], "requests": aborts["requests"], "conns": aborts["connections_opened"],
            "peak": aborts["peak_in_flight"],
            "during_status": status, "during_s": during, "worker": "/".join(states),
        }
    finally:
        stack.stop()


async def capacity(tmp: pathlib.Path, worker_class: str, n: int, http2: bool) -> dict:
    stack = Stack(tmp, "capacity", "sglang", worker_class)
    try:
        # Warm-up: the first streams pay for lazily built state (imports, pools).
        warm, _ = await stack.open(200, http2)
        warm.close_all()
        await stack.settle(200)
        await asyncio.sleep(1.0)
        base = rss_kb(stack.fe.pid)
        swarm, opened_in = await stack.open(n, http2)
        await asyncio.sleep(1.0)
        loaded = rss_kb(stack.fe.pid)
        fds = open_fds(stack.fe.pid)
        t0 = time.monotonic()
        swarm.close_all()
        s, _ = await stack.settle(200 + n)
        return {
            "worker_class": worker_class, "streams": n, "opened_s": opened_in, "base_mb": base / 1024,
            "loaded_mb": loaded / 1024, "kb_per_stream": (loaded - base) / n, "fds": fds,
            "closed_s": time.monotonic() - t0, "acked": s["aborts_acknowledged"] - 200,
        }
    finally:
        stack.stop()


async def profile(tmp: pathlib.Path, worker_class: str, n: int, http2: bool) -> list[dict]:
    out = tmp / f"traced-{worker_class}.json"
    stack = Stack(tmp, "profile", "sglang", worker_class, traced=out)
    try:
        # The baseline is taken with n/2 streams open, so what the first
        # streams build once (imports, pools, table growth) is not counted.
        half, _ = await stack.open(n // 2, http2)
        await asyncio.sleep(0.5)
        os.kill(stack.fe.pid, signal.SIGUSR2)
        await asyncio.sleep(1.0)
        swarm, _ = await stack.open(n - n // 2, http2)
        await asyncio.sleep(0.5)
        os.kill(stack.fe.pid, signal.SIGUSR1)
        for _ in range(3000):
            await asyncio.sleep(0.1)
            if out.exists():
                break
        rows = orjson.loads(out.read_bytes())
        swarm.close_all()
        half.close_all()
    finally:
        stack.stop()
    rows.sort(key=lambda r: -r["bytes"])
    return rows


def short(where: str) -> str:
    """A source line's path from its package (``hypercorn/...``,
    ``asgi_generate/...``, ``asyncio/...``)."""
    for marker in ("site-packages/", "/codecs/", "/asgi_generate/"):
        if marker in where:
            tail = where.split(marker, 1)[1]
            return "asgi_generate/" + tail if marker == "/asgi_generate/" else tail
    return where.rsplit("/python3.", 1)[-1].split("/", 1)[-1]


def storms(args: argparse.Namespace, tmp: pathlib.Path, classes: list[str]) -> None:
    print(f"\nAbort storm: {args.storm} SSE streams hang up at once\n")
    print("| protocol | worker class | open all (s) | all aborts answered (s) | acknowledged | unacknowledged "
          "| worker lost | abort requests | most in flight | abort connections opened | request during the storm "
          "| worker after |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for protocol in args.protocols.split(","):
        for wc in classes:
            try:
                r = asyncio.run(storm(tmp, protocol, wc, args.storm))
            except Exception as exc:  # one cell failing still prints the others
                print(f"| {protocol} | {wc} | failed: {exc!r} |", flush=True)
                continue
            print(f"| {protocol} | {wc} | {r['opened_s']:.1f} | {r['acked_s']:.2f} | {r['acked']:,} | {r['unacked']} "
                  f"| {r['lost']} | {r['requests']:,} | {r['peak']} | {r['conns']} "
                  f"| {r['during_status']} in {r['during_s']:.2f} s | {r['worker']} |", flush=True)


def capacities(tmp: pathlib.Path, classes: list[str], streams: int, http2: bool) -> None:
    over = "HTTP/2, 100 streams per client connection" if http2 else "HTTP/1.1, a client connection each"
    print(f"\nOpen-stream capacity: {streams} SSE streams held open in one frontend process ({over})\n")
    print("| worker class | streams | open all (s) | RSS before (MB) | RSS open (MB) | KB per stream | fds open "
          "| all hung up and aborted (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for wc in classes:
        try:
            r = asyncio.run(capacity(tmp, wc, streams, http2))
        except Exception as exc:
            print(f"| {wc} | {streams:,} | failed: {exc!r} |", flush=True)
            continue
        print(f"| {wc} | {r['streams']:,} | {r['opened_s']:.1f} | {r['base_mb']:.1f} | {r['loaded_mb']:.1f} "
              f"| {r['kb_per_stream']:.1f} | {r['fds']:,} | {r['closed_s']:.1f} |", flush=True)


def print_profile(worker_class: str, total_open: int, n: int, rows: list[dict], top: int) -> None:
    by_owner: dict[str, list[int]] = {}
    for r in rows:
        acc = by_owner.setdefault(r["owner"], [0, 0])
        acc[0] += r["bytes"]
        acc[1] += r["count"]
    total = sum(r["bytes"] for r in rows)
    print(f"\nWhere the memory goes (tracemalloc, {worker_class}, {total_open - n} to {total_open} streams): "
          f"{total / n / 1024:.1f} KB of Python allocations per stream\n")
    print("| nearest caller (asgi-generate, else hypercorn) | bytes per stream | objects per stream |")
    print("|---|---:|---:|")
    for name, (size, count) in sorted(by_owner.items(), key=lambda kv: -kv[1][0]):
        if size / n >= 64:
            print(f"| {name} | {size / n:.0f} | {count / n:.1f} |")
    print("\n| source line | nearest caller | bytes per stream | objects per stream |")
    print("|---|---|---:|---:|")
    for r in rows[:top]:
        print(f"| {short(r['where'])} | {r['owner']} | {r['bytes'] / n:.0f} | {r['count'] / n:.1f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storm", type=int, default=5000, help="streams that hang up at once (default %(default)s)")
    parser.add_argument("--streams", type=int, default=10000, help="streams held open (default %(default)s)")
    parser.add_argument("--h2-streams", type=int, default=10000,
                        help="streams held open over HTTP/2, 100 per client connection (default %(default)s)")
    parser.add_argument("--profile", type=int, default=2000, help="streams open under tracemalloc; 0 = skip")
    parser.add_argument("--profile-http2", action="store_true", help="the profile's streams over HTTP/2")
    parser.add_argument("--top", type=int, default=25, help="source lines listed by the profile")
    parser.add_argument("--worker-classes", default="asyncio,trio", help="hypercorn worker classes")
    parser.add_argument("--protocols", default="sglang,vllm", help="engine protocols for the storm")
    args = parser.parse_args()
    hard = raise_hard_fd_limit(max(2 * args.streams, args.h2_streams + args.h2_streams // 100) + FD_MARGIN)
    streams = min(args.streams, (hard - FD_MARGIN) // 2)
    h2_streams = min(args.h2_streams, (hard - FD_MARGIN) * 100 // 101)
    classes = args.worker_classes.split(",")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-streams-"))
    print(f"bench_streams.py, {time.strftime('%Y-%m-%dT%H:%M:%S')}: {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}, Python {platform.python_version()}; "
          f"open-file hard limit {hard}")
    if streams < args.streams:
        print(f"- {args.streams} streams need {2 * args.streams + FD_MARGIN} fds in the frontend (a client and an "
              f"engine socket each); the hard limit allows {streams}")
    if args.storm:
        storms(args, tmp, classes)
    if streams:
        capacities(tmp, classes, streams, False)
    if h2_streams:
        capacities(tmp, classes, h2_streams, True)
    for wc in classes if args.profile else ():
        # Allocations live with the profile's streams open minus those with half of them open.
        print_profile(wc, args.profile, args.profile - args.profile // 2,
                      asyncio.run(profile(tmp, wc, args.profile, args.profile_http2)), args.top)
    print(f"\nlogs: {tmp}; load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
