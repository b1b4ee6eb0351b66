"""Server processes started as forks of a process that has already imported
the package (multiprocessing's fork server, one per test process).

A fresh interpreter spends about 0.3 s of CPU importing the package before
``asgi-generate sim`` or ``serve`` answers its first request, and the suite
starts hundreds of them on two cores; a fork of a process that imported it
once does not. The child is then what ``python -m asgi_generate ARGS``
would be: the environment, working folder and listening socket it is given,
its output in its log file, and ``main``'s return value as its exit status.
The fork server is a fresh interpreter with no thread and no event loop, so
forking it is safe; the test process itself is never forked.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile

# What ``sim`` and ``serve`` import (each ~0.3 s of CPU in a fresh
# interpreter); a module left out is imported by the child that needs it.
# Not prometheus_client's multiprocess mode: it reads its variable as it is
# imported, so a process given one is started the usual way (support.Proc).
PRELOAD = [
    "asgi_generate.server.cli",
    "asgi_generate.server.app",
    "asgi_generate.server.supervisor",
    "asgi_generate.server.hypercorn.graceful",
    "asgi_generate.server.hypercorn.asyncio_serve",
    "asgi_generate.server.hypercorn.trio_serve",
    "asgi_generate.sim.app",
    "asgi_generate.tracing",
    "asgi_generate.sdk._registry",
    "asgi_generate_sglang.engine",
    "asgi_generate_vllm.engine",
    "asgi_generate_zstd",
    "hypercorn.asyncio",
    "hypercorn.trio",
    # And what a child would import as it starts (~20 ms of CPU each start).
    "anyio._backends._asyncio",
    "anyio._backends._trio",
    "anyio._core._signals",
    "anyio.streams.memory",
    "anyio.streams.stapled",
    "anyio.streams.tls",
    "prometheus_client.parser",
    "forked",
    "forked_warm",
]


# What the interpreter reads as it starts (PYTHONPATH: a test's own codec
# distribution or a stand-in hypercorn) or an import reads once: a process
# whose environment sets these otherwise than the fork server's must start
# the usual way. PYTHONUNBUFFERED is done here; the bytecode cache does not matter.
_AT_START = ("PYTHON", "PROMETHEUS_MULTIPROC_DIR")
_NO_MATTER = {"PYTHONUNBUFFERED", "PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE"}
_server_env: dict[str, str] | None = None  # the fork server's environment, once it started


def _started(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_AT_START) and k not in _NO_MATTER}


def can_fork(env: dict[str, str]) -> bool:
    """Whether a process with environment ``env`` may be a fork of the fork
    server: the variables read at start equal the server's (this process's,
    until the server has started)."""
    return _started(env) == _started(os.environ if _server_env is None else _server_env)


def _context() -> multiprocessing.context.ForkServerContext:
    global _server_env
    if _server_env is None:
        _server_env = dict(os.environ)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Forked:
    """``python -m asgi_generate ARGS`` as a fork of the fork server, with
    the part of :class:`subprocess.Popen`'s interface the tests use (``pid``,
    ``args``, ``poll``, ``wait``, ``returncode``, ``send_signal``,
    ``terminate``, ``kill``).

    ``args``: the command's arguments, ``{fd}`` standing for the descriptor
    of ``sock`` (a listening socket the child gets a copy of); ``env``: the
    child's whole environment (None: this process's); ``log_path``: a file
    that takes its standard output and error, unbuffered.
    """

    def __init__(self, args: list[str], *, sock: socket.socket, log_path: str,
                 env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, "-m", "asgi_generate", *args]
        env = dict(os.environ if env is None else env)
        self._process = _context().Process(
            target=_run, args=(args, env, os.getcwd(), log_path, sock), daemon=True)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status (minus the signal that ended it), None while it runs."""
        return self._process.exitcode

    def poll(self) -> int | None:
        """:attr:`returncode`, as ``Popen.poll``."""
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless it has exited."""
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM, as ``Popen.terminate``."""
        self._process.terminate()

    def kill(self) -> None:
        """SIGKILL, as ``Popen.kill``."""
        self._process.kill()


def _run(args: list[str], env: dict[str, str], cwd: str, log_path: str, sock: socket.socket) -> None:
    """The child: become ``python -m asgi_generate ARGS`` and run it."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR is the child's own
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    # PYTHONUNBUFFERED, as support.Proc sets it for a started interpreter.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    sock.set_inheritable(True)
    fd = str(sock.fileno())
    from asgi_generate.server.cli import main

    sys.exit(main([a.replace("{fd}", fd) for a in args]))
