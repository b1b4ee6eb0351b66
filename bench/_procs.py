"""Process helpers for the benchmarks: pinned children that never outlive
the benchmark, loopback sockets, readiness polling and CPU accounting.

Every child runs in its own session (a Ctrl-C at the terminal reaches only
the benchmark, which then stops its children itself), pinned to the CPUs it
is given, and with ``PR_SET_PDEATHSIG`` so the kernel sends it SIGTERM if
the benchmark dies without cleaning up.
"""

from __future__ import annotations

import ctypes
import http.client
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def listening_socket(reuse_port: bool = False) -> socket.socket:
    """A listening, inheritable TCP socket on a free loopback port (with
    ``SO_REUSEPORT`` when ``reuse_port``: ``serve --workers N`` then gives
    each process a socket of its own beside it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def free_port() -> int:
    """A loopback port that was free a moment ago (for servers that take
    ``--port`` rather than an inherited socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LogDir:
    """A fresh folder (``path``) for a benchmark's child logs and scratch
    files: ``with LogDir(prefix) as logs:``, setting ``logs.ok`` once every
    answer checked out. On leaving, the folder is removed when ``ok``, else
    kept and named on stderr (a failed or interrupted run keeps its logs)."""

    def __init__(self, prefix: str) -> None:
        self.path = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
        self.ok = False

    def __enter__(self) -> "LogDir":
        return self

    def __exit__(self, *exc) -> None:
        if self.ok:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            print(f"logs kept in {self.path}", file=sys.stderr)


class Child:
    """A child process pinned to ``cpus``, logging to ``log_dir/name.log``.

    Args:
        name: label for logs and errors.
        argv: the command line.
        cpus: CPUs to pin it to, or ``None`` to leave its affinity alone.
        log_dir: where its output goes.
        pass_fds: inherited file descriptors (listening sockets).
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        cpus: set[int] | None,
        log_dir: pathlib.Path,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")

        def setup() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=pass_fds,
            start_new_session=True,
            preexec_fn=setup,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.pid = self.proc.pid

    def tail(self, chars: int = 3000) -> str:
        """The end of what the process printed."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def check_alive(self) -> None:
        """Raise if the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    def cpu_seconds(self) -> float:
        """User + system CPU seconds used so far by the process and its
        descendants."""
        return tree_cpu_seconds(self.pid)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; reap it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log.close()


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the parenthesised command name, starting at field 3 (state).
    return raw.rsplit(")", 1)[1].split()


def user_system_seconds(pid: int) -> tuple[float, float]:
    """``pid``'s user and system CPU seconds so far, every thread
    (``/proc/PID/stat`` utime and stime).

    Raises:
        ProcessLookupError: no such process.
    """
    fields = _stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (utime + stime) of ``pid`` and its live descendants."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                parents[int(entry)] = int(fields[1])
    family = {pid}
    grew = True
    while grew:
        grew = False
        for child, parent in parents.items():
            if parent in family and child not in family:
                family.add(child)
                grew = True
    total = 0
    for member in family:
        fields = _stat_fields(member)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def cpus_busy_seconds(cpus: set[int]) -> float:
    """Non-idle CPU seconds (user, nice, system, irq, softirq, steal) of
    ``cpus`` since boot, whoever used them."""
    total = 0
    for line in pathlib.Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total / _CLK_TCK


def http_request(
    port: int, method: str, path: str, body: bytes = b"", timeout: float = 30.0
) -> tuple[int, bytes]:
    """One HTTP/1.1 request to ``127.0.0.1:port``; the status and the whole body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"content-type": "application/json"} if body else {}
        conn.request(method, path, body=body or None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_ready(child: Child, port: int, method: str, path: str, body: bytes = b"", timeout: float = 60.0) -> None:
    """Poll until ``method path`` on ``port`` answers 200, or raise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        child.check_alive()
        try:
            if http_request(port, method, path, body, timeout=2.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{child.name} not ready after {timeout:g} s:\n{child.tail()}")


def run_main(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s status; on Ctrl-C or SIGTERM (also when started
    in the background with SIGINT ignored) ``main`` unwinds, stopping every
    child it started, and the exit status is 130 (143 for SIGTERM)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; every process the benchmark started was stopped", file=sys.stderr)
        sys.exit(130)
