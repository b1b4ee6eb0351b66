"""Shared fixtures: simulator and frontend processes for the whole session."""

from __future__ import annotations

import pytest

from support import start_frontend, start_sim


@pytest.fixture(scope="session")
def sims():
    """Two SGLang simulators (no TTFT/ITL delay)."""
    procs = [start_sim("sglang"), start_sim("sglang")]
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="session", params=["trio", "asyncio"])
def frontend(request, sims):
    """The frontend in front of both simulators, once per worker class."""
    proc = start_frontend([f"sglang={s.url}" for s in sims], worker_class=request.param)
    yield proc
    proc.stop()
