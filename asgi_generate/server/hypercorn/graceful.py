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

The connections, as the shutdown begins (on both worker classes):

- Every answer that starts from then on says ``connection: close``
  (hypercorn's own, as at its ``keep_alive_max_requests``; over h2, a
  GOAWAY after the next request): a client that pools connections learns
  that this one ends with the answer, and sends its next request on a new
  one (refused: the listener is closed) instead of racing the close.
- A keep-alive connection idle between requests is closed at once, as
  nginx, uvicorn and hypercorn itself do: none of a request sent on it is
  read, so the client sees the connection end before any byte of an answer
  (an EOF or a reset) and may send the request again elsewhere, a POST
  included (:func:`request_begun`).
- One on which a request has begun (part of it read, or its bytes waiting
  in the socket) is not idle: the request is read and answered (503 in its
  format's shape, with ``connection: close``), never cut off half read.
"""

from __future__ import annotations

import fcntl
import struct
import termios
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.run import worker_serve as _hypercorn_trio_worker_serve
from hypercorn.utils import wrap_app


def begin_shutdown(app: Any, config: Config) -> None:
    """Make every answer from now on say ``connection: close``, then call
    ``begin_shutdown(config.graceful_timeout)`` of ``app`` (hypercorn's app
    wrapper, or the app itself) if it has one."""
    # hypercorn 0.18 (H11Protocol.stream_send) adds "connection: close" to
    # an answer once the connection served keep_alive_max_requests.
    config.keep_alive_max_requests = 0
    inner = app.app if isinstance(app, ASGIWrapper) else app
    begin = getattr(inner, "begin_shutdown", None)
    if begin is not None:
        begin(config.graceful_timeout)


def request_begun(protocol: Any, fd: int) -> bool:
    """Whether a request has begun on a connection hypercorn counts as idle
    (between requests, no app call): its h11 connection (in hypercorn's
    ``ProtocolWrapper`` ``protocol``) has parsed part of one or holds bytes
    of one, or the socket ``fd`` has bytes not read yet (``FIONREAD``). A
    graceful shutdown closes an idle connection only when none has; else
    the request is read and answered (module docstring)."""
    conn = getattr(getattr(protocol, "protocol", None), "connection", None)
    if isinstance(conn, h11.Connection) and (conn.their_state is not h11.IDLE or conn.trailing_data[0]):
        return True
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] > 0
    except OSError:  # closed already
        return False


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
