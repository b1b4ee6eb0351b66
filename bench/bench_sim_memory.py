"""The simulator's resident memory over many unary requests, before and
after its bounds, side by side.

For each engine kind (SGLang, vLLM) one ``asgi-generate sim`` (zero latency,
prefix cache on as by default) serves ``--count`` unary requests, each with
a prompt of its own (so every request draws new model states, as real
traffic does) and ``--tokens`` new tokens, from ``--connections``
keep-alive connections; its RSS (``/proc/PID/status`` ``VmRSS``) is read
every tenth of the run. "before" is the simulator at ``--before`` (a commit
of this repository, extracted with ``git archive`` and put first on
``PYTHONPATH``), "after" the working tree's. Every answer is checked: status
200 and ``--tokens`` output tokens.

What grew before: the model's step cache (up to 200,000 steps of 20
candidates, about 3 KB each) and the rid lists ``/sim/stats`` returns (one
entry per request, forever). Now the step cache keeps
``sim.model.MAX_CACHED_STEPS`` and each rid list the newest
``sim.engine.RECENT_RIDS`` beside exact counts.

Usage: ``.venv/bin/python bench/bench_sim_memory.py [--count 200000]
[--before 39a83db]``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time

import orjson

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _procs import Child, LogDir, free_port, run_main, wait_ready  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def rss_mb(pid: int) -> float:
    """``VmRSS`` of ``pid`` in MB."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def body(protocol: str, i: int, tokens: int) -> bytes:
    """Request ``i``'s body: a 6-token prompt no other request has."""
    prompt = [5 + i % 3000, 5 + (i // 3000) % 3000, 5 + i // 9_000_000, 7, 8, 9]
    if protocol == "vllm":
        return orjson.dumps({"token_ids": prompt, "sampling_params": {"max_tokens": tokens, "ignore_eos": True}})
    return orjson.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}})


class Connection:
    """One keep-alive HTTP/1.1 connection: POST, then read the answer by its
    ``content-length``."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buf = b""

    def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"content-length: {len(payload)}\r\n\r\n").encode()
        self.sock.sendall(head + payload)
        while b"\r\n\r\n" not in self.buf:
            self._more()
        raw, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = raw.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(int(v) for k, _, v in (line.partition(b":") for line in lines[1:])
                      if k.strip().lower() == b"content-length")
        while len(self.buf) < length:
            self._more()
        answer, self.buf = self.buf[:length], self.buf[length:]
        return status, answer

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise RuntimeError("connection closed")
        self.buf += data


def load(protocol: str, port: int, pid: int, count: int, tokens: int, connections: int) -> list[tuple[int, float]]:
    """Send ``count`` requests; RSS (MB) after each tenth."""
    path = "/inference/v1/generate" if protocol == "vllm" else "/generate"
    lock = threading.Lock()
    state = {"next": 0, "done": 0, "bad": 0}
    marks = [count * k // 10 for k in range(1, 11)]
    samples: list[tuple[int, float]] = [(0, rss_mb(pid))]

    def worker() -> None:
        conn = Connection(port)
        while True:
            with lock:
                i = state["next"]
                if i >= count:
                    return
                state["next"] += 1
            try:
                status, answer = conn.post(path, body(protocol, i, tokens))
            except (RuntimeError, OSError):  # hypercorn closes a keep-alive connection after its request cap
                conn = Connection(port)
                status, answer = conn.post(path, body(protocol, i, tokens))
            obj = orjson.loads(answer)
            got = len(obj["choices"][0]["token_ids"]) if protocol == "vllm" else len(obj["output_ids"])
            with lock:
                state["done"] += 1
                if status != 200 or got != tokens:
                    state["bad"] += 1
                if marks and state["done"] >= marks[0]:
                    samples.append((marks.pop(0), rss_mb(pid)))

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if state["bad"]:
        raise RuntimeError(f"{state['bad']} answers were not 200 with {tokens} tokens")
    return samples


def extract(commit: str, into: pathlib.Path) -> None:
    """The package ``asgi_generate`` as it was at ``commit``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "asgi_generate"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def run_one(logs: LogDir, label: str, pythonpath: pathlib.Path, protocol: str, args) -> list[tuple[int, float]]:
    port = free_port()
    # -P: not the working directory first on the path, which would shadow PYTHONPATH.
    argv = ["env", f"PYTHONPATH={pythonpath}", sys.executable, "-P", "-m", "asgi_generate", "sim",
            "--protocol", protocol, "--port", str(port)]
    child = Child(f"{label}-{protocol}", argv, None, logs.path)
    try:
        wait_ready(child, port, "GET", "/health")
        started = time.monotonic()
        samples = load(protocol, port, child.pid, args.count, args.tokens, args.connections)
        rate = args.count / (time.monotonic() - started)
        print(f"  {label:6} {protocol:6} {args.count} requests at {rate:,.0f}/s", flush=True)
        return samples
    finally:
        child.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200_000, help="requests per run")
    parser.add_argument("--tokens", type=int, default=4, help="new tokens per request")
    parser.add_argument("--connections", type=int, default=8, help="keep-alive connections")
    parser.add_argument("--before", default="39a83db", help="the commit to measure as before")
    args = parser.parse_args()
    with LogDir("bench-sim-memory-") as logs, tempfile.TemporaryDirectory() as before:
        extract(args.before, pathlib.Path(before))
        results = {}
        for protocol in ("sglang", "vllm"):
            for label, path in (("before", pathlib.Path(before)), ("after", ROOT)):
                results[label, protocol] = run_one(logs, label, path, protocol, args)
        for protocol in ("sglang", "vllm"):
            print(f"\n{protocol}: simulator RSS (MB) after N unary requests ({args.tokens} tokens each)")
            print(f"  {'requests':>9}  {'before':>8}  {'after':>8}")
            for (n, b), (_, a) in zip(results["before", protocol], results["after", protocol]):
                print(f"  {n:>9,}  {b:>8.1f}  {a:>8.1f}")
            b0, b1 = results["before", protocol][0][1], results["before", protocol][-1][1]
            a0, a1 = results["after", protocol][0][1], results["after", protocol][-1][1]
            print(f"  growth: before {b1 - b0:+.1f} MB, after {a1 - a0:+.1f} MB")
        logs.ok = True
    return 0


if __name__ == "__main__":
    os.environ.pop("PYTHONPATH", None)
    run_main(main)
