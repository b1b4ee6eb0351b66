"""Whole-answer checks: a sample of requests sent concurrently through a hop
must get, event for event, the same values the simulator gives directly.

Timing and id fields (``meta_info.id``, ``meta_info.e2e_latency``) and the
prefix cache's hit (``meta_info.cached_tokens``: the simulator caches by
default, so a prompt sent again is a hit) are left out of the comparison;
everything else, every event, in order, must match.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import orjson

from _procs import http_request


def _normalized(obj: dict) -> dict:
    meta = obj.get("meta_info")
    if isinstance(meta, dict):
        meta = {k: v for k, v in meta.items() if k not in ("id", "e2e_latency", "cached_tokens")}
        obj = {**obj, "meta_info": meta}
    return obj


def answer(port: int, body: bytes) -> list:
    """POST ``body`` to ``/generate``; the normalized unary object as a
    one-item list, or every SSE event in order (``"[DONE]"`` included).

    Raises:
        RuntimeError: a status other than 200.
    """
    status, raw = http_request(port, "POST", "/generate", body)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {raw[:300]!r}")
    if not orjson.loads(body).get("stream"):
        return [_normalized(orjson.loads(raw))]
    events: list = []
    for block in raw.split(b"\n\n"):
        data = [line[6:] for line in block.split(b"\n") if line.startswith(b"data: ")]
        if data:
            payload = b"\n".join(data)
            events.append("[DONE]" if payload == b"[DONE]" else _normalized(orjson.loads(payload)))
    return events


def check_direct(events: list, tokens: int, stream: bool) -> None:
    """Check the simulator's own answer has the shape the benchmark relies
    on: ``tokens`` tokens, and for SSE one cumulative event per token, in
    order, then ``[DONE]``.

    Raises:
        RuntimeError: it does not.
    """
    if not stream:
        final = events[0]
        if len(final["output_ids"]) != tokens:
            raise RuntimeError(f"direct unary answer has {len(final['output_ids'])} tokens, want {tokens}")
        return
    if events[-1] != "[DONE]" or len(events) != tokens + 1:
        raise RuntimeError(f"direct SSE answer has {len(events) - 1} events, want {tokens} and [DONE]")
    final = events[-2]["output_ids"]
    for i, event in enumerate(events[:-1]):
        if event["output_ids"] != final[: i + 1] or event["meta_info"]["completion_tokens"] != i + 1:
            raise RuntimeError(f"direct SSE event {i + 1} is not the cumulative prefix")


def compare(port: int, bodies: list[bytes], expected: list[list], concurrency: int) -> list[str]:
    """Send ``bodies`` to ``port`` (``concurrency`` at a time) and compare
    each answer with ``expected``; return a description of each mismatch."""

    def one(i: int) -> str | None:
        try:
            got = answer(port, bodies[i])
        except (OSError, RuntimeError, orjson.JSONDecodeError) as exc:
            return f"sample {i}: {exc}"
        want = expected[i]
        if got == want:
            return None
        if len(got) != len(want):
            return f"sample {i}: {len(got)} events, want {len(want)}"
        first = next(j for j, (g, w) in enumerate(zip(got, want)) if g != w)
        return f"sample {i}: event {first} differs: {str(got[first])[:200]} != {str(want[first])[:200]}"

    with ThreadPoolExecutor(concurrency) as pool:
        return [m for m in pool.map(one, range(len(bodies))) if m is not None]
