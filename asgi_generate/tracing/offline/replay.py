"""``asgi-generate-trace replay``: send a recorded workload to a frontend again.

Input: request-end record files (the rows ``export-mooncake`` would make of
them, block size from the records) or a Mooncake trace (one JSON object per
line: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``;
the FAST'25 Mooncake traces use 512-token blocks, ``--block-size``).

Each row becomes one streamed request at its recorded arrival time divided
by ``speedup``, with at most ``max_concurrency`` in flight (a row that finds
none free waits, and its lateness shows in the latencies):

- prompt token ids are made from the row's block hash ids: block ``h`` is
  ``block_size`` ids drawn from ``random.Random(h)`` in
  ``[FIRST_TOKEN_ID, vocab_size)``, the prompt the row's blocks in order, cut
  to ``input_length``. Rows that shared a prefix (equal leading hash ids)
  share its tokens, so a prefix cache sees the same reuse, and rows that
  did not share one share nothing;
- the output length is the row's: SGLang ``max_new_tokens``, vLLM
  ``max_tokens``, with ``ignore_eos`` (at least 1 token);
- the request id is ``replay-<row index>`` (SGLang ``rid``, vLLM
  ``request_id``), so a replayed request's record names its row.

Per request it measures TTFT (to the first streamed event), the gaps between
events (ITL), end to end latency and the output tokens streamed; a request
is ok when it answered 200 and streamed a finish reason without an error.
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import anyio
import httpx
import orjson

from .rows import mooncake_rows, percentile
from .validate import read_jsonl

#: Token ids below this are left out of prompts (special tokens sit low in
#: small vocabularies, e.g. the simulator's BOS/EOS).
FIRST_TOKEN_ID = 100
#: Block size of the published Mooncake traces (FAST'25 artifact).
MOONCAKE_BLOCK_SIZE = 512
ROUTES = {"sglang": "/generate", "vllm": "/inference/v1/generate"}


@dataclass(slots=True)
class Row:
    """One request to replay: arrival ``timestamp`` in ms from the start,
    prompt and output lengths in tokens, prompt block hash ids."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(slots=True)
