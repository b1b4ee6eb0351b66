"""Embedded simulated workers: what ``asgi-generate serve`` runs when no
worker is given.

Each simulator is its own process (``python -m asgi_generate sim``) serving a
loopback socket that this process bound to a free port and hands over by file
descriptor, so there is no port race. Each runs in a session of its own, so a
terminal's Ctrl-C (SIGINT to the foreground process group) reaches only the
frontend, which drains its requests and then stops the simulators: they are
terminated, then killed if they linger. They also watch this process and
exit with it.

With ``--embedded-pd`` a prefill and a decode simulator per protocol start
beside the aggregated ones (SGLang ``--disaggregation-mode``, vLLM
``--kv-role``), so the frontend serves prefill/decode pairs.

The simulators tokenize text with the bundled tokenizer
(:data:`asgi_generate.assets.TOKENIZER_PATH`), so a frontend serving them
uses it too unless ``--tokenizer`` names another (:func:`tokenizer`): a
streamed text prompt then migrates when its simulator dies.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from contextlib import AsyncExitStack, asynccontextmanager
from typing import AsyncIterator, Iterable, NamedTuple

import anyio
import orjson

from ..assets import TOKENIZER_PATH
from ..config import Settings
from ..protocols import PROTOCOLS, WorkerProtocol
from .serving import listening_socket
from ..exceptions import WorkerError
from ..workers.http import ConnectionPool

log = logging.getLogger("asgi_generate.server.embedded")


def wanted(settings: Settings) -> bool:
    """Whether ``settings`` configure no worker, so simulators serve."""
    return not (settings.workers or settings.prefill or settings.decode or settings.workers_file)


def tokenizer(settings: Settings) -> str | None:
    """The tokenizer file the frontend loads: ``--tokenizer``, else the
    simulators' own when they serve (:func:`wanted`), else none."""
    if settings.tokenizer is not None or not wanted(settings):
        return settings.tokenizer
    return str(TOKENIZER_PATH)


class Simulator(NamedTuple):
    """One embedded simulator process.

    Attributes:
        protocol: ``sglang`` or ``vllm``.
        role: ``aggregated``, ``prefill`` or ``decode``.
        url: ``http://127.0.0.1:PORT``.
        pid: its process id.
    """

    protocol: str
    role: str
    url: str
    pid: int

    def describe(self) -> str:
        """``URL (ROLE, pid PID)``, as the start-up log names it."""
        return f"{self.url} ({self.role}, pid {self.pid})"


@asynccontextmanager
async def embedded_workers(
    count: int,
    protocol: str,
    ttft_ms: float = 0.0,
    itl_ms: float = 0.0,
    ready_timeout: float = 60.0,
    extra: Iterable[str] = (),
    role: str = "aggregated",
) -> AsyncIterator[list[Simulator]]:
    """Start ``count`` simulators speaking ``protocol`` in ``role`` (with
    ``extra`` ``sim`` flags); yield them once each answers ``/health``, and
    log them (URL, role, pid); stop them on exit.

    Raises:
        RuntimeError: a simulator exited or did not become healthy in time.
    """
    procs: list[anyio.abc.Process] = []
    sims: list[Simulator] = []
    try:
        for _ in range(count):
            sock = listening_socket("127.0.0.1", 0)
            port = sock.getsockname()[1]
            cmd = [
                sys.executable, "-m", "asgi_generate", "sim",
                "--protocol", protocol,
                "--fd", str(sock.fileno()),
                "--parent-pid", str(os.getpid()),
                "--ttft-ms", str(ttft_ms),
                "--itl-ms", str(itl_ms),
                *extra,
            ]
            try:
                proc = await anyio.open_process(
                    cmd, pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL, stdout=None, stderr=None,
                    start_new_session=True,
                )
            finally:
                sock.close()
            procs.append(proc)
            sims.append(Simulator(protocol, role, f"http://127.0.0.1:{port}", proc.pid))
        for proc, sim in zip(procs, sims):
            await _wait_ready(proc, sim.url, ready_timeout)
        log.info("embedded %s workers: %s", protocol, ", ".join(sim.describe() for sim in sims))
        yield sims
    finally:
        with anyio.CancelScope(shield=True):
            for proc in procs:
                await _stop(proc)
        if procs:
            log.info("embedded %s workers stopped: %s", protocol,
                     ", ".join(f"pid {p.pid} ({_ended(p.returncode)})" for p in procs))


