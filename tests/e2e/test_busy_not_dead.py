"""A worker doing what the frontend asked is not dead (workers/probes.py,
ops/fanout.py): while a weight load the frontend sent is in flight, and
while the engine is paused by the frontend's call, a silent health route
does not take the worker out; the resume reaches every engine that was
paused, whatever the probes said, and the answer names one that did not
take it.

SGLang's ``/health`` runs a one-token generation that a paused or loading
scheduler does not serve (the simulator plays it); vLLM's answers at once,
so there the same run checks only that nothing else breaks."""

from __future__ import annotations

import threading

import httpx
import pytest

from support import generating, post, sampled, sse, start_frontend, start_sim, stats, stream_answer, wait_until
from wire_proxy import WireProxy

pytestmark = pytest.mark.e2e

N = 60
PROMPT = [300, 7, 8]
LOAD_S = 5
#: A probe that gets no answer within this gives up; two in a row take an
#: up worker out (today's rule for a worker not busy with a call).
PROBE = ["--health-timeout", "1", "--health-failures", "2"]


def _stream(protocol: str, url: str, rid: str) -> tuple[threading.Thread, list]:
    if protocol == "sglang":
        path, body = "/generate", {"rid": rid, "input_ids": PROMPT, "stream": True,
                                   "sampling_params": {"max_new_tokens": N, "ignore_eos": True}}
    else:
        path, body = "/inference/v1/generate", {"request_id": rid, "token_ids": PROMPT, "stream": True,
                                                "sampling_params": {"max_tokens": N, "ignore_eos": True}}
    out: list = [None]
    thread = threading.Thread(target=lambda: out.__setitem__(0, sse(url, body, path)))
    thread.start()
    return thread, out


def _worker(fe, wid: str) -> dict:
    return httpx.get(fe.url + "/stats", timeout=10).json()["workers"][wid]


class _Rotation:
    """Reads the frontend's ``/stats`` for one worker in a thread until
    stopped: every ``in_rotation`` seen (a sample; ``times_down`` is the
    exact count)."""

    def __init__(self, fe, wid: str) -> None:
        self.seen: set[bool] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fe, wid))
        self._thread.start()

    def _run(self, fe, wid: str) -> None:
        while not self._stop.wait(0.05):
            try:
                self.seen.add(_worker(fe, wid)["in_rotation"])
            except httpx.HTTPError:  # a failed test stopped the frontend
                return

    def stop(self) -> set[bool]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


# vLLM's /health never stalls: its case guards the rule, on one worker class.
@pytest.mark.parametrize("protocol, worker_class", [("sglang", "trio"), ("sglang", "asyncio"), ("vllm", "trio")])
def test_a_weight_load_with_health_silent_keeps_the_worker_and_its_paused_stream(protocol, worker_class):
    sim = start_sim(protocol, itl_ms=20, extra=["--weight-load-s", str(LOAD_S)])
    fe = start_frontend([f"{protocol}={sim.url}"], worker_class=worker_class, extra=PROBE)
    rotation = None
    try:
        thread, out = _stream(protocol, fe.url, f"kept-{protocol}")
        generating(sim, running=1, tokens=3)
        rotation = _Rotation(fe, "w0")
        if protocol == "sglang":
            assert post(fe.url, {"mode": "in_place"}, "/pause_generation").status_code == 200
        else:
            assert post(fe.url, {}, "/pause?mode=keep").status_code == 200
        (k,) = stats(sim)["running_output_tokens"].values()  # held in place: no token more until the resume
        if protocol == "sglang":
            r = post(fe.url, {"model_path": "/ckpt", "weight_version": "v2"}, "/update_weights_from_disk")
        else:
            info = {"master_address": "127.0.0.1", "master_port": 29611, "rank_offset": 1}
            assert post(fe.url, {"init_info": info}, "/init_weight_transfer_engine").status_code == 200
            r = post(fe.url, {"update_info": {"names": ["w"]}}, "/update_weights")
        assert r.status_code == 200, r.text
        if protocol == "sglang":
            assert stats(sim)["health_waits"] >= 1  # the probes found /health silent
            assert post(fe.url, {}, "/continue_generation").status_code == 200
        else:
            assert post(fe.url, {}, "/resume").status_code == 200
        thread.join(30)
        assert rotation.stop() == {True}
        status, chunks = out[0]
        assert status == 200
        ids, finish = stream_answer(protocol, chunks)
        if protocol == "sglang":
            assert finish == {"type": "length", "length": N}
            # The load landed while the stream was held: the rest is the new weights'.
            assert ids[:k] == sampled(PROMPT, 0, k, True)
            assert ids[k:] == sampled(PROMPT + ids[:k], 0, N - k, True, version="v2")
        else:
            assert finish == "length"
            assert ids == sampled(PROMPT, 0, N, True)
        resume = "/continue_generation" if protocol == "sglang" else "/resume"
        assert stats(sim)["admin_calls"][resume] == 1  # the engine got the resume
        w0 = _worker(fe, "w0")
        assert (w0["state"], w0["in_rotation"], w0["times_down"]) == ("up", True, 0)
    finally:
        if rotation is not None:
            rotation.stop()
        fe.stop()
        sim.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_the_resume_reaches_every_paused_engine_and_names_one_that_refused(protocol, worker_class):
    sims = [start_sim(protocol) for _ in range(3)]
    broken = threading.Event()
    # w1's health probes find their connection closed (a fault of the path,
    # not of the engine): it is taken for lost while paused.
    proxy = WireProxy(sims[1].url, drop=lambda seen: broken.is_set() and seen.path == "/health")
    fe = start_frontend([f"{protocol}={s.url}" for s in (sims[0], proxy, sims[2])], worker_class=worker_class,
                        extra=["--health-timeout", "1"])
    pause, resume = ("/pause_generation", "/continue_generation") if protocol == "sglang" else ("/pause", "/resume")
    try:
        assert post(fe.url, {"mode": "in_place"} if protocol == "sglang" else {}, pause).status_code == 200
        assert [stats(s)["admin_calls"][pause] for s in sims] == [1, 1, 1]
        broken.set()
        wait_until(lambda: _worker(fe, "w1")["state"] == "down")
        sims[2].stop()  # w2 is gone: its connection is refused
        wait_until(lambda: _worker(fe, "w2")["state"] == "down")
        r = post(fe.url, {}, resume)
        assert r.status_code == 502
        answers = r.json()
        assert [(a["worker"], a["status"]) for a in answers] == [("w0", 200), ("w1", 200), ("w2", None)]
        assert answers[0]["body"] == answers[1]["body"] == (
            {"message": "Generation continued successfully.", "status": "ok"} if protocol == "sglang"
            else {"status": "resumed"})
        assert answers[2]["skipped"] is True and answers[2]["body"].startswith("down: ")
        assert [stats(s)["admin_calls"].get(resume) for s in sims[:2]] == [1, 1]
        assert [s.path for s in proxy.requests(resume)] == [resume]
        # w1 took it: no longer paused, it is skipped as down; w2 is still called.
        r = post(fe.url, {}, resume)
        assert r.status_code == 502
        assert [(a["worker"], a["status"], a.get("skipped", False)) for a in r.json()] == [
            ("w0", 200, False), ("w1", None, True), ("w2", None, True)]
        assert [stats(s)["admin_calls"][resume] for s in sims[:2]] == [2, 1]
    finally:
        fe.stop()
        proxy.stop()
        for s in sims:
            s.stop()
