"""An abort the engine answers with a non-200 status is retried with
backoff (FIRST_BACKOFF, then four times longer), at most ABORT_TRIES sends
in all, then counts as unacknowledged."""

from __future__ import annotations

import sys

import anyio
import pytest

from asgi_generate.workers import aborts
from scripted_worker import _against_script

REQUEST = b'{"rid":"' + b"r" * 32 + b'"}'


@pytest.fixture
def pauses(monkeypatch) -> list[float]:
    """The seconds the abort queue slept (its own sleeps: the test's
    helpers poll with sleeps of their own)."""
    seen: list[float] = []
    sleep = anyio.sleep

    async def noting(delay: float) -> None:
        if sys._getframe(1).f_code.co_filename == aborts.__file__:
            seen.append(delay)
        await sleep(delay)

    monkeypatch.setattr(aborts.anyio, "sleep", noting)
    return seen


def test_a_refused_abort_is_retried_after_a_growing_pause(pauses):
    result, requests, queue, _ = _against_script([503, 500, 200], timeout=5)
    assert (result, requests, queue.requests) == ("acked", [REQUEST] * 3, 3)
    assert (aborts.FIRST_BACKOFF, pauses) == (0.05, [0.05, 0.2])


def test_an_abort_refused_every_try_is_unacknowledged(pauses):
    result, requests, queue, _ = _against_script([503, 503, 503, 200], timeout=5)
    assert (aborts.ABORT_TRIES, result, requests, queue.requests) == (3, "unacknowledged", [REQUEST] * 3, 3)
    assert pauses == [0.05, 0.2]
