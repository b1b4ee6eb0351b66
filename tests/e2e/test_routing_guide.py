"""The routing page's ``kv-aware`` walk-through (docs/routing.md, the
``sh`` block titled ``kv-aware.sh``) runs as written and prints what the
page says it prints.

The block runs under bash in a temporary folder whose ``.venv`` is this
interpreter's environment, each of its ports (the numbers after
``127.0.0.1:`` and ``--port``) swapped for a free one, so that it cannot
collide with another run; nothing else of it is changed, but for the
frontend's worker class: as written (``asyncio``, the default) and with
``--worker-class trio``. It must listen on 127.0.0.1 only and stop every
process it started.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest

from support import free_port, wait_until

pytest.importorskip("zmq", reason="pyzmq (a dependency since KV events: pip install -e .)")
pytestmark = pytest.mark.e2e

PAGE = pathlib.Path(__file__).parents[2] / "docs" / "routing.md"
BLOCK = re.compile(r'^```(\w+)(?: title="(\S+)")?\n(.*?)^```$', re.S | re.M)


def _blocks() -> list[tuple[str, str | None, str]]:
    return [(m[1], m[2], m[3]) for m in BLOCK.finditer(PAGE.read_text())]


def _script_and_output() -> tuple[str, str]:
    """The ``kv-aware.sh`` block and the block after it (what it prints)."""
    blocks = _blocks()
    [at] = [i for i, (_, title, _) in enumerate(blocks) if title == "kv-aware.sh"]
    assert blocks[at][0] == "sh" and blocks[at + 1][0] == "text"
    return blocks[at][2], blocks[at + 1][2]


def _refuses(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_the_block_listens_on_loopback_only():
    script, _ = _script_and_output()
    hosts = set(re.findall(r"(?:https?|tcp)://([^:/\s]+)", script)) | set(re.findall(r"\s([\w.]+):\d+/", script))
    # tcp://*:0 is vLLM's own way to bind a free port; the simulator binds it on loopback.
    assert hosts == {"127.0.0.1", "*"}
    assert re.findall(r"tcp://\*:(\d+)", script) == ["0"] * 4


@pytest.mark.parametrize("worker_class", ["asyncio", "trio"])
def test_the_kv_aware_walk_through_prints_what_the_page_says(tmp_path, worker_class):
    script, output = _script_and_output()
    ports = sorted({int(p) for p in re.findall(r"(?:127\.0\.0\.1:|--port )(\d+)", script)})
    assert len(ports) == 9  # four simulators, four SGLang event sockets, the frontend
    mapping = {p: free_port() for p in ports}
    mine = re.sub(r"\b(\d+)\b", lambda m: str(mapping.get(int(m[1]), m[1])), script)
    if worker_class != "asyncio":
        mine = mine.replace(" serve ", f" serve --worker-class {worker_class} ", 1)
    (tmp_path / ".venv").symlink_to(sys.prefix)  # this interpreter's environment
    sims = [mapping[p] for p in ports if str(p) in re.findall(r"sim --protocol \w+ --port (\d+)", script)]
    frontend = mapping[int(re.search(r"serve --port (\d+)", script)[1])]
    run = subprocess.Popen(["bash", "-c", mine], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        try:
            out, err = run.communicate(timeout=45)  # under the per-test timeout: a hang shows what it printed
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            out, err = run.communicate(timeout=10)
            log = tmp_path / "asgi-generate.log"
            pytest.fail(f"the block ran past 45 s; it printed {out!r}, {err!r}; the frontend's log: "
                        f"{log.read_text() if log.exists() else None!r}")
        assert run.returncode == 0, err
        assert out == output, err
        # Everything it started is gone: the pid file (removed by the
        # frontend at exit) and every listening port.
        wait_until(lambda: not (tmp_path / "asgi-generate.pid").exists(), timeout=60)
        wait_until(lambda: all(_refuses(p) for p in [*sims, frontend]), timeout=60)
    finally:
        # On failure, stop what the block left running: its own process
        # group (the simulators) and the detached frontend.
        try:
            os.killpg(run.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        run.wait(timeout=10)
        pid_file = tmp_path / "asgi-generate.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
