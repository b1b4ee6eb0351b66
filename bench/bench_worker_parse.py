"""The worker client's parse of an engine's answer, side by side in one
run: h11 (the client before, ``bench/_h11_client.py``) against httptools
(llhttp, ``asgi_generate/workers/http.py``), in CPU µs per response.

The answers are the simulator's own (``asgi-generate sim``, SGLang, TTFT =
ITL = 0), recorded once at start through the client: a 256-token
``stream`` answer (one ``data:`` event per token, chunked, then
``data: [DONE]``), as SGLang sends it by default (each event the whole
text and ``output_ids`` so far: 1.3 MB in all) and with
``--incremental-streaming-output`` (each event its own token), and a
16-token unary answer (``Content-Length``). Each is
then played back from memory, the way it arrives from a live engine: the
SSE answer one HTTP chunk per socket read (the head with the first; at a
real inter-token latency every token is its own read), the unary answer in
one read. Each client runs ``pool.request`` -> ``read_some`` until the end
on one keep-alive connection, so the pool's take and release are in it;
the **floor** is the same reads and writes with no HTTP at all (what any
client pays for the event loop and the in-memory connection). The
``client - floor`` column is the HTTP work alone.

Only this process's CPU (``time.process_time``), on asyncio (``--backend
trio`` for trio). Repetitions rotate the clients' order; the table gives
each one's median and the ratio h11 / httptools, whole and over the floor.

Usage: ``.venv/bin/python bench/bench_worker_parse.py [--responses 400] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import statistics
import sys
import time

import anyio
import anyio.lowlevel
import orjson

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import _h11_client  # noqa: E402
from support import start_sim  # noqa: E402

from asgi_generate.workers import http  # noqa: E402

PROMPT = [100 + (i * 7919) % 3900 for i in range(128)]
CLIENTS = {"h11": _h11_client, "httptools": http}


class Recorder:
    """A worker connection that keeps each read's bytes."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.reads: list[bytes] = []

    async def receive(self, max_bytes, deadline=math.inf, wait_first=False):
        data = await self.stream.receive(max_bytes, deadline, wait_first)
        if data:
            self.reads.append(data)
        return data

    async def send(self, data):
        await self.stream.send(data)

    def stale(self):
        return self.stream.stale()

    async def aclose(self):
        self.stream.close()


class Playback:
    """A worker connection in memory: each request written makes ``pieces``
    the answer, one per read."""

    __slots__ = ("pieces", "queue")

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.queue: list[bytes] = []

    async def receive(self, max_bytes, deadline=math.inf, wait_first=False):
        await anyio.lowlevel.checkpoint()
        return self.queue.pop() if self.queue else b""

    async def send(self, data):
        self.queue = self.pieces[::-1]

    def stale(self):
        return False

    async def aclose(self):
        pass


async def record(url: str, stream: bool, tokens: int) -> tuple[bytes, bytes]:
    """The simulator's answer as it came off the socket, and its body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    pool = http.ConnectionPool(host, int(port))
    connect = pool._connect
    recorders = []

    async def recording():
        conn = await connect()
        conn.stream = Recorder(conn.stream)
        recorders.append(conn.stream)
        return conn

    pool._connect = recording
    body = orjson.dumps({"input_ids": PROMPT, "stream": stream,
                         "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}})
    async with pool.request(b"POST", b"/generate", body, [(b"content-type", b"application/json")]) as resp:
        answer = await resp.read()
    await pool.aclose()
    return b"".join(recorders[0].reads), answer


def sse_pieces(raw: bytes) -> list[bytes]:
    """A chunked answer cut as a live engine's arrives: the head with the
    first chunk, then each chunk (the terminating one alone)."""
    head_end = raw.index(b"\r\n\r\n") + 4
    chunks, at = [], head_end
    while at < len(raw):
        line_end = raw.index(b"\r\n", at)
        size = int(raw[at:line_end], 16)
        end = line_end + 2 + size + 2 if size else len(raw)
        chunks.append(raw[at:end])
        at = end
    return [raw[:head_end] + chunks[0], *chunks[1:]]


async def client_cpu(module, pieces: list[bytes], responses: int, want: bytes) -> float:
    """CPU seconds for ``responses`` exchanges through ``module``'s pool."""
    pool = module.ConnectionPool("127.0.0.1", 8000)

    async def connect():
        pool.opened += 1
        return module._Connection(Playback(pieces))

    pool._connect = connect
    body = b"{}" * 400
    headers = [(b"content-type", b"application/json")]
    start = time.process_time()
    for _ in range(responses):
        async with pool.request(b"POST", b"/generate", body, headers) as resp:
            parts = []
            while (data := await resp.read_some()) is not None:
                parts.append(data)
    spent = time.process_time() - start
    assert b"".join(parts) == want and (pool.opened, pool.idle) == (1, 1), module.__name__
    return spent


async def floor_cpu(pieces: list[bytes], responses: int) -> float:
    """The same reads and writes with no HTTP: the in-memory connection and the loop."""
    wire = Playback(pieces)
    request = b"x" * 900
    start = time.process_time()
    for _ in range(responses):
        await wire.send(request)
        while await wire.receive(65536):
            pass
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=400, help="responses per client per repetition")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    args = parser.parse_args()
    answers = {}
    for incremental in (False, True):
        sim = start_sim(incremental=incremental)
        try:
            sse_raw, sse_body = anyio.run(record, sim.url, True, 256)
            if not incremental:
                unary_raw, unary_body = anyio.run(record, sim.url, False, 16)
        finally:
            sim.stop()
        assert sse_body.count(b"data: ") == 257 and b"transfer-encoding: chunked" in sse_raw.lower()
        name = "SSE, 256 events" + (", incremental" if incremental else " (SGLang's default: whole text so far)")
        answers[name] = (sse_pieces(sse_raw), sse_body)
    answers["unary, 16 tokens"] = ([unary_raw], unary_body)
    load = os.getloadavg()[0]
    print(f"# bench_worker_parse: {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, load {load:.2f}, "
          f"{args.backend}, {args.responses} responses x {args.reps} reps\n")
    print("| answer | reads | h11 µs | httptools µs | floor µs | h11 / httptools "
          "| over the floor: h11 / httptools |")
    print("|---|---|---|---|---|---|---|")
    for name, (pieces, want) in answers.items():
        cells: dict[str, list[float]] = {"h11": [], "httptools": [], "floor": []}
        order = ["h11", "httptools", "floor"]
        for rep in range(args.reps):
            for who in order[rep % 3:] + order[:rep % 3]:
                if who == "floor":
                    spent = anyio.run(floor_cpu, pieces, args.responses, backend=args.backend)
                else:
                    spent = anyio.run(client_cpu, CLIENTS[who], pieces, args.responses, want, backend=args.backend)
                cells[who].append(spent / args.responses * 1e6)
        old, new, floor = (statistics.median(cells[k]) for k in ("h11", "httptools", "floor"))
        print(f"| {name} | {len(pieces)} | {old:.1f} | {new:.1f} | {floor:.1f} | {old / new:.2f}x | "
              f"{(old - floor) / (new - floor):.2f}x |")
    print(f"\nload after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
