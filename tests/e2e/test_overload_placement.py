"""Room-aware placement end to end: with ``--admission``, a granted request
goes to a worker whose engine has room for it by the same readings
admission counts (its engine's other requests plus this process's there,
under ``--admission-worker-requests``), not wherever the policy would send
it. Two capacity-limited simulators per protocol (2 running each); one is
filled by requests sent straight to its engine (another client's, which
only its load reading shows); every request through the frontend then
runs on the other, as each engine's own request count says. Both worker
classes, both protocols."""

from __future__ import annotations

import httpx
import orjson
import pytest

from support import RawClient, post, sampled, start_frontend, start_sim, wait_until

pytestmark = pytest.mark.e2e

GENERATE = {"sglang": "/generate", "vllm": "/inference/v1/generate"}
ENGINE_LIMITS = {
    "sglang": ["--max-running-requests", "2", "--max-total-tokens", "4000", "--step-ms", "3"],
    "vllm": ["--max-num-seqs", "2", "--block-size", "4", "--num-gpu-blocks-override", "2000", "--step-ms", "3"],
}
#: Requests sent through the frontend per test.
THROUGH = 4


class Fleet:
    """Two capacity-limited simulators per protocol behind a frontend with
    admission (room 2 per worker)."""

    def __init__(self, worker_class: str) -> None:
        self.sims = {p: [start_sim(p, extra=ENGINE_LIMITS[p]) for _ in range(2)] for p in GENERATE}
        self.fe = start_frontend([f"{p}={s.url}" for p, sims in self.sims.items() for s in sims],
                                 worker_class=worker_class,
                                 extra=["--admission", "--admission-worker-requests", "2"])
        self.url = self.fe.url
        wait_until(lambda: self.admission()["saturation"]["readings"] >= 4)
        models = httpx.get(self.url + "/v1/models", timeout=5).json()
        self.ids = {w["url"]: w["id"] for w in models["workers"]}

    def admission(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=5).json()["admission"]

    def stop(self) -> None:
        self.fe.stop()
        for sims in self.sims.values():
            for sim in sims:
                sim.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fleet(request):
    started = Fleet(request.param)
    yield started
    started.stop()


def _body(protocol: str, prompt: list[int], n: int, stream: bool) -> dict:
    if protocol == "sglang":
        return {"input_ids": prompt, "stream": stream, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
    return {"token_ids": prompt, "stream": stream, "sampling_params": {"max_tokens": n, "ignore_eos": True}}


def _generated(sim) -> int:
    return httpx.get(sim.url + "/sim/stats", timeout=5).json()["generate_requests"]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_granted_request_runs_on_the_worker_with_room(fleet, protocol):
    """Worker A's engine runs 2 long streams another client sent it
    directly (its limit); admission's reading of A shows them. Each of 4
    requests sent one after another through the frontend is granted (B
    has room for 2) and runs on B: A's engine received only its 2, B's all
    4 (least-outstanding alone alternates, sending 2 of them to A's queue)."""
    full, roomy = fleet.sims[protocol]
    path = GENERATE[protocol]
    before = {s.url: _generated(s) for s in (full, roomy)}
    others = []
    for i in range(2):
        client = RawClient(full.url)
        client.send(orjson.dumps(_body(protocol, [80 + i, 81, 82], 2000, True)), path=path)
        assert len(client.events(2)) == 2  # running on A's engine
        others.append(client)
    try:
        a = fleet.ids[full.url]
        wait_until(lambda: fleet.admission()["saturation"]["workers"][a].get("engine_requests") == 2, 10)
        for i in range(THROUGH):
            prompt = [90 + i, 7, 8]
            got = post(fleet.url, _body(protocol, prompt, 6, False), path, timeout=30)
            assert got.status_code == 200
            tokens = got.json()["output_ids"] if protocol == "sglang" else got.json()["choices"][0]["token_ids"]
            assert tokens == sampled(prompt, 0, 6, ignore_eos=True)
        assert (_generated(full) - before[full.url], _generated(roomy) - before[roomy.url]) == (2, THROUGH)
    finally:
        for client in others:
            client.close()
