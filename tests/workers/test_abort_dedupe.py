"""One abort per engine id: concurrent callers naming one id share one
engine call and its answer; a repeat after the answer is answered from
memory (bounded), unsent; an id every caller gave up on before it was sent
is not sent. No process: the queue's send is replaced by a gate."""

from __future__ import annotations

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from asgi_generate.workers.aborts import ACKED, UNACKNOWLEDGED, AbortQueue
from scripted_worker import _worker

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def _gated(queue: AbortQueue, result: str = ACKED) -> tuple[list[list[str]], anyio.Event]:
    """Replace ``queue``'s engine call: each call's ids are noted, and all
    wait on the returned event before answering ``result``."""
    calls: list[list[str]] = []
    gate = anyio.Event()

    async def send(batch) -> str:
        calls.append([item.engine_id for item in batch])
        await gate.wait()
        return result

    queue._send = send
    return calls, gate


async def _concurrent(queue: AbortQueue, ids: list[str]) -> list[str]:
    results: list[str | None] = [None] * len(ids)

    async def one(i: int) -> None:
        results[i] = await queue.abort(ids[i])

    async with anyio.create_task_group() as tg:
        tg.start_soon(queue.run)
        async with anyio.create_task_group() as callers:
            for i in range(len(ids)):
                callers.start_soon(one, i)
            await wait_all_tasks_blocked()
            gate.set() if (gate := getattr(queue, "_test_gate", None)) else None
        tg.cancel_scope.cancel()
    return results


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_concurrent_aborts_of_one_id_make_one_engine_call_and_share_its_answer(protocol):
    queue = AbortQueue(_worker(protocol, 9), concurrency=4)
    calls, queue._test_gate = _gated(queue, UNACKNOWLEDGED)
    # Five callers for one id (queued, then joined while in flight), one for another.
    results = await _concurrent(queue, ["a" * 32] * 5 + ["b" * 32])
    assert results == [UNACKNOWLEDGED] * 6
    assert sorted(i for c in calls for i in c) == ["a" * 32, "b" * 32]
    assert (queue.duplicates, queue.queued, queue._pending) == (4, 0, {})


async def test_a_repeat_after_the_answer_is_answered_from_memory_bounded():
    queue = AbortQueue(_worker("sglang", 9), concurrency=1, remember=2)
    calls, queue._test_gate = _gated(queue)
    for ids in (["x", "x"], ["y"], ["z"]):
        assert await _concurrent(queue, ids) == [ACKED] * len(ids)
    assert calls == [["x"], ["y"], ["z"]]
    # x is forgotten (the last 2 kept: y, z): it is sent again; y is not.
    assert await _concurrent(queue, ["y", "x", "z"]) == [ACKED] * 3
    assert calls == [["x"], ["y"], ["z"], ["x"]]
    assert queue.duplicates == 1 + 2


async def test_an_abort_every_caller_gave_up_on_unsent_is_not_sent():
    queue = AbortQueue(_worker("vllm", 9), deadline=0.05)
    calls, gate = _gated(queue)
    # No sender runs: both callers of one id give up at the deadline.
    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(queue.abort, "late")
    assert (queue.expired, queue.duplicates, queue._pending) == (2, 1, {})
    # A later caller queues it anew; the given-up entry is skipped.
    queue._test_gate, queue.deadline = gate, 30.0
    assert await _concurrent(queue, ["late"]) == [ACKED]
    assert calls == [["late"]]