class Result:
    """What one replayed request did. Times in seconds from the replay's
    start (``start``: when it was sent; ``events``: when each streamed event
    came, with the output tokens streamed so far)."""

    index: int
    scheduled: float
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    error: str | None = None
    events: list[tuple[float, int]] = field(default_factory=list)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive streamed events, in seconds."""
        return [b[0] - a[0] for a, b in zip(self.events, self.events[1:])]


def load_rows(paths: Sequence[str], block_size: int | None = None) -> tuple[list[Row], int, int]:
    """The rows of record files or Mooncake traces, in arrival order.

    Returns:
        The rows, their block size (the records', else ``block_size``, else
        :data:`MOONCAKE_BLOCK_SIZE`) and the records skipped (no block
        hashes, or no engine attempt).

    Raises:
        ValueError: a line is not JSON, a file mixes records and rows, a
            row lacks a field, or records use several block sizes.
        OSError: a file cannot be read.
    """
    records, rows = [], []
    for where, obj in (item for path in paths for item in read_jsonl(path)):
        if isinstance(obj, ValueError):
            raise ValueError(f"{where}: {obj}")
        if isinstance(obj, dict) and obj.get("event_type") == "request_end":
            records.append(obj)
        elif isinstance(obj, dict) and {"timestamp", "input_length", "output_length", "hash_ids"} <= obj.keys():
            rows.append(Row(float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
                            [int(h) for h in obj["hash_ids"]]))
        else:
            raise ValueError(f"{where}: neither a request_end record nor a Mooncake row "
                             "(timestamp, input_length, output_length, hash_ids)")
    if records and rows:
        raise ValueError("the files mix request_end records and Mooncake rows; replay them separately")
    if records:
        exported, skipped, size = mooncake_rows(records)
        rows = [Row(float(r["timestamp"]), r["input_length"], r["output_length"], r["hash_ids"]) for r in exported]
        return rows, size or block_size or MOONCAKE_BLOCK_SIZE, skipped
    rows.sort(key=lambda r: r.timestamp)
    return rows, block_size or MOONCAKE_BLOCK_SIZE, 0


@functools.lru_cache(maxsize=65536)
def block_tokens(hash_id: int, block_size: int, vocab_size: int) -> tuple[int, ...]:
    """The token ids standing for block ``hash_id``: the same for the same
    arguments in every run and process (``random.Random`` seeded with an
    int is stable across Python versions)."""
    rng = random.Random(hash_id)
    return tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(block_size))


def prompt_tokens(row: Row, block_size: int, vocab_size: int) -> list[int]:
    """``row``'s prompt: its blocks' tokens in order, cut to its input
    length (a trace with fewer blocks than its length needs is padded with
    a block of its own, drawn from a seed no hash id uses)."""
    ids: list[int] = []
    for h in row.hash_ids:
        if len(ids) >= row.input_length:
            break
        ids += block_tokens(h, block_size, vocab_size)
    while len(ids) < row.input_length:
        ids += block_tokens(-1 - len(ids), block_size, vocab_size)
    return ids[: row.input_length]


def request_body(fmt: str, index: int, row: Row, block_size: int, vocab_size: int) -> bytes:
    """The streamed native request replaying ``row`` in format ``fmt``."""
    ids = prompt_tokens(row, block_size, vocab_size)
    out = max(1, row.output_length)
    if fmt == "sglang":
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": out, "ignore_eos": True},
                "stream": True, "rid": f"replay-{index}"}
    else:
        body = {"token_ids": ids, "sampling_params": {"max_tokens": out, "ignore_eos": True},
                "stream": True, "stream_options": {"include_usage": True}, "request_id": f"replay-{index}"}
    return orjson.dumps(body)


def _read_event(fmt: str, obj: dict, so_far: int) -> tuple[int, bool, str | None]:
    """Output tokens streamed so far, whether a finish reason came, and an
    in-band error, from one streamed event."""
    if "error" in obj:
        err = obj["error"]
        return so_far, False, (err.get("message") if isinstance(err, dict) else str(err)) or "error"
    if fmt == "sglang":
        meta = obj.get("meta_info", {})
        return meta.get("completion_tokens", so_far), meta.get("finish_reason") is not None, None
    choices = obj.get("choices") or []
    added = sum(len(c.get("token_ids") or []) for c in choices)
    return so_far + added, any(c.get("finish_reason") for c in choices), None


async def _one(client: httpx.AsyncClient, fmt: str, body: bytes, res: Result, t0: float) -> None:
    res.start = time.monotonic() - t0
    finished = False
    try:
        async with client.stream("POST", ROUTES[fmt], content=body,
                                 headers={"content-type": "application/json"}) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"http {resp.status_code}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic() - t0
                tokens, done, err = _read_event(fmt, orjson.loads(line[6:]), res.output_tokens)
                if err is not None:
                    res.error = "in-band error"
                    return
                if res.ttft is None:
                    res.ttft = now - res.start
                res.output_tokens = tokens
                res.events.append((now, tokens))
                finished = finished or done
        if not finished:
            res.error = "no finish reason"
    except httpx.TimeoutException:
        res.error = "timeout"
    except httpx.TransportError as exc:
        res.error = "connect" if isinstance(exc, httpx.ConnectError) else "transport"
    finally:
        res.e2e = time.monotonic() - t0 - res.start


async def replay(
    rows: Sequence[Row],
    block_size: int,
    url: str,
    *,
    fmt: str = "sglang",
    speedup: float = 1.0,
    max_concurrency: int = 256,
    timeout: float = 600.0,
    vocab_size: int = 4096,
    verify: bool | str = True,
    progress=None,
) -> tuple[list[Result], float]:
    """Replay ``rows`` against the frontend at ``url`` (module docstring).

    Args:
        fmt: ``sglang`` or ``vllm`` (the native route used).
        speedup: arrival times are divided by it.
        max_concurrency: requests in flight at most (and connections open).
        timeout: seconds each request may wait for any one read.
        verify: TLS verification (a CA file's path, or ``False``).
        progress: called with each finished :class:`Result`.

    Returns:
        One result per row, in row order, and the replay's wall time in s.
    """
    results = [Result(i, row.timestamp / 1000.0 / speedup) for i, row in enumerate(rows)]
    limiter = anyio.CapacityLimiter(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)

    async def run(index: int, token: object) -> None:
        try:
            body = request_body(fmt, index, rows[index], block_size, vocab_size)
            await _one(client, fmt, body, results[index], t0)
        finally:
            limiter.release_on_behalf_of(token)
        if progress is not None:
            progress(results[index])

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, verify=verify) as client:
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for res in results:
                await anyio.sleep(max(0.0, res.scheduled - (time.monotonic() - t0)))
                token = object()
                await limiter.acquire_on_behalf_of(token)
                tg.start_soon(run, res.index, token)
        return results, time.monotonic() - t0


def summary(results: Sequence[Result], rows: Sequence[Row], wall: float) -> str:
    """The end-of-replay summary, as text (latencies in ms)."""
    ok = [r for r in results if r.error is None]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    out_tokens = sum(r.output_tokens for r in results)
    in_tokens = sum(rows[r.index].input_length for r in ok)
    lines = [
        f"sent {len(results)}, ok {len(ok)}, errors {len(results) - len(ok)}",
        f"wall {wall:.2f} s, {len(ok) / wall if wall else 0:.2f} requests/s, "
        f"output {out_tokens / wall if wall else 0:.1f} tokens/s, input {in_tokens / wall if wall else 0:.1f} tokens/s",
        f"latency ms {'n':>9} {'p50':>10} {'p90':>10} {'p99':>10}",
    ]
    for name, values in latency_series(ok).items():
        cells = "".join(f" {percentile(values, p) * 1000:>10.1f}" for p in (50, 90, 99)) if values else ""
        lines.append(f"  {name:<8} {len(values):>9}{cells}")
    if errors:
        lines.append("errors:")
        lines += [f"  {kind:<24} {n:>8}" for kind, n in sorted(errors.items(), key=lambda kv: (-kv[1], kv[0]))]
    return "\n".join(lines)


def latency_series(results: Iterable[Result]) -> dict[str, list[float]]:
    """TTFT, ITL and E2E samples in seconds (ITL: every gap between events)."""
    results = list(results)
    return {
        "ttft": [r.ttft for r in results if r.ttft is not None],
        "itl": [gap for r in results for gap in r.itls],
        "e2e": [r.e2e for r in results if r.e2e is not None],
    }
