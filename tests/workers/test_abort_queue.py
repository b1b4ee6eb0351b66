"""The per-worker abort queue against real simulators: batching where the
engine takes a list, bounded connections, a bounded queue, a deadline, and
no retries against a worker known dead; against a scripted engine: a non-200
answer is retried, a slow one is never sent twice."""

from __future__ import annotations

import socket
import time

import anyio
import pytest

from asgi_generate.workers.aborts import AbortQueue
from scripted_worker import _abort_all, _against_script, _worker
from support import start_sim, stats


@pytest.fixture(scope="module")
def sims():
    procs = {p: start_sim(p) for p in ("sglang", "vllm")}
    yield procs
    for p in procs.values():
        p.stop()


def _ids(n: int, tag: str) -> list[str]:
    return [f"{tag}{i:030d}" for i in range(n)]


def _acked(sim, protocol: str, ids: list[str], **queue_args) -> tuple[AbortQueue, int, list[str]]:
    """Abort ``ids`` through a new queue (``queue_args``) to ``sim``, each
    acknowledged; return the queue, and the abort requests ``sim`` got and
    the ids they named, in order."""
    before = stats(sim)
    queue = AbortQueue(_worker(protocol, sim.port), **queue_args)
    assert anyio.run(_abort_all, queue, ids) == ["acked"] * len(ids)
    after = stats(sim)
    return (queue, after["abort_requests"] - before["abort_requests"],
            after["abort_named_ids"][len(before["abort_named_ids"]):])


@pytest.mark.e2e
def test_vllm_aborts_waiting_together_go_in_one_request(sims):
    ids = _ids(300, "v")
    queue, requests, named = _acked(sims["vllm"], "vllm", ids, concurrency=1, batch=512)
    assert requests == 1
    assert named == [f"generate-tokens-{i}" for i in ids]
    assert (queue.requests, queue.pool.opened) == (1, 1)


@pytest.mark.e2e
def test_vllm_batches_are_capped(sims):
    ids = _ids(100, "c")
    queue, requests, named = _acked(sims["vllm"], "vllm", ids, concurrency=2, batch=40)
    # 40 + 40 + 20 ids, over at most two connections.
    assert requests == 3
    assert sorted(named) == [f"generate-tokens-{i}" for i in ids]
    assert queue.pool.opened <= 2


@pytest.mark.e2e
def test_sglang_sends_one_rid_per_request_over_at_most_concurrency_connections(sims):
    ids = _ids(60, "s")
    queue, requests, named = _acked(sims["sglang"], "sglang", ids, concurrency=3, batch=512)
    assert requests == 60
    assert sorted(named) == ids
    assert queue.pool.opened <= 3 and queue.peak_in_flight <= 3 and queue.requests == 60


@pytest.mark.e2e
def test_a_full_queue_refuses_at_once(sims):
    sim = sims["sglang"]
    queue = AbortQueue(_worker("sglang", sim.port), queue_size=2)
    assert anyio.run(_abort_all, queue, _ids(3, "f")) == ["acked", "acked", "unacknowledged"]
    assert (queue.refused, queue.requests) == (1, 2)


@pytest.mark.e2e
def test_past_the_deadline_the_abort_is_unacknowledged_and_never_sent(sims):
    sim = sims["sglang"]
    before = stats(sim)["abort_requests"]
    queue = AbortQueue(_worker("sglang", sim.port), deadline=0.2)

    async def main() -> list[str]:
        t0 = time.monotonic()
        results = await _abort_all(queue, _ids(2, "d"), start_senders=False)
        # No sender runs: nothing but the deadline ends the waits.
        assert time.monotonic() - t0 >= 0.2
        # Senders that start later skip what nobody waits for any more.
        async with anyio.create_task_group() as tg:
            tg.start_soon(queue.run)
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
        return results

    assert anyio.run(main) == ["unacknowledged"] * 2
    assert (queue.expired, queue.requests, queue.queued) == (2, 0, 0)
    assert stats(sim)["abort_requests"] == before


def test_a_refused_connect_loses_the_batch_and_the_queue_at_once():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lost = []
    worker = _worker("sglang", port)
    queue = AbortQueue(worker, concurrency=1, on_lost=lambda w, why: lost.append((w, why)))

    results = anyio.run(_abort_all, queue, _ids(20, "x"))
    assert results == ["lost"] * 20
    # One try, no retry after a backoff: one refused connect ends all twenty.
    assert queue.requests == 1 and len(lost) == 1 and lost[0][0] is worker
    assert lost[0][1].startswith("abort failed: connect to 127.0.0.1:")


@pytest.mark.e2e
def test_a_worker_marked_down_gets_no_abort(sims):
    sim = sims["sglang"]
    before = stats(sim)["abort_requests"]
    queue = AbortQueue(_worker("sglang", sim.port, healthy=False))
    assert anyio.run(_abort_all, queue, _ids(3, "m")) == ["lost"] * 3
    assert (queue.requests, queue.pool.opened) == (0, 0)
    assert stats(sim)["abort_requests"] == before


def test_a_non_200_answer_is_retried_on_the_same_connection():
    result, requests, queue, _ = _against_script([503, 503, 200], timeout=5)
    assert result == "acked"
    assert requests == [b'{"rid":"' + b"r" * 32 + b'"}'] * 3
    assert (queue.requests, queue.pool.opened) == (3, 1)


def test_an_abort_the_engine_is_slow_to_answer_is_never_sent_twice():
    # Slow is not dead: past the timeout the abort is unacknowledged, and the
    # engine, which has it, gets no copy (a retry used to resend it twice).
    result, requests, queue, took = _against_script([None, 200, 200], timeout=0.3)
    assert result == "unacknowledged"
    assert requests == [b'{"rid":"' + b"r" * 32 + b'"}']
    assert (queue.requests, queue.pool.opened) == (1, 1)
    assert took >= 0.3  # it waited out the try's timeout: slow, not refused
