"""Routing for prefix reuse: asgi-generate's four policies and
sglang-router's cache_aware and round_robin, side by side on the same
simulated fleet, through one frontend (router) process or several.

Fleet: ``--workers`` (4) simulated SGLang workers, each with a prefix cache
of ``--cache-tokens`` tokens (LRU) and a prefill cost of
``--prefill-us-per-token`` per uncached prompt token (prefills one after
another per worker, on top of ``--ttft-ms``), ``--itl-ms`` between tokens,
publishing its KV cache events (``--kv-events-config``) for ``kv-aware``.

Workload (built once, the same for every router): ``--sessions`` (64)
conversations of ``--turns`` (8) turns; a turn's prompt is the previous
turn's prompt, its answer and a new user chunk (``--first-tokens`` 512 for
the first turn, ``--turn-tokens`` 128 after), ``--output-tokens`` (64)
tokens answered (``ignore_eos``), streamed. ``--concurrency`` (16) clients
take the next waiting conversation, send its next turn, and put it back at
the end of the line, so every conversation stays open the whole run (as an
RL rollout's agents do) and a worker can only keep the conversations it
serves in its cache. Every turn carries ``X-Session-ID``. With
``--mooncake FILE`` the requests are instead the rows of a Mooncake trace
(JSONL, one request a line: ``timestamp``, ``input_length``,
``output_length``, ``hash_ids``: each hash id a 512-token block, equal ids
equal blocks; ``bench/mooncake_conversation.jsonl`` is 300 rows of
Mooncake's FAST'25 conversation trace), sent in timestamp order at the
same concurrency (a closed loop: the timestamps order the rows, they do
not pace them), output capped at ``--output-tokens``, the first hash id as
session key. ``--mooncake-block-tokens N`` makes every hash block ``N``
tokens instead of 512 and scales each row's ``input_length`` by ``N`` /
512 (rounded up), so a real trace's 12K-token prompts fit a 2-CPU
machine's simulated prefill: reuse is the same, block for block. With ``--workload
grpo``: ``--groups`` (24) prompts sharing one ``--system-tokens`` (1024)
system prefix, each with its own ``--question-tokens`` (128), each sent as
a group of ``--group-size`` (8) separate requests back to back (a GRPO
group's samples, concurrent), in order at the same concurrency, the group
as session key; with ``--workload grpo-n`` each group is one request with
``n`` = ``--group-size`` (SGLang answers its samples in one stream, each
chunk with its ``index``).

Routers, in turn, each in front of the same simulators, their caches
flushed between routers: asgi-generate ``--policy least-outstanding``,
``session``, ``cache-aware``, ``kv-aware`` (asyncio worker class),
sglang-router ``--policy cache_aware`` (its defaults) and ``round_robin``.
``--routers`` may also name ``kv-aware`` with one setting changed
(:data:`VARIANTS`: ``kv-aware read-idle``, ``kv-aware no-reading``,
``kv-aware read-0.25s``), to measure what its load readings cost.
With ``--replicas 1,4`` each runs as 1 and as 4 processes (separate
``serve`` processes, separate routers), the client sending each request to
the next replica in turn, as a load balancer spreads them.

With ``--repeat N`` each router runs N times, the routers interleaved
(A B C ... A B C ...), and its figures pool all N runs: on a shared
machine the noise between runs is larger than the hop's own cost. The
table gives each run's hit ratio and mean TTFT as a min-max range; the
goals below it compare routers within each round of runs as well as
pooled: each router's hit ratio at N replicas over its own at 1, and
``kv-aware`` against the best other router at each replica count.

Per router: the CPU seconds per second of the run used by the frontend
(router) processes, summed over replicas, by the simulators (from
``/proc``) and by this client (on a shared machine they compete for the
same cores); with
``--idle-seconds S`` also the frontend processes' CPU over ``S`` seconds
idle before the run (their background work: ``kv-aware``'s event
subscribers and load readings). The cache-hit ratio (cached / prompt tokens, from the
simulators' ``/sim/stats``), mean and p99 TTFT at the client (request sent
to first token event), throughput (requests and output tokens per second),
and requests per worker (max/min). Every answer is checked: status 200,
``--output-tokens`` tokens (every sample's), and the same tokens under
every router.

Usage: ``.venv/bin/python bench/bench_routing.py [--sessions 64 --turns 8
--concurrency 16] [--routers ours,sglang-router]``. sglang-router is
installed on first use into ``bench/.venv-router``, as bench_frontend.py does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import random
import signal
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import httpx
import orjson

from _procs import Child, LogDir, free_port, http_request, listening_socket, wait_ready
from bench_frontend import HERE, ID_LOW, ID_SPAN, ensure_router

ROUTERS = {
    "least-outstanding": ("ours", "least-outstanding"),
    "session": ("ours", "session"),
    "cache-aware": ("ours", "cache-aware"),
    "kv-aware": ("ours", "kv-aware"),
    "sglang-router cache_aware": ("sglang-router", "cache_aware"),
    "sglang-router round_robin": ("sglang-router", "round_robin"),
}
#: kv-aware with one of its settings changed, for side-by-side measurement
#: (named in ``--routers`` only, never in a group): every engine's load read
#: every interval, idle or not, no load reading at all, and a reading every
#: 0.25 s instead of 0.1.
VARIANTS = {
    "kv-aware read-idle": ("ours", "kv-aware", ("--kv-load-idle-interval", "0")),
    "kv-aware no-reading": ("ours", "kv-aware", ("--kv-load-interval", "0")),
    "kv-aware read-0.25s": ("ours", "kv-aware", ("--kv-load-interval", "0.25")),
}
KNOWN = {**ROUTERS, **VARIANTS}
#: Tokens a Mooncake trace's hash id stands for (FAST'25 ``README.md``).
MOONCAKE_BLOCK = 512
#: Each simulator publishes its KV events on free loopback ports.
KV_EVENTS = '{"publisher": "zmq", "bind": true, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}'


@dataclass
class Request:
    """One request of the workload: a conversation's turn, a GRPO sample
    (or a whole group as ``n`` samples) or a trace row."""

    session: str
    prompt: list[int]
    output_tokens: int
    n: int = 1


@dataclass
class RunResult:
    label: str
    ttft_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_worker: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    answers: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    policy_stats: dict | None = None
    #: CPU seconds the frontend (router) processes, summed, and the
    #: simulators used during the run; the frontends' over the idle window.
    router_cpu_s: float = 0.0
    sim_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    idle_cpu_s: float = 0.0
    idle_s: float = 0.0
    #: A pooled result's runs, for their spread.
    runs: list["RunResult"] = field(default_factory=list)

    @property
    def hit(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttft_ms) if self.ttft_ms else float("nan")


def chunk(rng: random.Random, n: int) -> list[int]:
    return [ID_LOW + rng.randrange(ID_SPAN) for _ in range(n)]


class Conversations:
    """The multi-turn workload: each conversation's next prompt depends on
    its previous answer, which the first run records (the simulator is
    deterministic, so every run sends the same prompts)."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = random.Random(args.seed)
        self.turns = args.turns
        self.output_tokens = args.output_tokens
        self.first = [chunk(rng, args.first_tokens) for _ in range(args.sessions)]
        self.added = [[chunk(rng, args.turn_tokens) for _ in range(args.turns - 1)] for _ in range(args.sessions)]

    def start(self) -> deque:
        return deque((s, 0, self.first[s]) for s in range(len(self.first)))

    def follow(self, s: int, turn: int, prompt: list[int], answer: list[int]) -> tuple[int, int, list[int]] | None:
        if turn + 1 >= self.turns:
            return None
        return s, turn + 1, prompt + answer + self.added[s][turn]


