"""A Python keep-alive client for the benchmarks that run without wrk
(bench_tracing.py, bench_migration.py): one connection POSTs a fixed raw
request again and again until a deadline, checking each answer."""

from __future__ import annotations

import asyncio
import time


async def keepalive_client(port: int, request: bytes, stop_at: float, done: list[int],
                           stream: bool = False) -> None:
    """Send ``request`` (a whole raw HTTP/1.1 request) on one connection to
    127.0.0.1:``port`` until ``stop_at`` (``time.monotonic()``), one at a
    time, adding each answer to ``done[0]``. It connects again when an
    answer says ``connection: close`` (hypercorn closes a connection after
    ``keep_alive_max_requests``, 1,000).

    Args:
        stream: the answer is a chunked SSE stream, read to its last chunk
            and checked to end with ``data: [DONE]``; else a fixed-length body.

    Raises:
        RuntimeError: an answer is not 200, or a stream does not end with
            ``[DONE]``.
        asyncio.IncompleteReadError: the server closed a connection it did
            not say it would close.
    """
    while time.monotonic() < stop_at:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        try:
            while time.monotonic() < stop_at:
                writer.write(request)
                head = (await reader.readuntil(b"\r\n\r\n")).lower()
                if not head.startswith(b"http/1.1 200"):
                    raise RuntimeError(f"bad answer: {head[:200]!r}")
                if stream:
                    body = await reader.readuntil(b"\r\n0\r\n\r\n")
                    if b"data: [DONE]\n\n" not in body[-64:]:
                        raise RuntimeError(f"stream did not end with [DONE]: {body[-200:]!r}")
                else:
                    length = int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
                    await reader.readexactly(length)
                done[0] += 1
                if b"\r\nconnection: close\r\n" in head:
                    break
        finally:
            writer.close()
