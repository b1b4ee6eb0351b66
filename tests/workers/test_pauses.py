"""Fleet transactions (asgi_generate/workers/pauses.py): a pause and a
weight call that aborts without pausing both explain an engine abort; held
streams go on only once no transaction is open; the bounds hold."""

from __future__ import annotations

import anyio
import pytest

from asgi_generate.workers.pauses import EXPIRED, FULL, Pauses


def test_an_abort_is_a_transactions_if_one_began_since_the_plan_or_was_open_then():
    p = Pauses()
    before = p.mark("sglang")
    assert (before, p.aborted_since("sglang", before)) == (0, False)
    with p.call("sglang"):
        during = p.mark("sglang")  # a leg planned while the call is in flight
        assert p.aborted_since("sglang", before) and p.aborted_since("sglang", during)
        assert p.paused("sglang") and not p.paused("vllm")
    after = p.mark("sglang")
    assert (after, p.aborted_since("sglang", after), p.paused("sglang")) == (1, False, False)
    p.begin("vllm")
    assert p.aborted_since("vllm", 0) and not p.aborted_since("sglang", after)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_held_stream_goes_on_once_the_pause_and_every_aborting_call_ended(backend):
    p = Pauses()
    steps: list[str] = []

    async def held() -> None:
        assert await p.hold("sglang", 4, 10.0) is None
        steps.append("resumed")

    async def run() -> None:
        p.begin("sglang")
        call = p.call("sglang")
        call.__enter__()
        async with anyio.create_task_group() as tg:
            tg.start_soon(held)
            await anyio.wait_all_tasks_blocked()
            p.end("sglang")
            await anyio.wait_all_tasks_blocked()
            steps.append("pause ended")  # the call is still in flight: still held
            call.__exit__(None, None, None)  # the call was answered
        steps.append("done")

    anyio.run(run, backend=backend)
    assert steps == ["pause ended", "resumed", "done"]
    assert p.stats() == {"paused": [], "held_now": 0, "held": 1, "resumed": 1, "refused_full": 0, "expired": 0}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_held_streams_are_bounded_in_number_and_time(backend):
    p = Pauses()

    async def run() -> list:
        with p.call("vllm"):
            out: list = [None, None]

            async def one(i: int) -> None:
                out[i] = await p.hold("vllm", 1, 0.05)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, 0)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(one, 1)
            return out

    assert anyio.run(run, backend=backend) == [EXPIRED, FULL]
    assert (p.counts["expired"], p.counts["refused_full"], p.held, p.paused("vllm")) == (1, 1, 0, False)
