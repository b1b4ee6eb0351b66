"""An ASGI app that cuts off a client that stops reading, with our
hypercorn's connection reset (the scope extension
``asgi_generate.connection_reset``), served by
:func:`asgi_generate.server.serving.run`:
``python tests/reset_app.py --fd FD --worker-class CLASS``.

``GET /stream`` sends 64 KiB chunks until one send has waited 0.5 s, then
resets the connection from another task and waits for that send to return.
``GET /cut`` answers what happened, as JSON: ``{"reset": bool,
"returned_s": seconds from the reset to the stuck send's return, or
null}``."""

from __future__ import annotations

import anyio
from state_app import answer_json, lifespan, main

from asgi_generate.request.watchdog import CONNECTION_RESET

#: What the last ``/stream`` saw.
CUT: dict = {"reset": False, "returned_s": None}
CHUNK = b"x" * 65536


async def _stream(scope: dict, send) -> None:
    reset = scope["extensions"][CONNECTION_RESET]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    since: list[float] = []

    async def cut_off() -> None:
        while not since or anyio.current_time() - since[0] < 0.5:
            await anyio.sleep(0.05)
        CUT["at"] = anyio.current_time()
        reset()
        CUT["reset"] = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(cut_off)
        while not CUT["reset"]:
            since[:] = [anyio.current_time()]
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            since.clear()
        CUT["returned_s"] = anyio.current_time() - CUT["at"]


async def app(scope: dict, receive, send) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    if scope["path"] == "/stream":
        await _stream(scope, send)
        return
    await answer_json(send, {"reset": CUT["reset"], "returned_s": CUT["returned_s"]})


if __name__ == "__main__":
    main(app, __doc__)
