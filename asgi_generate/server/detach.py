"""``serve --detach``: the server in the background, the command's exit
status saying whether it serves.

``serve`` checks its settings and binds its port in the foreground, so a
bad start is the one line on stderr and exit status 2 it always is, before
any pid file is written. :func:`fork` then starts the server as a child
process in a session of its own (a terminal's Ctrl-C and hang-up do not
reach it), its output appended to the log file, and waits on a pipe: each
serving process writes one byte to it once its app has started
(:func:`announcer`, e.g. after the embedded simulators answered), and a
process that exits first closes it. The command exits 0 once every process
serves, else with the server's exit status and the lines it logged.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

#: The pipe end a detached server announces on (see :func:`fork`).
_ready_fd: int | None = None


def fork(log_path: str, processes: int, where: str) -> int | None:
    """Fork: the child returns ``None`` (the server, detached: new session,
    stdin ``/dev/null``, stdout and stderr appended to ``log_path``;
    :func:`ready_fd` is its end of the pipe); the parent waits for
    ``processes`` announcements and returns the command's exit status, 0
    once they came (saying so, with ``where`` the server's URL), else the
    child's status with what it logged meanwhile, on stderr. A Ctrl-C while
    it waits stops the child (SIGTERM) and returns 130.

    Raises:
        OSError: ``log_path`` cannot be opened for appending.
    """
    global _ready_fd
    log = open(log_path, "ab")
    start = log.tell()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        log.close()
        _ready_fd = write_end
        return None
    log.close()
    os.close(write_end)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        announced = 0
        while announced < processes:
            data = os.read(read_end, 64)
            if not data:
                break
            announced += len(data)
    except KeyboardInterrupt:
        os.kill(pid, signal.SIGTERM)
        return 130
    finally:
        os.close(read_end)
    if announced >= processes:
        print(f"asgi-generate: serving {where} in the background: pid {pid}, log {log_path}", file=sys.stderr)
        return 0
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    with open(log_path, "rb") as f:
        f.seek(start)
        sys.stderr.write(f.read().decode(errors="replace"))
    print(f"asgi-generate: the server stopped before serving (exit status {code}); its log: {log_path}",
          file=sys.stderr)
    return code if code > 0 else 1


def ready_fd() -> int | None:
    """In a server :func:`fork` detached, its end of the pipe (for the
    processes it starts; close it once they have it); else ``None``."""
    return _ready_fd


def announcer(fd: int) -> Callable[[], None]:
    """A function that announces, once, that this process serves: one byte
    on ``fd``, then closes it."""

    def announce() -> None:
        nonlocal fd
        if fd >= 0:
            try:
                os.write(fd, b"\n")
            finally:
                os.close(fd)
                fd = -1

    return announce
