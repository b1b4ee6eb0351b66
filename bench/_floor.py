"""The floor hop of bench_frontend.py: hypercorn, configured as ``serve``
configures it (worker class, connection fixes, no access log), serving a
fixed answer with no engine behind it. What a hop costs beyond this is
ours (handler, codec, worker client, pool, metrics); this much is
hypercorn's and the event loop's.

Run as ``python bench/_floor.py --fd N --worker-class asyncio --unary FILE
--sse FILE``: ``POST /generate`` reads the whole body, then answers the
bytes of ``--unary`` (one ``content-length`` answer), or, for a body with
``"stream": true``, each line of ``--sse`` (one SSE event, ``data: ...``)
as its own write (the simulator writes one event per token, and so does
a hop that forwards each as it comes). ``GET /health`` answers 200.
"""

from __future__ import annotations

import argparse
import pathlib

from asgi_generate.request.framing import SSE_HEADERS
from asgi_generate.server.serving import WORKER_CLASSES, hypercorn_config, run

JSON_HEADERS = [(b"content-type", b"application/json")]


class FloorApp:
    """The fixed-answer ASGI app (``unary``: the body; ``events``: SSE
    events, each framed ``data: ...\\n\\n``)."""

    def __init__(self, unary: bytes, events: list[bytes]) -> None:
        self.unary_start = {
            "type": "http.response.start", "status": 200,
            "headers": [*JSON_HEADERS, (b"content-length", str(len(unary)).encode())],
        }
        self.unary_body = {"type": "http.response.body", "body": unary, "more_body": False}
        self.events = events

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["method"] == "POST" and b'"stream":true' in body:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            last = len(self.events) - 1
            for i, event in enumerate(self.events):
                await send({"type": "http.response.body", "body": event, "more_body": i < last})
            return
        if scope["method"] == "POST":
            await send(self.unary_start)
            await send(self.unary_body)
            return
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": b"{}"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--worker-class", choices=WORKER_CLASSES, default="asyncio")
    p.add_argument("--unary", type=pathlib.Path, required=True, help="the unary answer's bytes")
    p.add_argument("--sse", type=pathlib.Path, required=True, help="SSE events, one data: line each")
    args = p.parse_args()
    events = [line + b"\n\n" for line in args.sse.read_bytes().split(b"\n") if line]
    run(FloorApp(args.unary.read_bytes(), events), hypercorn_config(fd=args.fd, log_level="warning"),
        args.worker_class)


if __name__ == "__main__":
    main()
