"""What prefill/decode disaggregation costs at the frontend: P/D pairs vs an
aggregated worker, same simulator timing, side by side.

Simulated workers (``--ttft-ms``/``--itl-ms``, zero by default) of one
protocol (``--protocol sglang|vllm``): one aggregated simulator, and a
prefill and a decode simulator that hand the KV over loopback (SGLang: the
legs run concurrently; vLLM: the prefill leg, then the decode leg with its
``kv_transfer_params``). Two asgi-generate frontends (hypercorn, asyncio) run side
by side: ``agg`` in front of the aggregated simulator, ``pd`` in front of
the pair (``--disaggregation always``). The aggregated simulator is also
asked directly (``direct``), so the frontend's own cost shows.

Cells, for a unary and an SSE request (128 prompt tokens, 16 output tokens
with ``ignore_eos``):

- latency: ``--requests`` sequential requests on one connection, p50 and
  p90 in ms, per target;
- throughput: a closed loop of ``--seconds`` at ``--concurrency``
  keep-alive connections, requests/s, per target in turn.

Every answer is checked (status and the final ``output_ids``) and failures
are counted. It prints the figures and the ratios pd/agg (throughput) and
the latency P/D adds over the aggregated frontend. Note that a pair does
twice the engine work on a 2-core machine (two simulators per request) and
a P/D request waits for the KV hand-over over a real socket: the ratios
describe the whole path, simulators included.

Usage: ``.venv/bin/python bench/bench_pd.py [--protocol sglang|vllm] [--seconds 5] [--concurrency 8]
[--requests 200]``.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time

import httpx
import orjson

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support import start_frontend, start_sim  # noqa: E402

PROMPT = [((i * 37) % 3900) + 100 for i in range(128)]
OUTPUT_TOKENS = 16


PROTOCOL = "sglang"
PATHS = {"sglang": "/generate", "vllm": "/inference/v1/generate"}


def body(stream: bool) -> bytes:
    if PROTOCOL == "vllm":
        return orjson.dumps({"token_ids": PROMPT, "stream": stream,
                             "sampling_params": {"max_tokens": OUTPUT_TOKENS, "ignore_eos": True}})
    return orjson.dumps({"input_ids": PROMPT, "stream": stream,
                         "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True}})


def final_ids(resp_body: bytes, stream: bool) -> list[int] | None:
    if not stream:
        obj = orjson.loads(resp_body)
        return obj["choices"][0]["token_ids"] if PROTOCOL == "vllm" else obj.get("output_ids")
    events = [b[6:] for b in resp_body.split(b"\n\n") if b.startswith(b"data: ")]
    if len(events) < 2 or events[-1] != b"[DONE]":
        return None
    if PROTOCOL == "vllm":  # delta chunks
        return [t for e in events[:-1] for c in orjson.loads(e)["choices"] for t in c["token_ids"]]
    return orjson.loads(events[-2]).get("output_ids")


async def one(client: httpx.AsyncClient, url: str, stream: bool, want: list[int]) -> bool:
    resp = await client.post(url + PATHS[PROTOCOL], content=body(stream), headers={"content-type": "application/json"})
    return resp.status_code == 200 and final_ids(resp.content, stream) == want


async def latency(url: str, stream: bool, want: list[int], n: int) -> tuple[float, float, int]:
    """p50 and p90 in ms of ``n`` sequential requests, and the failures."""
    times, bad = [], 0
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            bad += not await one(client, url, stream, want)
            times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)], bad


async def throughput(url: str, stream: bool, want: list[int], seconds: float, conc: int) -> tuple[float, int]:
    """Requests/s of a closed loop, and the failures."""
    done = bad = 0
    stop = time.perf_counter() + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done, bad
        while time.perf_counter() < stop:
            ok = await one(client, url, stream, want)
            done += ok
            bad += not ok

    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(conc)))
        elapsed = time.perf_counter() - t0
    return done / elapsed, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--ttft-ms", type=float, default=0.0)
    ap.add_argument("--itl-ms", type=float, default=0.0)
    ap.add_argument("--protocol", choices=tuple(PATHS), default="sglang")
    args = ap.parse_args()
    global PROTOCOL
    PROTOCOL = proto = args.protocol
    timing = {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms}
    roles = (["--kv-role", "producer"], ["--kv-role", "consumer"]) if proto == "vllm" else (
        ["--disaggregation-mode", "prefill", "--bootstrap-port", "0"], ["--disaggregation-mode", "decode"])
    agg = start_sim(proto, **timing)
    prefill = start_sim(proto, **timing, extra=roles[0])
    decode = start_sim(proto, **timing, extra=roles[1])
    procs = [agg, prefill, decode]
    try:
        spec = f"vllm={prefill.url}"
        if proto == "sglang":
            port = httpx.get(prefill.url + "/get_server_info").json()["disaggregation_bootstrap_port"]
            spec = f"sglang={prefill.url}?bootstrap_port={port}"
        fe_agg = start_frontend([f"{proto}={agg.url}"], worker_class="asyncio")
        procs.append(fe_agg)
        fe_pd = start_frontend([], worker_class="asyncio", extra=[
            "--prefill", spec, "--decode", f"{proto}={decode.url}", "--disaggregation", "always"])
        procs.append(fe_pd)
        targets = {"direct": agg.url, "agg": fe_agg.url, "pd": fe_pd.url}
        want = final_ids(httpx.post(agg.url + PATHS[proto], content=body(False),
                                    headers={"content-type": "application/json"}).content, False)
        print(f"{proto}: prompt {len(PROMPT)} tokens, {OUTPUT_TOKENS} output tokens, simulator TTFT {args.ttft_ms:g} ms, "
              f"ITL {args.itl_ms:g} ms; {args.requests} sequential requests; {args.seconds:g} s at "
              f"{args.concurrency} connections")
        for stream in (False, True):
            kind = "SSE" if stream else "unary"
            lat = {name: asyncio.run(latency(url, stream, want, args.requests)) for name, url in targets.items()}
            rps: dict[str, float] = {}
            bad = sum(v[2] for v in lat.values())
            for name in ("agg", "pd", "direct"):
                rate, failed = asyncio.run(throughput(targets[name], stream, want, args.seconds, args.concurrency))
                rps[name], bad = rate, bad + failed
            print(f"\n{kind}:")
            print(f"  {'target':8} {'p50 ms':>8} {'p90 ms':>8} {'req/s':>8}")
            for name in targets:
                p50, p90, _ = lat[name]
                print(f"  {name:8} {p50:8.2f} {p90:8.2f} {rps[name]:8.0f}")
            print(f"  pd/agg throughput {rps['pd'] / rps['agg']:.2f}; P/D adds {lat['pd'][0] - lat['agg'][0]:+.2f} ms "
                  f"p50 over the aggregated frontend (which adds {lat['agg'][0] - lat['direct'][0]:+.2f} ms over "
                  f"direct); failed checks: {bad}")
    finally:
        for p in procs:
            p.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