def grpo_rows(args: argparse.Namespace) -> list[Request]:
    """GRPO groups: one system prefix, a question per group, each group's
    prompt sent ``--group-size`` times back to back (``grpo``) or once with
    ``n`` = ``--group-size`` (``grpo-n``)."""
    rng = random.Random(args.seed)
    system = chunk(rng, args.system_tokens)
    out = []
    for g in range(args.groups):
        prompt = system + chunk(rng, args.question_tokens)
        if args.workload == "grpo-n":
            out.append(Request(f"group-{g}", prompt, args.output_tokens, n=args.group_size))
        else:
            out += [Request(f"group-{g}", prompt, args.output_tokens) for _ in range(args.group_size)]
    return out


def mooncake_rows(path: pathlib.Path, limit_output: int, block_tokens: int = MOONCAKE_BLOCK) -> list[Request]:
    """The trace's rows as requests, in timestamp order: each hash id a
    deterministic ``block_tokens``-token block, each row's ``input_length``
    scaled by ``block_tokens / 512`` (rounded up)."""
    blocks: dict[int, list[int]] = {}
    out = []
    rows = [orjson.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in sorted(rows, key=lambda r: r.get("timestamp", 0)):
        ids: list[int] = []
        for h in row["hash_ids"]:
            if h not in blocks:
                blocks[h] = chunk(random.Random(h), block_tokens)
            ids += blocks[h]
        length = -(-row["input_length"] * block_tokens // MOONCAKE_BLOCK)
        ids = ids[:length] or chunk(random.Random(-1), 1)
        key = str(row["hash_ids"][0]) if row["hash_ids"] else "none"
        out.append(Request(key, ids, max(1, min(row["output_length"], limit_output))))
    return out


async def one_turn(client: httpx.AsyncClient, url: str, req: Request, result: RunResult) -> list[int] | None:
    """Send one streamed request; record its TTFT; return its output ids
    (with ``n`` > 1, every sample's, in ``index`` order)."""
    sampling = {"max_new_tokens": req.output_tokens, "ignore_eos": True, **({"n": req.n} if req.n > 1 else {})}
    body = orjson.dumps({"input_ids": req.prompt, "stream": True, "sampling_params": sampling})
    headers = {"content-type": "application/json", "x-session-id": req.session}
    t0 = time.perf_counter()
    first = None
    parts: list[bytes] = []  # joined once at the end (n samples: hundreds of chunks)
    async with client.stream("POST", url + "/generate", content=body, headers=headers) as resp:
        if resp.status_code != 200:
            result.problems.append(f"status {resp.status_code}: {(await resp.aread())[:200]!r}")
            return None
        async for data in resp.aiter_raw():
            if first is None and b"data: {" in data:
                first = time.perf_counter()
            parts.append(data)
    events = [e[6:] for e in b"".join(parts).split(b"\n\n") if e.startswith(b"data: ")]
    if len(events) < 2 or events[-1] != b"[DONE]":
        result.problems.append("stream did not end with [DONE]")
        return None
    last: dict[int, list] = {}  # each sample's last chunk (output_ids are cumulative)
    for e in events[:-1]:
        chunk_ = orjson.loads(e)
        last[chunk_.get("index", 0)] = chunk_.get("output_ids")
    samples = [last.get(i) for i in range(req.n)]
    if first is None or any(not isinstance(ids, list) or len(ids) != req.output_tokens for ids in samples):
        result.problems.append(f"answer has {[len(x) if isinstance(x, list) else x for x in samples]} tokens")
        return None
    result.ttft_ms.append((first - t0) * 1000)
    result.output_tokens += req.output_tokens * req.n
    return [t for ids in samples for t in ids]


async def drive(urls: list[str], args: argparse.Namespace, work, result: RunResult) -> None:
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    sent = 0

    def spread() -> str:  # the next replica, as a round-robin load balancer
        nonlocal sent
        sent += 1
        return urls[sent % len(urls)]

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        if isinstance(work, Conversations):
            line = work.start()
            active = 0
            wake = asyncio.Event()

            async def client_loop() -> None:
                nonlocal active
                while True:
                    while not line:
                        if active == 0:
                            return
                        wake.clear()
                        await wake.wait()
                    s, turn, prompt = line.popleft()
                    active += 1
                    try:
                        ids = await one_turn(client, spread(), Request(f"session-{s}", prompt, work.output_tokens),
                                             result)
                        if ids is not None:
                            result.answers[(f"session-{s}", turn)] = ids
                            nxt = work.follow(s, turn, prompt, ids)
                            if nxt is not None:
                                line.append(nxt)
                    finally:
                        active -= 1
                        wake.set()

            await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
        else:
            queue = deque(enumerate(work))

            async def row_loop() -> None:
                while queue:
                    i, req = queue.popleft()
                    ids = await one_turn(client, spread(), req, result)
                    if ids is not None:
                        result.answers[(req.session, i)] = ids

            await asyncio.gather(*(row_loop() for _ in range(args.concurrency)))


def sim_stats(port: int) -> dict:
    status, body = http_request(port, "GET", "/sim/stats")
    assert status == 200, body
    return orjson.loads(body)


def start_sims(stack: contextlib.ExitStack, args: argparse.Namespace,
               log_dir: pathlib.Path) -> list[tuple[int, Child]]:
    sims = []
    for i in range(args.workers):
        sock = listening_socket()
        port = sock.getsockname()[1]
        argv = [sys.executable, "-m", "asgi_generate", "sim", "--protocol", "sglang", "--fd", str(sock.fileno()),
                "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms),
                "--cache-tokens", str(args.cache_tokens), "--prefill-us-per-token", str(args.prefill_us_per_token),
                "--disconnect-abort-s", "60", "--kv-events-config", KV_EVENTS]
        sim = Child(f"sim{i}", argv, None, log_dir, pass_fds=(sock.fileno(),))
        sock.close()
        stack.callback(sim.stop)
        wait_ready(sim, port, "GET", "/health")
        sims.append((port, sim))
    return sims


def start_router(stack: contextlib.ExitStack, kind: str, policy: str, sim_ports: list[int],
                 args: argparse.Namespace, log_dir: pathlib.Path, router_python: str | None, replica: int = 0,
                 extra: tuple[str, ...] = ()) -> tuple[int, Child]:
    """One router (replica ``replica``) in front of ``sim_ports``, once it
    routes to all of them: its port and its process."""
    urls = [f"http://127.0.0.1:{p}" for p in sim_ports]
    probe = orjson.dumps({"input_ids": [ID_LOW], "sampling_params": {"max_new_tokens": 1}})
    if kind == "sglang-router":
        port = free_port()
        argv = [router_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", policy, "--log-level", "warn",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        child = Child(f"sglang-router-{policy}-{replica}", argv, None, log_dir)
        stack.callback(child.stop)
        wait_ready(child, port, "POST", "/generate", probe)
        # The router registers workers in the background: wait for all of them.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, body = http_request(port, "GET", "/workers")
            if status == 200 and sum(w.get("is_healthy", False) for w in orjson.loads(body)["workers"]) == len(urls):
                break
            time.sleep(0.2)
        return port, child
    sock = listening_socket()
    port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "asgi_generate", "serve", "--fd", str(sock.fileno()), "--worker-class", "asyncio",
            "--log-level", "warning", "--policy", policy,
            "--session-balance-epsilon", str(args.session_balance_epsilon), *extra]
    for u in urls:
        argv += ["--worker", f"sglang={u}"]
    child = Child(f"asgi-generate-{policy}-{replica}", argv, None, log_dir, pass_fds=(sock.fileno(),))
    sock.close()
    stack.callback(child.stop)
    wait_ready(child, port, "GET", "/health")
    deadline = time.monotonic() + 120
    while orjson.loads(http_request(port, "GET", "/health")[1])["healthy_workers"] < len(urls):
        assert time.monotonic() < deadline, "workers never all up"
        time.sleep(0.1)
    while policy == "kv-aware":  # every worker's subscriber found and caught up (its history replayed)
        workers = orjson.loads(http_request(port, "GET", "/stats")[1])["routing"]["workers"]
        published = [sim_stats(p)["kv_events"]["next_seq"] - 1 for p in sim_ports]
        if len(workers) == len(urls) and all(
                w["source"] == "events" and _seq(w["subscriber"]["last_seq"]) >= last
                for w, last in zip((workers[f"w{i}"] for i in range(len(urls))), published)):
            break
        assert time.monotonic() < deadline, f"KV event subscribers never all caught up: {workers}"
        time.sleep(0.1)
    return port, child


def _seq(last_seq: int | None) -> int:
    """A subscriber's last sequence number, -1 before any (0 is a sequence
    number: a worker that has published only its first batch)."""
    return -1 if last_seq is None else last_seq


def run_one(label: str, kind: str, policy: str, sims: list[tuple[int, Child]], args: argparse.Namespace, work,
            log_dir: pathlib.Path, router_python: str | None, replicas: int = 1,
            extra: tuple[str, ...] = ()) -> RunResult:
    result = RunResult(label)
    sim_ports = [port for port, _ in sims]

    def cpu(children) -> float:
        return sum(c.cpu_seconds() for c in children)

    with contextlib.ExitStack() as stack:
        started = [start_router(stack, kind, policy, sim_ports, args, log_dir, router_python, i, extra)
                   for i in range(replicas)]
        ports, routers = [port for port, _ in started], [child for _, child in started]
        port = ports[0]
        for p in sim_ports:  # the probe and warm-up requests' prefixes too
            status, body = http_request(p, "POST", "/flush_cache")
            assert status == 200, body
        if args.idle_seconds > 0:
            idle0, t_idle = cpu(routers), time.perf_counter()
            time.sleep(args.idle_seconds)
            result.idle_cpu_s, result.idle_s = cpu(routers) - idle0, time.perf_counter() - t_idle
        before = [sim_stats(p) for p in sim_ports]
        router0, sim0, client0 = cpu(routers), cpu(c for _, c in sims), time.process_time()
        t0 = time.perf_counter()
        asyncio.run(drive([f"http://127.0.0.1:{p}" for p in ports], args, work, result))
        result.seconds = time.perf_counter() - t0
        result.router_cpu_s, result.sim_cpu_s = cpu(routers) - router0, cpu(c for _, c in sims) - sim0
        result.client_cpu_s = time.process_time() - client0
        after = [sim_stats(p) for p in sim_ports]
        if kind == "ours":
            result.policy_stats = orjson.loads(http_request(port, "GET", "/stats")[1])["routing"]
    for b, a in zip(before, after):
        result.prompt_tokens += a["cache"]["prompt_tokens"] - b["cache"]["prompt_tokens"]
        result.cached_tokens += a["cache"]["cached_tokens"] - b["cache"]["cached_tokens"]
        result.per_worker.append(a["received"] - b["received"])
    return result


def pooled(runs: list[RunResult]) -> RunResult:
    """One router's runs as one: every TTFT, summed tokens, seconds and
    requests per worker; the first run's answers, and each run's problems
    (with a note when a run's answers differ from the first's)."""
    out = RunResult(runs[0].label, answers=runs[0].answers, policy_stats=runs[-1].policy_stats,
                    per_worker=[0] * len(runs[0].per_worker), runs=runs)
    for r in runs:
        out.ttft_ms += r.ttft_ms
        out.seconds += r.seconds
        out.output_tokens += r.output_tokens
        out.prompt_tokens += r.prompt_tokens
        out.cached_tokens += r.cached_tokens
        out.router_cpu_s += r.router_cpu_s
        out.sim_cpu_s += r.sim_cpu_s
        out.client_cpu_s += r.client_cpu_s
        out.idle_cpu_s += r.idle_cpu_s
        out.idle_s += r.idle_s
        out.per_worker = [a + b for a, b in zip(out.per_worker, r.per_worker)]
        out.problems += r.problems + (["answers differ between runs"] if r.answers != out.answers else [])
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _range(values: list[float], fmt: str) -> str:
    """``min-max`` of one figure over the runs (one value: that value)."""
    if len(values) < 2:
        return format(values[0], fmt) if values else "-"
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def report(results: list[RunResult], args: argparse.Namespace, context: list[str]) -> None:
    """The table (figures pooled over the runs, each run's hit ratio and
    mean TTFT as a min-max range), then the goals: each router's hit ratio
    at N replicas over its own at 1 (pooled, and the range of the ratio
    within each round of runs), and ``kv-aware`` against every other
    router at each replica count."""
    print("\n".join(context))
    print()
    print("| router | hit ratio | (runs) | mean TTFT ms | (runs) | p99 TTFT ms | req/s | output tok/s "
          "| requests per worker | max/min | frontend CPU-s/s | sims CPU-s/s | client CPU-s/s "
          "| frontend idle CPU-s/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in results:
        n = len(r.ttft_ms)
        spread = (max(r.per_worker) / min(r.per_worker)) if min(r.per_worker, default=0) > 0 else float("inf")
        runs = r.runs or [r]
        print(f"| {r.label} | {r.hit:.3f} | {_range([x.hit for x in runs], '.3f')} | {r.mean_ttft:.1f} "
              f"| {_range([x.mean_ttft for x in runs], '.1f')} | {pct(r.ttft_ms, 0.99):.1f} | {n / r.seconds:.1f} "
              f"| {r.output_tokens / r.seconds:,.0f} | {' / '.join(map(str, r.per_worker))} | {spread:.2f} "
              f"| {r.router_cpu_s / r.seconds:.3f} | {r.sim_cpu_s / r.seconds:.3f} | {r.client_cpu_s / r.seconds:.3f} "
              f"| {f'{r.idle_cpu_s / r.idle_s:.4f}' if r.idle_s else '-'} |")
    print()
    by_label = {r.label: r for r in results}

    def split(label: str) -> tuple[str, str]:
        name, _, n = label.partition(" x")
        return name, n or "1"

    for r in results:
        name, n = split(r.label)
        one = by_label.get(f"{name} x1")
        if n != "1" and one is not None and one.hit:
            rounds = [a.hit / b.hit for a, b in zip(r.runs or [r], one.runs or [one]) if b.hit]
            print(f"- {name}: hit ratio at {n} replicas / at 1: {r.hit / one.hit:.3f} "
                  f"(per round of runs: {_range(rounds, '.3f')})")
    for r in results:
        name, n = split(r.label)
        if name != "kv-aware":
            continue
        others = [o for o in results if split(o.label)[1] == n and o is not r]
        if not others:
            continue
        best_hit = max(others, key=lambda o: o.hit)
        best_ttft = min(others, key=lambda o: o.mean_ttft)
        print(f"- kv-aware at {n} replica(s): hit ratio {r.hit:.3f} vs best other {best_hit.hit:.3f} "
              f"({best_hit.label}, {r.hit / best_hit.hit:.3f}x); mean TTFT {r.mean_ttft:.1f} vs best other "
              f"{best_ttft.mean_ttft:.1f} ms ({best_ttft.label}, {r.mean_ttft / best_ttft.mean_ttft:.2f}x)")
    for r in results:
        if KNOWN[split(r.label)[0]][0] == "ours":
            print(f"- {r.label} decisions (last run, first replica): {orjson.dumps(r.policy_stats).decode()}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--first-tokens", type=int, default=512)
    p.add_argument("--turn-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--mooncake", type=pathlib.Path, default=None, help="replay this Mooncake trace (JSONL) instead")
    p.add_argument("--mooncake-block-tokens", type=int, default=MOONCAKE_BLOCK,
                   help="tokens per Mooncake hash block (input lengths scaled alike)")
    p.add_argument("--idle-seconds", type=float, default=0.0,
                   help="measure the frontend processes' CPU this long idle before each run")
    p.add_argument("--workload", choices=("conversations", "grpo", "grpo-n"), default="conversations",
                   help="grpo: each group as --group-size concurrent requests; grpo-n: as one request with n")
    p.add_argument("--groups", type=int, default=24, help="grpo: groups (prompts)")
    p.add_argument("--group-size", type=int, default=8, help="grpo: requests per group")
    p.add_argument("--system-tokens", type=int, default=1024, help="grpo: the shared system prefix")
    p.add_argument("--question-tokens", type=int, default=128, help="grpo: each group's own tokens")
    p.add_argument("--replicas", default="1", help="comma-separated frontend (router) process counts to run")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--cache-tokens", type=int, default=32768, help="each simulator's prefix cache")
    p.add_argument("--prefill-us-per-token", type=float, default=100.0)
    p.add_argument("--ttft-ms", type=float, default=5.0)
    p.add_argument("--itl-ms", type=float, default=4.0)
    p.add_argument("--session-balance-epsilon", type=float, default=1.0, help="ours, --policy session")
    p.add_argument("--routers", default=",".join(ROUTERS),
                   help=f"comma-separated, from: {', '.join(KNOWN)}; 'ours' and 'sglang-router' name groups")
    p.add_argument("--repeat", type=int, default=1, help="runs per router, interleaved, pooled")
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--router-venv", type=pathlib.Path, default=HERE / ".venv-router")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = []
    for item in (s.strip() for s in args.routers.split(",") if s.strip()):
        group = [k for k, (kind, _) in ROUTERS.items() if kind == item]
        if not group and item not in KNOWN:
            print(f"unknown router {item!r}; choose from {list(KNOWN)}", file=sys.stderr)
            return 2
        names += group or [item]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    router_python, router_version = (ensure_router(args.router_venv) if any(KNOWN[n][0] == "sglang-router"
                                                                           for n in names) else (None, None))
    if args.mooncake:
        work = mooncake_rows(args.mooncake, args.output_tokens, args.mooncake_block_tokens)
    else:
        work = grpo_rows(args) if args.workload.startswith("grpo") else Conversations(args)
    replica_counts = [int(n) for n in args.replicas.split(",")]
    logs = LogDir("asgi-generate-bench-routing-")
    log_dir = logs.path
    results: list[RunResult] = []
    with logs:
        with contextlib.ExitStack() as stack:
            sims = start_sims(stack, args, log_dir)
            labels = [(name, n) for n in replica_counts for name in names]
            runs: dict[tuple[str, int], list[RunResult]] = {label: [] for label in labels}
            for round_ in range(args.repeat):
                for name, n in labels:
                    kind, policy, *extra = KNOWN[name]
                    label = f"{name} x{n}" if len(replica_counts) > 1 or n != 1 else name
                    print(f"{label} (run {round_ + 1} of {args.repeat}) ...", file=sys.stderr)
                    runs[(name, n)].append(run_one(label, kind, policy, sims, args, work, log_dir,
                                                   router_python, n, *extra))
            results = [pooled(r) for r in runs.values()]
        reference = results[0].answers if results else {}
        for r in results:
            if r.answers != reference:
                r.problems.append(f"answers differ from {results[0].label}'s")
        load = os.getloadavg()[0]
        if args.mooncake:
            shape = (f"Mooncake trace {args.mooncake.name}: {len(work)} requests, "
                     f"{args.mooncake_block_tokens} tokens per hash block")
        elif args.workload.startswith("grpo"):
            sent = "one request with n" if args.workload == "grpo-n" else "concurrent requests"
            shape = (f"{args.groups} GRPO groups of {args.group_size} as {sent} ({args.system_tokens}-token shared "
                     f"system prefix + {args.question_tokens} tokens each, {args.output_tokens} output tokens)")
        else:
            shape = (f"{args.sessions} sessions x {args.turns} turns ({args.first_tokens}-token first turn, "
                     f"+{args.turn_tokens} tokens a turn, {args.output_tokens} output tokens)")
        report(results, args, [
            f"Workload: {shape}, concurrency {args.concurrency}, streamed; {args.repeat} run(s) per router, "
            f"interleaved, pooled; replicas {args.replicas} (requests spread round robin over them).",
            f"Fleet: {args.workers} simulated SGLang workers, prefix cache {args.cache_tokens} tokens each (LRU), "
            f"prefill {args.prefill_us_per_token:g} us per uncached token (one prefill at a time per worker) + "
            f"TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms. sglang-router {router_version or 'not run'} "
            f"(defaults: cache-threshold 0.3, balance 64 / 1.5). {os.cpu_count()} CPUs, load before {load:.2f}.",
        ])
        problems = [f"{r.label}: {p}" for r in results for p in r.problems[:3]]
        for p in problems:
            print(f"PROBLEM {p}", file=sys.stderr)
        logs.ok = not problems
    return 0 if logs.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
