"""Bodies from 1 MiB on are decoded in a worker thread, one at a time (a
capacity limiter of one shared by the process), so that parsing never
holds the event loop for more than one parse; smaller ones are decoded on
the loop (a thread hop costs more than their parse)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from asgi_generate.config import Settings
from asgi_generate.request.budget import BodyBudget
from asgi_generate.request.handler import DECODE_THREAD_BYTES, _read_and_decode

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


class ThreadNoting:
    """A codec whose decode notes where it ran: off the loop's thread, and
    the decode limiter's tokens borrowed and in all at that moment."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.seen: list[tuple[int, bool, int, int]] = []

    def decode(self, body: bytes, headers: dict) -> str:
        limiter = self.budget.decode_limiter
        self.seen.append((len(body), threading.current_thread() is not threading.main_thread(),
                          limiter.borrowed_tokens, limiter.total_tokens))
        return "decoded"


@pytest.mark.parametrize("size, in_thread", [(DECODE_THREAD_BYTES - 1, False), (DECODE_THREAD_BYTES, True),
                                             (3 * DECODE_THREAD_BYTES, True)])
async def test_bodies_from_1_mib_are_decoded_in_a_worker_thread_one_at_a_time(size, in_thread):
    budget = BodyBudget(8 * DECODE_THREAD_BYTES)
    ctx = SimpleNamespace(settings=Settings(max_body_bytes=8 * DECODE_THREAD_BYTES), body_budget=budget,
                          shutting_down=False)
    codec = ThreadNoting(budget)
    body = b"x" * size

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        raise AssertionError(f"nothing is sent for a body that decodes: {message}")

    st = SimpleNamespace(body_bytes=0)
    assert await _read_and_decode(ctx, codec, receive, send, st, {}, size) == "decoded"
    assert codec.seen == [(size, True, 1, 1) if in_thread else (size, False, 0, 1)]
    assert (st.body_bytes, budget.reading) == (size, 0)
