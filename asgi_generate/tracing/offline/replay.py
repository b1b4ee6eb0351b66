"""``asgi-generate-trace replay``: send a recorded workload to a frontend again.

Input: request-end record files (the rows ``export-mooncake`` would make of
them, block size from the records) or a Mooncake trace (one JSON object per
line: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``,
and ``block_size`` as ``export-mooncake`` writes it). The block size is the
file's; a trace without one (the FAST'25 traces use 512-token blocks) needs
``--block-size``, and one that disagrees with the file is refused: blocks of
another size would share other prefixes than the recording did.

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
  ``request_id``), so a replayed request's record names its row;
- a record whose status is ``client_disconnect`` is replayed as its client
  did it: the request asks one token more than the record's
  ``output_tokens`` (the tokens that client was sent) and the replay
  leaves (closes the connection) once it was streamed that many; a client
  that was sent none leaves at the first streamed event, unread, or at the
  record's ``total_ms`` after sending, whichever comes first.

Per request it measures TTFT (to the first streamed event), the gaps between
events (ITL), end to end latency and the output tokens streamed; a request
is ok when it answered 200 and streamed a finish reason without an error;
a recorded disconnect replayed up to its point counts as a client
disconnect, neither ok nor an error. Replaying records, the summary sets
the recording's figures beside the replay's (:func:`comparison`).
"""

from __future__ import annotations

import functools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import anyio
import httpx
import orjson

from ...protocols import PROTOCOLS
from .rows import exportable, mooncake_rows, percentile
from .validate import read_jsonl

#: Token ids below this are left out of prompts (special tokens sit low in
#: small vocabularies, e.g. the simulator's BOS/EOS).
FIRST_TOKEN_ID = 100
#: Block size of the published Mooncake traces (FAST'25 artifact), which
#: their rows do not carry.
MOONCAKE_BLOCK_SIZE = 512


@dataclass(slots=True)
class Row:
    """One request to replay: arrival ``timestamp`` in ms from the start,
    prompt and output lengths in tokens, prompt block hash ids; for a
    recorded client disconnect, the output tokens its client was sent before
    it left (``leave_after_tokens``) and the record's ``total_ms``
    (``leave_after_ms``, read when that client was sent no token)."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    leave_after_tokens: int | None = None
    leave_after_ms: float | None = None


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
    #: What the error said: the in-band error's message, the HTTP error body
    #: or the transport error, cut to :data:`DETAIL_CHARS`.
    detail: str | None = None
    events: list[tuple[float, int]] = field(default_factory=list)
    #: The replay left at the row's recorded disconnect point.
    disconnected: bool = False

    @property
    def ok(self) -> bool:
        """Answered 200 and streamed a finish reason, with no error and no
        planned disconnect."""
        return self.error is None and not self.disconnected

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive streamed events, in seconds."""
        return [b[0] - a[0] for a, b in zip(self.events, self.events[1:])]


#: Characters of an error's text kept in :attr:`Result.detail`.
DETAIL_CHARS = 200


@dataclass(slots=True)
class Workload:
    """What to replay: the rows in arrival order, their block size (tokens
    per hash id), the records skipped (no block hashes, or no engine
    attempt) and, replaying records, the records the rows were made of, in
    row order (``None`` for a Mooncake trace)."""

    rows: list[Row]
    block_size: int
    skipped: int = 0
    recorded: list[dict] | None = None


def load_rows(paths: Sequence[str], block_size: int | None = None) -> Workload:
    """The workload of record files or Mooncake traces.

    Args:
        block_size: ``--block-size``: the tokens per hash id of a trace
            whose rows carry none; where the file says, it must agree.

    Raises:
        ValueError: a line is not JSON, a file mixes records and rows, a
            row lacks a field, records or rows use several block sizes, the
            file's block size is not ``block_size``, or neither says one.
        OSError: a file cannot be read.
    """
    records, rows, sizes = [], [], set()
    for where, obj in (item for path in paths for item in read_jsonl(path)):
        if isinstance(obj, ValueError):
            raise ValueError(f"{where}: {obj}")
        if isinstance(obj, dict) and obj.get("event_type") == "request_end":
            records.append(obj)
        elif isinstance(obj, dict) and {"timestamp", "input_length", "output_length", "hash_ids"} <= obj.keys():
            size = obj.get("block_size")
            if size is not None and (type(size) is not int or size < 1):
                raise ValueError(f"{where}: block_size must be a positive integer, not {size!r}")
            rows.append(Row(float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
                            [int(h) for h in obj["hash_ids"]]))
            sizes.add(size)
        else:
            raise ValueError(f"{where}: neither a request_end record nor a Mooncake row "
                             "(timestamp, input_length, output_length, hash_ids)")
    if records and rows:
        raise ValueError("the files mix request_end records and Mooncake rows; replay them separately")
    recorded = None
    if records:
        recorded, skipped = exportable(records)
        exported, _, size = mooncake_rows(recorded)
        rows = [Row(float(r["timestamp"]), r["input_length"], r["output_length"], r["hash_ids"], *_leaves(rec))
                for r, rec in zip(exported, recorded)]
        sizes = {size}
    else:
        skipped = 0
        rows.sort(key=lambda r: r.timestamp)
    if len(sizes - {None}) > 1:
        raise ValueError(f"the rows use several block sizes {sorted(sizes - {None})}; replay them separately")
    if None in sizes and len(sizes) > 1:
        raise ValueError("some rows carry a block_size and some do not; replay them separately")
    size = next(iter(sizes), None)
    if size is not None and block_size is not None and size != block_size:
        raise ValueError(f"--block-size {block_size} disagrees with the file's block size {size}")
    size = size or block_size
    if size is None and rows:
        raise ValueError(f"the trace carries no block_size: give --block-size (the FAST'25 Mooncake traces "
                         f"use {MOONCAKE_BLOCK_SIZE})")
    return Workload(rows, size or MOONCAKE_BLOCK_SIZE, skipped, recorded)


