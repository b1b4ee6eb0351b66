"""Sibling processes' metrics made current for a scrape.

With several processes (``serve --workers N``, ``hypercorn -w N``) each one
counts its requests in memory and moves the counts into prometheus-client's
multiprocess files every :data:`asgi_generate.ops.metrics.REFRESH_S`
seconds, off the response path. A scrape reaches one process; so that it
shows every request that ended before it, that process first asks each
sibling to move its counts now and waits for the answers (at most
:data:`ASK_TIMEOUT` seconds: a sibling that is stuck or gone is skipped,
its files read as they are).

The exchange: each process listens on a Unix socket and leaves a file
``flush_<pid>`` in the multiprocess folder that names it to its siblings; an
asker connects, sends one byte, and the process answers one byte once it has
refreshed its values (in its event loop, so never in the middle of a
request's counting). On Linux the socket is in the abstract namespace (no
file, no limit on the folder's path length, gone with the process) and the
file is empty; elsewhere the file is the socket itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from typing import Callable

import anyio

#: The name of a process's file in the folder: the prefix and its process id.
PREFIX = "flush_"
#: Seconds a scrape waits, at most, for its siblings' answers together.
ASK_TIMEOUT = 1.0
#: The longest socket path outside Linux (``sun_path`` holds 104 bytes on
#: macOS and the BSDs, with its final NUL).
MAX_PATH = 103
ABSTRACT = sys.platform.startswith("linux")


def address(folder: str, pid: int) -> str:
    """The socket of process ``pid`` sharing the multiprocess ``folder``."""
    if ABSTRACT:
        digest = hashlib.sha256(os.path.realpath(folder).encode()).hexdigest()[:32]
        return f"\0asgi-generate-metrics-{digest}-{pid}"
    return os.path.join(folder, f"{PREFIX}{pid}")


def folder_problem(folder: str) -> str | None:
    """Why ``folder`` cannot hold the processes' sockets (outside Linux, a
    path too long for a Unix socket), or ``None``."""
    longest = len(address(folder, 9_999_999).encode())
    if not ABSTRACT and longest > MAX_PATH:
        return f"a path under {folder!r} is too long for a Unix socket ({longest} > {MAX_PATH} bytes)"
    return None


async def answer(folder: str, refresh: Callable[[], None], *,
                 task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Forever: answer siblings' requests by calling ``refresh()`` (this
    process's counts into the files); reports started once listening.
    This process's file is removed when this ends.

    Raises:
        OSError: the socket or the file cannot be made.
    """
    pid = os.getpid()
    marker = os.path.join(folder, f"{PREFIX}{pid}")
    listener = await anyio.create_unix_listener(address(folder, pid))  # replaces a dead namesake's

    async def one(stream) -> None:
        async with stream:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                await stream.receive(1)
                refresh()
                await stream.send(b"1")

    try:
        async with listener:
            if ABSTRACT:
                open(marker, "wb").close()
            task_status.started()
            await listener.serve(one)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)


async def ask(folder: str, timeout: float = ASK_TIMEOUT) -> None:
    """Have every other process with a file in ``folder`` refresh, and wait
    until they all answered or ``timeout`` seconds passed (a process gone
    refuses at once)."""
    own = os.getpid()
    pids = {int(name[len(PREFIX):]) for name in os.listdir(folder)
            if name.startswith(PREFIX) and name[len(PREFIX):].isdigit()} - {own}

    async def one(pid: int) -> None:
        with contextlib.suppress(OSError, anyio.EndOfStream, anyio.BrokenResourceError):
            async with await anyio.connect_unix(address(folder, pid)) as stream:
                await stream.send(b"f")
                await stream.receive(1)

    with anyio.move_on_after(timeout):
        async with anyio.create_task_group() as tg:
            for pid in pids:
                tg.start_soon(one, pid)
