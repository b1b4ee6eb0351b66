"""An ASGI app that shows what each request sees of the lifespan state,
served by :func:`asgi_generate.server.serving.run` (hypercorn with our
patches): ``python tests/state_app.py --fd FD --worker-class CLASS``.

Its lifespan sets ``started`` in the state; ``GET /mutate`` adds
``mutated`` to its request's ``scope["state"]``; every answer is the JSON
list of the state's keys as its request saw them, before any change."""

from __future__ import annotations

import argparse
import json

from asgi_generate.server.serving import WORKER_CLASSES, hypercorn_config, run


async def app(scope: dict, receive, send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                scope["state"]["started"] = True
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    state = scope["state"]
    seen = sorted(state)
    if scope["path"] == "/mutate":
        state["mutated"] = True
    await answer_json(send, seen)


async def lifespan(receive, send) -> None:
    """A lifespan that keeps no state: startup and shutdown completed."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def answer_json(send, obj) -> None:
    """Answer ``obj`` as a JSON body, 200."""
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main(app=app, doc: str = __doc__) -> None:
    """Serve ``app`` on the ``--fd`` and ``--worker-class`` of the command
    line (``doc``'s first paragraph its description)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="an inherited listening socket")
    parser.add_argument("--worker-class", choices=WORKER_CLASSES, required=True)
    args = parser.parse_args()
    run(app, hypercorn_config(fd=args.fd, graceful_timeout=1.0, log_level="warning"), args.worker_class)


if __name__ == "__main__":
    main()
