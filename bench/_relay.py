"""The relay hop of bench_hop_split.py: a byte relay with no HTTP in it.

Each client connection accepted on ``--fd`` gets its own connection to
``127.0.0.1:--upstream`` (the simulator); the bytes each side sends are
written to the other as they come (asyncio ``Protocol``s, ``TCP_NODELAY``
on both sockets as asyncio sets it). Per unary request it makes the system
calls any hop must: the client's read and write, the engine's write and
read, and the loop's waits; so its CPU per request is what a second TCP
connection costs on this kernel (its system time) plus a minimal asyncio
loop's turns (its user time), with nothing parsed.

Run as ``python bench/_relay.py --fd N --upstream PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import socket


class _Upstream(asyncio.Protocol):
    """The engine side: what it sends goes to the client."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Client(asyncio.Protocol):
    """The client side: its bytes wait for the engine connection, then
    pass through."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.upstream: asyncio.Transport | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(lambda: _Upstream(self.transport), "127.0.0.1",
                                                       self.upstream_port)
        except OSError:
            self.transport.close()
            return
        self.upstream = upstream
        for data in self.pending:
            upstream.write(data)
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.pending.append(data)
        else:
            self.upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def _serve(fd: int, upstream_port: int) -> None:
    sock = socket.socket(fileno=fd)
    server = await asyncio.get_running_loop().create_server(lambda: _Client(upstream_port), sock=sock)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fd", type=int, required=True, help="the listening socket")
    p.add_argument("--upstream", type=int, required=True, help="the simulator's port on 127.0.0.1")
    args = p.parse_args()
    asyncio.run(_serve(args.fd, args.upstream))


if __name__ == "__main__":
    main()
