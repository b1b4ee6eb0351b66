"""The one watchdog task that keeps every request's keep-alive and
slow-client timers: timers in order, forgotten ones dropped, a failing item
logged, an eager one paced."""

from __future__ import annotations

import contextlib

import anyio
import pytest
import trio.testing

from asgi_generate.request.watchdog import Watchdog


@pytest.fixture
def anyio_backend():
    # The clock jumps to the next deadline whenever every task waits:
    # timers come due in order and number however loaded the machine.
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


class _Item:
    def __init__(self, name: str, every: float, times: int, log: list) -> None:
        self.name, self.every, self.left, self.log = name, every, times, log

    def due(self, now, spawn):
        self.log.append(self.name)
        self.left -= 1
        if self.left == 0:
            async def last() -> None:
                self.log.append(self.name + "!")
                raise RuntimeError("an action that fails is logged, the watchdog goes on")

            spawn(last)
            return None
        return now + self.every


@contextlib.asynccontextmanager
async def _running(dog: Watchdog, seconds: float):
    """Run ``dog`` (started: its loop runs) for ``seconds`` after the body
    of the ``async with``, then stop it."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(dog.run, anyio.current_time)
        await anyio.sleep(0.01)
        yield
        await anyio.sleep(seconds)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_watchdog_runs_timers_in_order_and_forgets():
    log: list[str] = []
    dog = Watchdog()
    async with _running(dog, 0.3):
        assert dog.running
        now = anyio.current_time()
        dog.watch(_Item("a", 0.05, 2, log), now + 0.05)
        dog.watch(_Item("b", 0.02, 3, log), now + 0.02)
        gone = dog.watch(_Item("c", 0.01, 9, log), now + 0.03)
        dog.forget(gone)
    assert not dog.running
    assert log == ["b", "b", "a", "b", "b!", "a", "a!"]


class _Broken:
    def __init__(self, log: list) -> None:
        self.log = log

    def due(self, now, spawn):
        self.log.append("broken")
        raise RuntimeError("a bug in one item")


class _Eager:
    """Asks to be looked at again at once, every time."""

    def __init__(self, log: list) -> None:
        self.log = log

    def due(self, now, spawn):
        self.log.append("eager")
        return now


@pytest.mark.anyio
async def test_watchdog_survives_a_failing_item_and_paces_an_eager_one():
    log: list[str] = []
    dog = Watchdog()
    async with _running(dog, 0.2):
        now = anyio.current_time()
        dog.watch(_Broken(log), now)
        dog.watch(_Eager(log), now)
        dog.watch(_Item("late", 0.05, 1, log), now + 0.05)
    assert log.count("broken") == 1
    assert "late!" in log
    # At most one look per MIN_STEP (0.01 s) over about 0.2 s.
    assert 5 <= log.count("eager") <= 21