def _leaves(record: dict) -> tuple[int | None, float | None]:
    """``(leave_after_tokens, leave_after_ms)`` of a record: where its client
    left, for a ``client_disconnect``; ``(None, None)`` otherwise."""
    if record.get("status") != "client_disconnect":
        return None, None
    return record.get("output_tokens", 0), record.get("total_ms")


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
    """The streamed native request replaying ``row`` in format ``fmt``: a
    recorded disconnect asks one token more than its client was sent, so
    that it cannot end before the point where the client left."""
    ids = prompt_tokens(row, block_size, vocab_size)
    out = max(1, row.output_length) if row.leave_after_tokens is None else row.leave_after_tokens + 1
    body = PROTOCOLS[fmt].replay_body(ids, out, f"replay-{index}")  # type: ignore[misc]
    return orjson.dumps(body)


def _read_event(fmt: str, obj: dict, so_far: int) -> tuple[int, bool, str | None]:
    """Output tokens streamed so far, whether a finish reason came, and an
    in-band error, from one streamed event."""
    if "error" in obj:
        err = obj["error"]
        return so_far, False, (err.get("message") if isinstance(err, dict) else str(err)) or "error"
    tokens, done = PROTOCOLS[fmt].replay_progress(obj, so_far)  # type: ignore[misc]
    return tokens, done, None


async def _one(client: httpx.AsyncClient, fmt: str, row: Row, body: bytes, res: Result, t0: float) -> None:
    res.start = time.monotonic() - t0
    leave_at = row.leave_after_tokens
    patience = math.inf
    if leave_at == 0 and row.leave_after_ms is not None:
        patience = row.leave_after_ms / 1000.0
    with anyio.move_on_after(patience) as waited:
        await _stream(client, fmt, leave_at, body, res, t0)
    if waited.cancelled_caught:
        res.disconnected = True


async def _stream(client: httpx.AsyncClient, fmt: str, leave_at: int | None, body: bytes, res: Result,
                  t0: float) -> None:
    """Send ``body``, read its stream into ``res``; with ``leave_at``
    tokens, close the connection once that many were streamed (at the
    first event, unread, for 0)."""
    finished = False
    try:
        async with client.stream("POST", PROTOCOLS[fmt].generate_path, content=body,
                                 headers={"content-type": "application/json"}) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                res.error = f"http {resp.status_code}"
                res.detail = body[:DETAIL_CHARS].decode("utf-8", "replace")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic() - t0
                if leave_at == 0:
                    res.disconnected = True
                    return
                tokens, done, err = _read_event(fmt, orjson.loads(line[6:]), res.output_tokens)
                if err is not None:
                    res.error = "in-band error"
                    res.detail = err[:DETAIL_CHARS]
                    return
                if res.ttft is None:
                    res.ttft = now - res.start
                res.output_tokens = tokens
                res.events.append((now, tokens))
                finished = finished or done
                if leave_at is not None and tokens >= leave_at:
                    res.disconnected = True
                    return
        if not finished:
            res.error = "no finish reason"
    except httpx.TimeoutException as exc:
        res.error = "timeout"
        res.detail = (str(exc) or type(exc).__name__)[:DETAIL_CHARS]
    except httpx.TransportError as exc:
        res.error = "connect" if isinstance(exc, httpx.ConnectError) else "transport"
        res.detail = (str(exc) or type(exc).__name__)[:DETAIL_CHARS]
    finally:
        res.e2e = time.monotonic() - t0 - res.start


