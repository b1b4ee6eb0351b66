"""``serve`` raises its soft open-file limit to the hard one at start, and
says so in the log (found however many access lines follow it)."""

from __future__ import annotations

import re
import resource

import httpx
import pytest

from support import start_frontend, start_sim, wait_until

pytestmark = pytest.mark.e2e


def _soft_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        return int(re.search(r"Max open files\s+(\d+)", f.read()).group(1))


@pytest.mark.timeout(180)  # a fresh interpreter's start, on a busy machine
def test_serve_raises_the_soft_fd_limit_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(512, hard)
    sim = start_sim()
    fe = None
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # inherited by the children
    try:
        # Started by this process, not forked from the fork server: it inherits the lowered limit.
        fe = start_frontend([f"sglang={sim.url}"], extra=["--log-level", "info"], fork=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if fe is None:
            sim.stop()
    try:
        assert _soft_limit(fe.proc.pid) == hard
        # A busy machine's start is polled for many times, each poll an
        # access line after the start-up line: more than a screenful here.
        for _ in range(60):
            assert httpx.get(fe.url + "/health", timeout=30).status_code == 200
        wait_until(lambda: fe.log().count('"GET /health 1.1" 200') >= 60, timeout=30)
        line = f"INFO asgi_generate: open-file limit raised from {low} to {hard} (the hard limit)"
        assert fe.log().count(line) == 1
    finally:
        fe.stop()
        sim.stop()
