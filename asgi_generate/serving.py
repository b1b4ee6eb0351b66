"""Run an ASGI app under hypercorn, programmatically, on trio or asyncio.

Used by ``asgi-generate serve`` and ``asgi-generate sim``. SIGINT and SIGTERM
start hypercorn's graceful shutdown.
"""

from __future__ import annotations

import signal
from typing import Any

import anyio
from hypercorn.config import Config

WORKER_CLASSES = ("trio", "asyncio")


def hypercorn_config(
    *, host: str = "127.0.0.1", port: int = 8000, fd: int | None = None, graceful_timeout: float = 30.0
) -> Config:
    """A hypercorn config bound to ``host:port``, or to an inherited listening
    socket ``fd``; access log off (a trace record covers each request)."""
    config = Config()
    config.bind = [f"fd://{fd}"] if fd is not None else [f"{host}:{port}"]
    config.graceful_timeout = graceful_timeout
    config.accesslog = None
    config.errorlog = "-"
    config.keep_alive_timeout = 75
    return config


def run(app: Any, config: Config, worker_class: str = "asyncio") -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then shut down gracefully:
    hypercorn stops accepting, and ``app.begin_shutdown()`` (when the app has
    one) lets the app end its in-flight requests itself.

    Raises:
        ValueError: ``worker_class`` is neither ``trio`` nor ``asyncio``.
    """
    if worker_class not in WORKER_CLASSES:
        raise ValueError(f"worker class must be one of {WORKER_CLASSES}, not {worker_class!r}")

    async def until_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                begin = getattr(app, "begin_shutdown", None)
                if begin is not None:
                    begin()
                return

    async def main() -> None:
        if worker_class == "trio":
            from hypercorn.trio import serve
        else:
            from hypercorn.asyncio import serve
        await serve(app, config, shutdown_trigger=until_signal)

    anyio.run(main, backend=worker_class)
