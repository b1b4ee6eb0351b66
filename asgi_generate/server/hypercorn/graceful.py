"""The app told when hypercorn's graceful shutdown begins, installed by
:func:`asgi_generate.server.hypercorn.patches.install` on every worker class.

hypercorn 0.18.0 (``worker_serve`` in ``hypercorn/trio/run.py`` and
``hypercorn/asyncio/run.py``) stops accepting, gives the open connections
``graceful_timeout`` seconds, cancels what is left, and only then sends the
app ``lifespan.shutdown``, as the ASGI lifespan spec orders it. An app
streaming long answers learns of the shutdown only as its tasks are
cancelled, too late to end a stream the way its format ends one (an error
event and the terminal marker). Here, as the graceful shutdown begins, an
app with a ``begin_shutdown(grace)`` method (e.g.
:meth:`asgi_generate.server.app.App.begin_shutdown`) is called with
``graceful_timeout``, the seconds before hypercorn cancels its requests: the
same call :func:`asgi_generate.server.serving.run` makes under ``serve``.
``lifespan.shutdown`` still comes last.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.run import worker_serve as _hypercorn_trio_worker_serve
from hypercorn.utils import wrap_app


def begin_shutdown(app: Any, config: Config) -> None:
    """Call ``begin_shutdown(config.graceful_timeout)`` of ``app`` (hypercorn's
    app wrapper, or the app itself) if it has one."""
    inner = app.app if isinstance(app, ASGIWrapper) else app
    begin = getattr(inner, "begin_shutdown", None)
    if begin is not None:
        begin(config.graceful_timeout)


def announcing(app: Any, config: Config, trigger: Callable[..., Awaitable[Any]]) -> Callable[[], Awaitable[None]]:
    """``trigger`` (hypercorn's ``shutdown_trigger``: returns to start the
    graceful shutdown) that tells ``app`` (:func:`begin_shutdown`) as it
    returns."""

    async def shutdown_trigger() -> None:
        await trigger()
        begin_shutdown(app, config)

    return shutdown_trigger


async def trio_worker_serve(app: Any, config: Config, *, sockets: Any = None,
                            shutdown_trigger: Callable[..., Awaitable[Any]] | None = None,
                            task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """hypercorn's trio ``worker_serve`` (same arguments) whose shutdown
    trigger tells the app (:func:`announcing`)."""
    if shutdown_trigger is not None:
        shutdown_trigger = announcing(app, config, shutdown_trigger)
    await _hypercorn_trio_worker_serve(app, config, sockets=sockets, shutdown_trigger=shutdown_trigger,
                                       task_status=task_status)


async def trio_serve(app: Any, config: Config, *,
                     shutdown_trigger: Callable[..., Awaitable[Any]] | None = None) -> None:
    """hypercorn's ``hypercorn.trio.serve`` on :func:`trio_worker_serve`."""
    await trio_worker_serve(wrap_app(app, config.wsgi_max_body_size, None), config,
                            shutdown_trigger=shutdown_trigger)
