"""Sibling processes: metrics made current for a scrape, and fleet decisions
told to one another.

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

The same sockets carry the decisions of one process that no engine holds
(:mod:`asgi_generate.workers.fleet_state`: a fence an operator cleared, a
worker fenced for a failed update): :func:`tell` connects to each sibling,
sends ``m``, the length of a JSON object (4 bytes, big-endian, at most
:data:`MAX_MESSAGE` bytes) and the object; the sibling hands it to its
``on_message`` in its event loop and answers one byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import sys
from typing import Any, Awaitable, Callable

import anyio
import orjson
from anyio.streams.buffered import BufferedByteReceiveStream

#: The name of a process's file in the folder: the prefix and its process id.
PREFIX = "flush_"
#: Seconds a scrape waits, at most, for its siblings' answers together.
ASK_TIMEOUT = 1.0
#: The longest socket path outside Linux (``sun_path`` holds 104 bytes on
#: macOS and the BSDs, with its final NUL).
MAX_PATH = 103
ABSTRACT = sys.platform.startswith("linux")
#: The largest message :func:`tell` sends, in bytes (a bigger one is refused).
MAX_MESSAGE = 1 << 20


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


async def answer(folder: str, refresh: Callable[[], None],
                 on_message: Callable[[dict[str, Any]], Awaitable[None] | None] | None = None, *,
                 task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Forever: answer siblings' requests by calling ``refresh()`` (this
    process's counts into the files), and hand their messages
    (:func:`tell`) to ``on_message`` (a coroutine it returns is awaited
    before the answer); reports started once listening.
    This process's file is removed when this ends.

    Raises:
        OSError: the socket or the file cannot be made.
    """
    pid = os.getpid()
    marker = os.path.join(folder, f"{PREFIX}{pid}")
    listener = await anyio.create_unix_listener(address(folder, pid))  # replaces a dead namesake's

    async def one(stream) -> None:
        async with stream:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead, OSError,
                                     orjson.JSONDecodeError, ValueError):
                with anyio.fail_after(ASK_TIMEOUT * 5):
                    reader = BufferedByteReceiveStream(stream)
                    kind = await reader.receive_exactly(1)
                    if kind == b"m":
                        (size,) = struct.unpack(">I", await reader.receive_exactly(4))
                        if size > MAX_MESSAGE:
                            raise ValueError(f"a message of {size} bytes")
                        message = orjson.loads(await reader.receive_exactly(size))
                        if on_message is not None and isinstance(message, dict):
                            handled = on_message(message)
                            if handled is not None:  # a coroutine: answered once it ran
                                await handled
                    else:
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


def _siblings(folder: str) -> set[int]:
    own = os.getpid()
    return {int(name[len(PREFIX):]) for name in os.listdir(folder)
            if name.startswith(PREFIX) and name[len(PREFIX):].isdigit()} - {own}


async def _each(folder: str, request: bytes, timeout: float) -> None:
    """Send ``request`` to every sibling and wait for each one's byte, all
    within ``timeout`` seconds (a process gone refuses at once)."""
    async def one(pid: int) -> None:
        with contextlib.suppress(OSError, anyio.EndOfStream, anyio.BrokenResourceError):
            async with await anyio.connect_unix(address(folder, pid)) as stream:
                await stream.send(request)
                await stream.receive(1)

    with anyio.move_on_after(timeout):
        async with anyio.create_task_group() as tg:
            for pid in _siblings(folder):
                tg.start_soon(one, pid)


async def tell(folder: str, message: dict[str, Any], timeout: float = ASK_TIMEOUT) -> None:
    """Hand ``message`` (a JSON object of at most :data:`MAX_MESSAGE`
    bytes) to every other process with a file in ``folder``, and wait until
    each applied it or ``timeout`` seconds passed.

    Raises:
        ValueError: the message is larger than :data:`MAX_MESSAGE`.
    """
    body = orjson.dumps(message)
    if len(body) > MAX_MESSAGE:
        raise ValueError(f"a sibling message of {len(body)} bytes (at most {MAX_MESSAGE})")
    await _each(folder, b"m" + struct.pack(">I", len(body)) + body, timeout)


async def ask(folder: str, timeout: float = ASK_TIMEOUT) -> None:
    """Have every other process with a file in ``folder`` refresh, and wait
    until they all answered or ``timeout`` seconds passed (a process gone
    refuses at once)."""
    await _each(folder, b"f", timeout)
