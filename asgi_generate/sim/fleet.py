"""Many simulated workers in one process (``asgi-generate sim --workers N``).

A fleet of hundreds of engines does not fit on a small machine as hundreds
of processes (an interpreter each, about 30 MB); as one process it does.
:class:`SimFleet` is one ASGI app over N :class:`~asgi_generate.sim.app.SimApp`
workers, each served on a listening socket of its own: a request goes to the
worker whose socket accepted it (the ASGI scope's ``server`` port). Every
worker keeps its own engine, prefix cache, faults, counters, capacity model
and weights, so it answers exactly what a process of its own answers; only
the tokenizer, which no request changes, is shared.
"""

from __future__ import annotations

import anyio

from .framing import Receive, Send
from .app import SimApp


class SimFleet:
    """ASGI app of several simulated workers, one per listening port.

    Args:
        workers: the workers by the local port of the socket that serves
            each (the ASGI scope's ``server[1]``).

    Raises:
        ValueError: no workers.
    """

    def __init__(self, workers: dict[int, SimApp]) -> None:
        if not workers:
            raise ValueError("a fleet needs at least one worker")
        self.workers = workers

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        server = scope.get("server")
        worker = self.workers.get(server[1]) if server else None
        if worker is None:  # a socket no worker was given: a server set up wrong
            raise RuntimeError(f"no simulated worker serves {server!r}")
        await worker(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Pass each lifespan message to every worker's own lifespan and
        answer once all of them completed it."""
        n = len(self.workers)
        async with anyio.create_task_group() as tg:
            inboxes = []
            replies_in, replies = anyio.create_memory_object_stream[dict](n)
            for worker in self.workers.values():
                inbox_in, inbox = anyio.create_memory_object_stream[dict](1)
                inboxes.append(inbox_in)
                tg.start_soon(worker, {"type": "lifespan"}, inbox.receive, replies_in.send)
            while True:
                message = await receive()
                for inbox_in in inboxes:
                    await inbox_in.send(message)
                for _ in range(n):
                    await replies.receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    break
