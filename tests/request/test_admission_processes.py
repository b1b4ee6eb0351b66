"""What each process deciding its own queue order costs in fairness
(docs/overload.md): several processes' queues share one fleet's room (as
the engines' readings share it across ``--workers`` and replicas), each
ordering only its own requests. Two tenants of equal weight, one sending ten
times the other's load; the light one's requests spread over the processes
like the heavy one's, or all on one process (a keep-alive connection stays
on one process). Jain's index over the work each got admitted."""

from __future__ import annotations

import pytest

from asgi_generate.request.admission import Ask, Queue, Room

CAPACITY = 8


def run(processes: int, pinned: bool, steps: int = 400) -> tuple[float, float]:
    """Jain's index of the two tenants' admitted work, and the light one's share."""
    queues: list[Queue] = []

    def room() -> Room:
        held = sum(c.held for q in queues for c in q.classes)
        return Room(max(0, CAPACITY - held), CAPACITY, CAPACITY)

    queues += [Queue(["rollout"], room, reserved_share=0.0, depth=10**6) for _ in range(processes)]
    waiting: dict = {}  # in arrival order: the run is deterministic
    running: list = []
    got = {"heavy": 0.0, "light": 0.0}
    backlog = {"heavy": 0, "light": 0}
    spread = 0
    for step in range(steps):
        now = float(step)
        for q, e in running:
            q.release(e, None, now)
        for k in range(processes):  # each process pumps on its own events, in turn
            queues[(step + k) % processes].pump(now)
        running = [(q, e) for q, e in waiting if e.granted]
        for item in running:
            del waiting[item]
            backlog[item[1].ask.tenant] -= 1
            if step >= 20:
                got[item[1].ask.tenant] += item[1].ask.work
        for tenant, n in (("heavy", 50), ("light", 5)):
            for _ in range(min(n, 40 - backlog[tenant])):
                if tenant == "light" and pinned:
                    q = queues[0]
                else:
                    q = queues[spread % processes]
                    spread += 1
                waiting[(q, q.enqueue(Ask("sglang", 0, tenant, 1, 100.0), now))] = None
                backlog[tenant] += 1
    x = list(got.values())
    return sum(x) ** 2 / (2 * sum(v * v for v in x)), got["light"] / sum(x)


@pytest.mark.parametrize("processes, pinned, index, light", [
    (1, False, 1.0, 0.5), (2, False, 1.0, 0.5), (4, False, 1.0, 0.5), (8, False, 1.0, 0.5),
    (2, True, 0.998, 0.476), (4, True, 0.996, 0.469), (8, True, 0.989, 0.552),
])
def test_fairness_across_processes(processes, pinned, index, light):
    got_index, got_light = run(processes, pinned)
    assert (round(got_index, 3), round(got_light, 3)) == (index, light)
    assert got_index >= 0.95
