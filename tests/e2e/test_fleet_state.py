"""One fleet across processes (asgi_generate/workers/fleet_state.py): under
``serve --workers 2`` a trainer's pause, weight update and resume reach one
process through the shared port, and every process learns them from the
engines: each stream the pause aborted is held and resumed exactly on the
new weights, whichever process served it, and none is recorded ``ok`` with
the engine's abort."""

from __future__ import annotations

import glob
import threading

import httpx
import pytest

from support import (Proc, finish_type, generating, listening_socket, post, sampled, sse, start_frontend, start_sim,
                     stats, stream_answer, trace_records, wait_until)

pytestmark = pytest.mark.e2e

N = 100


def _streams_per_process(fe: Proc) -> dict[int, int]:
    """Streams each of the 2 processes has on its workers now (its
    ``/stats``, asked on fresh connections until both answered)."""
    seen: dict[int, int] = {}
    for _ in range(200):
        with httpx.Client(timeout=10) as client:
            got = client.get(fe.url + "/stats").json()
        seen[got["pid"]] = sum(w["outstanding"] for w in got["workers"].values())
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only {seen} answered")


def _body(protocol: str, i: int, tag: str) -> tuple[str, dict]:
    prompt = [300 + i, 7, 8]
    if protocol == "sglang":
        return "/generate", {"rid": f"{tag}-{i}", "input_ids": prompt, "stream": True,
                             "sampling_params": {"max_new_tokens": N, "ignore_eos": True}}
    return "/inference/v1/generate", {"request_id": f"{tag}-{i}", "token_ids": prompt, "stream": True,
                                      "sampling_params": {"max_tokens": N, "ignore_eos": True}}


def _answer(protocol: str, chunks: list[bytes]) -> tuple[list[int], str | None]:
    ids, finish = stream_answer(protocol, chunks)
    return ids, finish_type(finish)


def _cycle(url: str, protocol: str, version: str, transaction: str) -> None:
    """Pause (abort), load ``version``, resume: each call through the shared
    port; or (``transaction`` ``"abort_all"``) SGLang's
    ``/update_weight_version``, which aborts every running request without
    pausing (``abort_all_requests`` true by default)."""
    if transaction == "abort_all":
        r = post(url, {"new_version": version}, "/update_weight_version")
        assert r.status_code == 200, r.text
    elif protocol == "sglang":
        assert post(url, {"mode": "abort"}, "/pause_generation").status_code == 200
        r = post(url, {"model_path": "/ckpt", "weight_version": version}, "/update_weights_from_disk")
        assert r.status_code == 200, r.text
        assert post(url, {}, "/continue_generation").status_code == 200
    else:
        assert post(url, {}, "/pause?mode=abort").status_code == 200
        assert post(url, {"weight_version": version}, "/finish_weight_update").status_code == 200
        assert post(url, {}, "/resume").status_code == 200


@pytest.mark.parametrize("protocol, transaction", [("sglang", "pause"), ("vllm", "pause"), ("sglang", "abort_all")])
@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_two_processes_hold_and_resume_every_stream_a_pause_aborted(tmp_path, worker_class, protocol, transaction):
    """Six streams (more until both processes serve some, at most 32), pause with
    abort, a weight load and the resume through the shared port; or a
    weight call that aborts without pausing, which no engine reports: the
    process that took it tells its sibling before the engines abort."""
    sims = [start_sim(protocol, itl_ms=20) for _ in range(2)]
    base = str(tmp_path / "t")
    fe = None
    try:
        fe = Proc("frontend-workers", ["serve", "--workers", "2", "--worker-class", worker_class,
                                       *(a for s in sims for a in ("--worker", f"{protocol}={s.url}")),
                                       "--health-interval", "0.2", "--log-level", "warning",
                                       "--resume-after-pause", "--pause-hold-timeout", "10",
                                       "--trace-file", base + ".jsonl"], listening_socket(), "/health")
        out: list = []
        threads: list[threading.Thread] = []

        def one(i: int) -> None:
            path, body = _body(protocol, i, "fleet")
            out[i] = sse(fe.url, body, path)  # a connection of its own: either process may take it

        # Six streams, and more (bounded) until both processes serve some:
        # the kernel places each connection on either process.
        while len(threads) < 6 or (len(threads) < 32 and min(_streams_per_process(fe).values()) == 0):
            out.append(None)
            threads.append(threading.Thread(target=one, args=(len(threads),)))
            threads[-1].start()
            if len(threads) >= 6:
                wait_until(lambda: sum(stats(s)["running"] for s in sims) == len(threads))
        assert min(_streams_per_process(fe).values()) > 0
        wait_until(lambda: all(n >= 1 for s in sims for n in stats(s)["running_output_tokens"].values()))
        _cycle(fe.url, protocol, "v1", transaction)
        for t in threads:
            t.join(30)
        wait_until(lambda: len(trace_records(base + ".*.jsonl")) == len(out), timeout=30)
        by_pid: dict[str, int] = {}
        records = {}
        for f in glob.glob(base + ".*.jsonl"):
            pid = f[len(base) + 1:].split(".")[0]  # the files are BASE.PID.*
            for r in trace_records(f):
                records[r["public_id"]] = r
                by_pid[pid] = by_pid.get(pid, 0) + 1
        for i, (status, chunks) in enumerate(out):
            ids, finish = _answer(protocol, chunks)
            rec = records[f"fleet-{i}"]
            segments = [(s["weight_version"], s["tokens"]) for s in rec.get("segments", [])]
            assert (status, len(ids), finish, rec["status"], rec.get("pause_resumes")) == (200, N, "length", "ok", 1), \
                (i, segments, by_pid)
            (v0, k), (v1, rest) = segments
            assert (v0, v1, k + rest) == ("default", "v1", N) and 0 < k < N
            prompt = [300 + i, 7, 8]
            assert ids[:k] == sampled(prompt, 0, k, True, version="default")
            assert ids[k:] == sampled(prompt + ids[:k], 0, N - k, True, version="v1")
    finally:
        if fe is not None:
            fe.stop()
        for s in sims:
            s.stop()