async def replay(
    rows: Sequence[Row],
    block_size: int,
    url: str,
    *,
    fmt: str,
    speedup: float = 1.0,
    max_concurrency: int = 256,
    timeout: float = 600.0,
    vocab_size: int = 4096,
    verify: bool | str = True,
    progress=None,
) -> tuple[list[Result], float]:
    """Replay ``rows`` against the frontend at ``url`` (module docstring).

    Args:
        fmt: the engine whose native generate route and body are used
            (:attr:`~asgi_generate.protocols.WorkerProtocol.generate_path`,
            ``replay_body``): ``sglang`` or ``vllm``.
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
            await _one(client, fmt, rows[index], body, results[index], t0)
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


def errors_by_kind(results: Iterable[Result]) -> list[tuple[str, int, str]]:
    """The failed requests by kind, most first: ``(kind, count, the first
    one's detail)``."""
    kinds: dict[str, list] = {}
    for r in results:
        if r.error is not None:
            kinds.setdefault(r.error, [0, r.detail or ""])[0] += 1
    return [(kind, n, detail) for kind, (n, detail) in sorted(kinds.items(), key=lambda kv: (-kv[1][0], kv[0]))]


def comparison(results: Sequence[Result], recorded: Sequence[dict]) -> list[tuple[str, str, str]]:
    """The recording's figures beside the replay's: ``(what, recorded,
    replayed)`` for the requests ok, the client disconnects (recorded
    ``client_disconnect``; replayed: left at that record's point), the
    output tokens and the p50 and
    p99 of TTFT, end-to-end latency and each request's mean ITL (ms; the
    recorded mean ITL is the record's ``mean_itl_ms``). ``-`` where a side
    has no sample."""
    ok = [r for r in results if r.ok]
    were_ok = [rec for rec in recorded if rec.get("status") == "ok"]
    left = sum(rec.get("status") == "client_disconnect" for rec in recorded)
    mine = latency_series(ok)
    mine["mean itl"] = [sum(r.itls) / len(r.itls) for r in ok if r.itls]
    theirs = {name: [rec[key] / 1000.0 for rec in were_ok if rec.get(key) is not None]
              for name, key in (("ttft", "ttft_ms"), ("e2e", "total_ms"), ("mean itl", "mean_itl_ms"))}
    lines = [("requests ok", str(len(were_ok)), str(len(ok))),
             ("client disconnects", str(left), str(sum(r.disconnected for r in results))),
             ("output tokens", str(sum(rec.get("output_tokens", 0) for rec in recorded)),
              str(sum(r.output_tokens for r in results)))]
    for name in ("ttft", "e2e", "mean itl"):
        for p in (50, 99):
            cells = [f"{percentile(v, p) * 1000:.1f}" if v else "-" for v in (theirs[name], mine[name])]
            lines.append((f"{name} p{p} ms", *cells))
    return lines


def summary(results: Sequence[Result], rows: Sequence[Row], wall: float,
            recorded: Sequence[dict] | None = None) -> str:
    """The end-of-replay summary, as text (latencies in ms); with the
    ``recorded`` records the rows were made of, their figures beside the
    replay's (:func:`comparison`)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in results)
    in_tokens = sum(rows[r.index].input_length for r in ok)
    left = sum(r.disconnected for r in results)
    lines = [
        f"sent {len(results)}, ok {len(ok)}, client disconnects {left}, errors {len(results) - len(ok) - left}",
        f"wall {wall:.2f} s, {len(ok) / wall if wall else 0:.2f} requests/s, "
        f"output {out_tokens / wall if wall else 0:.1f} tokens/s, input {in_tokens / wall if wall else 0:.1f} tokens/s",
        f"latency ms {'n':>9} {'p50':>10} {'p90':>10} {'p99':>10}",
    ]
    for name, values in latency_series(ok).items():
        cells = "".join(f" {percentile(values, p) * 1000:>10.1f}" for p in (50, 90, 99)) if values else ""
        lines.append(f"  {name:<8} {len(values):>9}{cells}")
    if recorded is not None:
        lines.append(f"recorded vs replayed {'recorded':>11} {'replayed':>10}")
        lines += [f"  {what:<18} {was:>11} {now:>10}" for what, was, now in comparison(results, recorded)]
    errors = errors_by_kind(results)
    if errors:
        lines.append("errors:")
        lines += [f"  {kind:<24} {n:>8}" for kind, n, _ in errors]
    return "\n".join(lines)


def latency_series(results: Iterable[Result]) -> dict[str, list[float]]:
    """TTFT, ITL and E2E samples in seconds (ITL: every gap between events)."""
    results = list(results)
    return {
        "ttft": [r.ttft for r in results if r.ttft is not None],
        "itl": [gap for r in results for gap in r.itls],
        "e2e": [r.e2e for r in results if r.e2e is not None],
    }
