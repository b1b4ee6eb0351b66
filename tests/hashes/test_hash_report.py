"""``/stats`` says which hash path the process runs (``hash_accelerator``);
tests/e2e/test_cli.py checks a served one and ``asgi-generate check``."""

from __future__ import annotations

import pytest

from asgi_generate import hashes
from asgi_generate.config import Settings
from asgi_generate.server.app import App


@pytest.mark.parametrize("accelerated", [True, False])
def test_stats_says_whether_the_hash_chains_run_in_c(monkeypatch, accelerated):
    monkeypatch.setattr(hashes, "ACCELERATED", accelerated)
    assert App(Settings(embedded_workers=0), codecs=[]).stats()["hash_accelerator"] is accelerated