def test_the_simulators_say_whether_they_are_paused_as_the_engines_do():
    """SGLang ``GET /ready``: 200, empty, and 503 while paused in any mode
    (``tokenizer_manager.is_ready``) or unhealthy; vLLM ``GET /is_paused``
    in any mode and ``/weight_info``: what every frontend process reads."""
    sg, vl = start_sim("sglang"), start_sim("vllm")
    try:
        r = httpx.get(sg.url + "/ready")
        assert (r.status_code, r.content, r.headers["content-length"]) == (200, b"", "0")
        for mode in ("abort", "retract", "in_place"):
            assert post(sg.url, {"mode": mode}, "/pause_generation").status_code == 200
            r = httpx.get(sg.url + "/ready")
            assert (r.status_code, r.content) == (503, b""), mode
            assert post(sg.url, {}, "/continue_generation").status_code == 200
            assert httpx.get(sg.url + "/ready").status_code == 200
        assert post(sg.url, {"count": 1, "after_tokens": 0}, "/sim/faults").status_code == 200
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        with pytest.raises(httpx.HTTPError):
            post(sg.url, body)  # the armed request drops its connection: health answers 503 from now on
        assert httpx.get(sg.url + "/health").status_code == 503 and httpx.get(sg.url + "/ready").status_code == 503
        assert httpx.delete(sg.url + "/sim/faults").status_code == 200
        assert httpx.get(sg.url + "/ready").status_code == 200
        assert httpx.get(sg.url + "/model_info").json()["weight_version"] == "default"
        for mode in ("abort", "wait", "keep"):
            assert httpx.get(vl.url + "/is_paused").json() == {"is_paused": False}
            assert post(vl.url, {}, f"/pause?mode={mode}").status_code == 200
            assert httpx.get(vl.url + "/is_paused").json() == {"is_paused": True}, mode
            assert post(vl.url, {}, "/resume").status_code == 200
        assert post(vl.url, {"new_version": "v3"}, "/update_weight_version").status_code == 200
        assert httpx.get(vl.url + "/weight_info").json() == {"weight_version": "v3"}
    finally:
        sg.stop()
        vl.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_version_a_chunk_shows_is_read_from_the_fleet_at_once(worker_class):
    """The engine's version moved behind this process (another replica's
    call, without aborting): the first chunk that shows it has the fleet
    read now, though the periodic reading is an hour away."""
    sim = start_sim("sglang", itl_ms=20)
    fe = None
    try:
        fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class,
                            extra=["--fleet-state-interval", "3600", "--log-level", "warning"])
        got: list = []
        body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": N, "ignore_eos": True}}
        t = threading.Thread(target=lambda: got.append(sse(fe.url, body)))
        t.start()
        generating(sim, running=1, tokens=3)
        r = post(sim.url, {"new_version": "v9", "abort_all_requests": False}, "/update_weight_version")
        assert r.status_code == 200, r.text

        def learned():
            s = httpx.get(fe.url + "/stats", timeout=5).json()
            return s if s["fleet_weight_versions"] == {"sglang": "v9"} else None
        s = wait_until(learned, timeout=20)
        assert s["fleet_state"]["version_triggers"] >= 1 and s["workers"]["w0"]["weight_version"] == "v9"
        t.join(30)
        status, chunks = got[0]
        ids, finish = _answer("sglang", chunks)
        assert (status, len(ids), finish) == (200, N, "length")
    finally:
        if fe is not None:
            fe.stop()
        sim.stop()