async def _wait_ready(proc: anyio.abc.Process, url: str, timeout: float) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    pool = ConnectionPool(host, int(port), connect_timeout=1.0)
    try:
        with anyio.fail_after(timeout):
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"embedded worker {url} exited with {proc.returncode}")
                try:
                    async with pool.request(b"GET", b"/health") as resp:
                        await resp.read()
                        if resp.status == 200:
                            return
                except WorkerError:
                    pass
                await anyio.sleep(0.05)
    except TimeoutError:
        raise RuntimeError(f"embedded worker {url} not healthy after {timeout:g} s") from None
    finally:
        await pool.aclose()


async def _stop(proc: anyio.abc.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        with anyio.move_on_after(5):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _ended(code: int) -> str:
    """How a stopped simulator ended: ``exit 0``, or the signal that ended it."""
    return f"exit {code}" if code >= 0 else signal.Signals(-code).name


async def _join_port(url: str, engine: WorkerProtocol) -> int:
    """A prefill simulator's join port (it took a free one), from its server
    info's :attr:`~asgi_generate.protocols.WorkerProtocol.join_port_info_field`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    pool = ConnectionPool(host, int(port), connect_timeout=1.0)
    try:
        with anyio.fail_after(10):
            async with pool.request(b"GET", engine.info_path) as resp:
                return orjson.loads(await resp.read())[engine.join_port_info_field]
    finally:
        await pool.aclose()


def sim_protocols() -> list[str]:
    """The engines the simulator speaks, in the order embedded workers
    start (name order)."""
    return [e.name for e in PROTOCOLS.where(simulated=True)]


class Fleet(NamedTuple):
    """The embedded workers' ``(protocol, url)`` specs by role, and the
    simulators serving them."""

    workers: list[tuple[str, str]]
    prefill: list[tuple[str, str]]
    decode: list[tuple[str, str]]
    simulators: list[Simulator]


@asynccontextmanager
async def embedded_fleet(
    protocols: Iterable[str], count: int, ttft_ms: float = 0.0, itl_ms: float = 0.0, pd: bool = False
) -> AsyncIterator[Fleet]:
    """:func:`embedded_workers` for each of ``protocols`` the simulator
    speaks (in :func:`sim_protocols` order), and with ``pd`` one prefill
    and one decode simulator each; yields all their specs."""
    protocols = set(protocols)
    log.warning("no worker configured (--worker, ASGI_GENERATE_WORKERS): serving %d simulated "
                "worker(s) per protocol (%s), not real engines", count,
                ", ".join(p for p in sim_protocols() if p in protocols))
    async with AsyncExitStack() as stack:
        fleet = Fleet([], [], [], [])

        async def start(n: int, protocol: str, role: str = "aggregated", extra: Iterable[str] = ()) -> list[str]:
            sims = await stack.enter_async_context(embedded_workers(n, protocol, ttft_ms, itl_ms, extra=extra,
                                                                    role=role))
            fleet.simulators.extend(sims)
            return [sim.url for sim in sims]

        for protocol in sim_protocols():
            if protocol not in protocols:
                continue
            fleet.workers.extend((protocol, url) for url in await start(count, protocol))
            engine = PROTOCOLS[protocol]
            if not pd or engine.sim_pd_flags is None:
                continue
            prefill_flags, decode_flags = engine.sim_pd_flags
            (url,) = await start(1, protocol, "prefill", prefill_flags)
            if engine.join_query is not None:
                url = f"{url}?{engine.join_query}={await _join_port(url, engine)}"
            fleet.prefill.append((protocol, url))
            fleet.decode.extend((protocol, url) for url in await start(1, protocol, "decode", decode_flags))
        yield fleet