def _byid(i: int) -> str:
    """Stream ``i``'s id, all of one width so that none is another's prefix:
    an SGLang abort by rid ends every request whose rid starts with it
    (``scheduler.py`` ``abort_request``), so aborting ``byid-1`` would end
    ``byid-11`` too."""
    return f"byid-{i:02d}"


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_an_abort_by_id_reaches_the_requests_of_every_process(protocol):
    """``serve --workers 2``: an abort by id taken by either process ends
    the named stream wherever it runs (the siblings are told), and no other."""
    sims = [start_sim(protocol, itl_ms=20)]
    fe = None
    try:
        fe = Proc("frontend-workers", ["serve", "--workers", "2", "--worker", f"{protocol}={sims[0].url}",
                                       "--log-level", "warning"], listening_socket(), "/health")
        out: list = []
        threads: list[threading.Thread] = []

        def one(i: int) -> None:
            path, body = _body(protocol, i, "byid")
            body["rid" if protocol == "sglang" else "request_id"] = _byid(i)
            body["sampling_params"]["max_" + ("new_tokens" if protocol == "sglang" else "tokens")] = 2000
            out[i] = sse(fe.url, body, path)

        while len(threads) < 4 or (len(threads) < 32 and min(_streams_per_process(fe).values()) == 0):
            out.append(None)
            threads.append(threading.Thread(target=one, args=(len(threads),)))
            threads[-1].start()
            if len(threads) >= 4:
                wait_until(lambda: stats(sims[0])["running"] == len(threads))
        assert min(_streams_per_process(fe).values()) > 0
        kept = len(threads) - 1  # the last one runs on
        for i in range(kept):
            rid = _byid(i)
            if protocol == "sglang":
                r = post(fe.url, {"rid": rid}, "/abort_request")
                assert (r.status_code, r.content) == (200, b"")
            else:
                r = post(fe.url, {"request_ids": [rid]}, "/abort_requests")
                assert (r.status_code, r.json()) == (200, {"status": "aborted", "aborted": 1})
        for t in threads[:kept]:
            t.join(30)
        assert [_answer(protocol, out[i][1])[1] for i in range(kept)] == ["abort"] * kept
        assert threads[-1].is_alive() and stats(sims[0])["running"] == 1
        last = _byid(kept)
        post(fe.url, {"rid": last} if protocol == "sglang" else {"request_ids": [last]},
             "/abort_request" if protocol == "sglang" else "/abort_requests")
        threads[-1].join(30)
        assert _answer(protocol, out[-1][1])[1] == "abort"
    finally:
        if fe is not None:
            fe.stop()
        for s in sims:
            s.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_one_sglang_engine_not_ready_is_taken_out_not_read_as_a_pause(worker_class):
    """An engine turned unhealthy (a dropped stream, then its health route
    answers 503): SGLang's /ready answers 503 then, as it does while paused.
    One engine alone is no fleet pause: the frontend learns none, and takes
    that worker out when its probes fail."""
    sims = [start_sim("sglang"), start_sim("sglang")]
    # The engines' pause state is read every 0.1 s, so a reading sees the
    # sick engine's /ready 503 before its three failed probes (1.5 s) are in.
    fe = start_frontend([f"sglang={s.url}" for s in sims], worker_class=worker_class,
                        extra=["--health-interval", "0.5", "--fleet-state-interval", "0.1"])
    try:
        httpx.post(sims[0].url + "/sim/faults", json={"count": 1, "after_tokens": 1}, timeout=5).raise_for_status()
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        while not stats(sims[0])["down"]:  # least-outstanding spreads them: a few at most
            resp = post(fe.url, body)
            assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 4
        assert httpx.get(sims[0].url + "/ready", timeout=5).status_code == 503
        wait_until(lambda: not httpx.get(fe.url + "/stats", timeout=5).json()["workers"]["w0"]["in_rotation"])
        s = httpx.get(fe.url + "/stats", timeout=5).json()
        assert (s["fleet_state"]["pauses_learned"], s["fleet_state"]["paused_seen"], s["pauses"]["paused"]) == (0, [], [])
        assert (s["workers"]["w0"]["times_down"], httpx.get(fe.url + "/health", timeout=5).json()) == (
            1, {"status": "ok", "healthy_workers": 1})
    finally:
        fe.stop()
        for sim in sims:
            sim.stop()
