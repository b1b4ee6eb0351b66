"""An RL trainer's loop against the frontend, written from the request shapes
the published frameworks send (slime's SGLang calls: init_weights_update_group,
pause_generation abort, update_weights_from_distributed with a weight version,
continue_generation; the vLLM RL API's: get_world_size,
init_weight_transfer_engine, pause?mode=abort, start_weight_update,
update_weights, finish_weight_update, resume), over 4 simulators of each
engine with different tensor-parallel sizes, while rollouts stream.

:func:`run` checks, and returns what went wrong (empty: all good):

- the group's ranks: each engine's ``rank_offset`` after the previous
  engines' parallel sizes, one ``world_size``, no overlap in the
  simulators' shared registry;
- with ``--resume-after-pause``, every stream cut by the pause completes
  exactly: the tokens of each segment equal a fresh request's on that
  version with that prefix, and its record shows the segments;
- without it (the request's header set to 0), every stream ends with the
  engine's abort;
- one worker failing its update: 502 naming it, the worker out of the
  rotation, new requests only on workers at the new version;
- with several frontend processes (``serve --workers N``: the calls go to
  whichever process the shared port gives them) or replicas (``replicas``
  ``serve`` processes sharing the simulators; the calls go to the first,
  the streams to each in turn): all of the above on every process, and a
  request asking for the new version (the minimum-version header) runs
  only on it, on every process.

Used by tests/e2e/test_trainer_loop.py (a few streams) and
bench/bench_trainer_loop.py (50).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson

from support import (finish_type, post, sampled, sse, start_frontend, start_sim, stats, stream_answer, trace_records,
                     wait_until)

SGLANG_TP = (1, 2, 1, 2)
VLLM_TP = (1, 2, 2, 4)
N = 120
RESUME = "asgi-generate-resume-after-pause"
MIN_VERSION = "asgi-generate-min-weight-version"
TENSORS = {"names": ["model.layers.0.mlp.up_proj.weight"], "dtypes": ["bfloat16"], "shapes": [[8, 8]]}


class Fleet:
    """4 SGLang and 4 vLLM simulators (ITL 20 ms) sharing a rank registry,
    behind ``replicas`` frontends (each ``serve --workers processes``) with
    ``--resume-after-pause`` and a trace file (one per process)."""

    def __init__(self, tmp: str, worker_class: str, processes: int = 1, replicas: int = 1) -> None:
        self.registry = f"{tmp}/groups.json"
        self.processes = processes
        shared = ["--weights-group-registry", self.registry]
        specs = [(protocol, tp) for protocol, sizes in (("sglang", SGLANG_TP), ("vllm", VLLM_TP)) for tp in sizes]
        self.fes = []
        with ThreadPoolExecutor(len(specs)) as pool:  # started side by side: each waits for its health
            started = [pool.submit(start_sim, p, itl_ms=20, extra=["--tp-size", str(tp), *shared]) for p, tp in specs]
        self.sims = [f.result() for f in started if f.exception() is None]
        try:
            if len(self.sims) < len(specs):
                raise next(f.exception() for f in started if f.exception() is not None)
            self.trace = f"{tmp}/trace"
            workers = [f"{'sglang' if i < 4 else 'vllm'}={s.url}" for i, s in enumerate(self.sims)]
            extra = ["--resume-after-pause", "--trace-file", self.trace + ".jsonl",
                     *(["--workers", str(processes)] if processes > 1 else [])]
            with ThreadPoolExecutor(replicas) as pool:
                started = [pool.submit(start_frontend, workers, worker_class=worker_class, extra=extra)
                           for _ in range(replicas)]
            self.fes = [f.result() for f in started if f.exception() is None]
            if len(self.fes) < replicas:
                raise next(f.exception() for f in started if f.exception() is not None)
            #: The replica that takes every control call.
            self.fe = self.fes[0]
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every process it started."""
        for p in [*self.sims, *self.fes]:
            p.stop()

    def records(self) -> dict[str, dict]:
        """The trace records so far, by public id."""
        return {r.get("public_id", ""): r for r in trace_records(self.trace + ".*.jsonl")}

    def every_stats(self) -> list[dict]:
        """``/stats`` of every frontend process: each replica's, and each
        process of a ``--workers N`` one (asked anew until every one of its
        processes answered; bounded)."""
        out = []
        for fe in self.fes:
            seen: dict[int, dict] = {}
            deadline = time.monotonic() + 30
            while len(seen) < self.processes and time.monotonic() < deadline:
                with httpx.Client(timeout=10) as client:  # a connection of its own: any process may take it
                    got = client.get(fe.url + "/stats").json()
                seen[got["pid"]] = got
            out += seen.values()
        return out


def _prompt(i: int) -> list[int]:
    return [200 + i % 97, 11, 12 + i // 97]


def _request(protocol: str, i: int, tag: str) -> tuple[str, dict]:
    if protocol == "sglang":
        return "/generate", {"rid": f"{tag}-{i}", "input_ids": _prompt(i), "stream": True,
                             "sampling_params": {"max_new_tokens": N, "ignore_eos": True}}
    return "/inference/v1/generate", {"request_id": f"{tag}-{i}", "token_ids": _prompt(i), "stream": True,
                                      "sampling_params": {"max_tokens": N, "ignore_eos": True}}


def _answer(protocol: str, chunks: list[bytes]) -> tuple[list[int], str | None]:
    """A stream's output ids and finish reason type."""
    ids, finish = stream_answer(protocol, chunks)
    return ids, finish_type(finish)


def _rollouts(fleet: Fleet, streams: int, tag: str, resume: bool) -> tuple[list[threading.Thread], list]:
    """``streams`` streams over both protocols, half each."""
    out: list = [None] * streams
    headers = {} if resume else {RESUME: "0"}

    def one(i: int) -> None:
        protocol = "sglang" if i % 2 == 0 else "vllm"
        path, body = _request(protocol, i, tag)
        out[i] = (protocol, *sse(fleet.fes[i % len(fleet.fes)].url, body, path, headers=headers))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    return threads, out


def _received(fleet: Fleet) -> int:
    return sum(stats(s)["received"] for s in fleet.sims)


def _tokens_out(fleet: Fleet, streams: int) -> bool:
    """Whether the fleet runs ``streams`` requests, each with a token out."""
    counts = [n for s in fleet.sims for n in stats(s)["running_output_tokens"].values()]
    return len(counts) == streams and min(counts) >= 1


def _step(fleet: Fleet, version: str, problems: list[str]) -> None:
    """One weight update of both fleets: pause (abort), load, resume."""
    url = fleet.fe.url
    for path, body in (("/pause_generation", {"mode": "abort"}), ("/pause?mode=abort", {})):
        if (r := post(url, body, path)).status_code != 200:
            problems.append(f"{path}: {r.status_code} {r.text}")
    sg = post(url, {**TENSORS, "group_name": "slime", "flush_cache": True, "weight_version": version},
              "/update_weights_from_distributed")
    if sg.status_code != 200:
        problems.append(f"update_weights_from_distributed: {sg.status_code} {sg.text}")
    for path, body in (("/start_weight_update", {}),
                       ("/update_weights", {"update_info": {"names": TENSORS["names"], "dtype_names": TENSORS["dtypes"],
                                                            "shapes": TENSORS["shapes"]}}),
                       ("/finish_weight_update", {"weight_version": version})):
        if (r := post(url, body, path)).status_code != 200:
            problems.append(f"{path}: {r.status_code} {r.text}")
    for path in ("/continue_generation", "/resume"):
        if (r := post(url, {}, path)).status_code != 200:
            problems.append(f"{path}: {r.status_code} {r.text}")


def _init_groups(fleet: Fleet, problems: list[str]) -> None:
    url = fleet.fe.url
    r = post(url, {"master_address": "127.0.0.1", "master_port": 29510, "rank_offset": 1, "group_name": "slime",
                   "backend": "nccl"}, "/init_weights_update_group")
    got = r.json() if r.status_code == 200 else {}
    want = [1, 2, 4, 5]  # after tp sizes 1, 2, 1, 2
    if [a["rank_offset"] for a in got.get("assignment", [])] != want or got.get("world_size") != 7:
        problems.append(f"SGLang group: {r.status_code} {r.text}")
    world = httpx.get(url + "/get_world_size", timeout=10).json().get("world_size")
    if world != sum(VLLM_TP):
        problems.append(f"vLLM world size {world}, not {sum(VLLM_TP)}")
    info = {"master_address": "127.0.0.1", "master_port": 29511, "rank_offset": 1, "world_size": 1 + sum(VLLM_TP)}
    r = post(url, {"init_info": info}, "/init_weight_transfer_engine")
    got = r.json() if r.status_code == 200 else {}
    if [a["rank_offset"] for a in got.get("assignment", [])] != [1, 2, 4, 6]:
        problems.append(f"vLLM transfer engine: {r.status_code} {r.text}")
    groups = orjson.loads(open(fleet.registry, "rb").read())
    for key, members in groups.items():
        ranks = sorted(r for m in members for r in range(m["rank_offset"], m["rank_offset"] + m["ranks"]))
        if len(ranks) != len(set(ranks)) or ranks != list(range(1, 1 + len(ranks))):
            problems.append(f"group {key}: ranks {ranks}")


def _resumed_exactly(fleet: Fleet, out: list, tag: str, old: str, new: str, problems: list[str]) -> None:
    wait_until(lambda: sum(k.startswith(tag + "-") for k in fleet.records()) == len(out), timeout=30)
    records = fleet.records()
    for i, (protocol, status, chunks) in enumerate(out):
        ids, finish = _answer(protocol, chunks)
        rec = records.get(f"{tag}-{i}", {})
        segments = [(s["weight_version"], s["tokens"]) for s in rec.get("segments", [])]
        if status == 200 and not segments and ids == sampled(_prompt(i), 0, N, True, version=old):
            continue  # it finished before the pause (a loaded machine): exact on the old weights
        if status != 200 or len(ids) != N or finish != "length" or len(segments) != 2:
            problems.append(f"{tag}-{i} ({protocol}): {status}, {len(ids)} tokens, {finish}, segments {segments}")
            continue
        (v0, k), (v1, _) = segments
        if (v0, v1) != (old, new) or ids[:k] != sampled(_prompt(i), 0, k, True, version=old) \
                or ids[k:] != sampled(_prompt(i) + ids[:k], 0, N - k, True, version=new):
            problems.append(f"{tag}-{i} ({protocol}): tokens differ from the versions' ({segments})")


def _ended_with_abort(out: list, tag: str, problems: list[str]) -> None:
    for i, (protocol, status, chunks) in enumerate(out):
        ids, finish = _answer(protocol, chunks)
        if status == 200 and finish == "length" and len(ids) == N:
            continue  # it finished before the pause (a loaded machine)
        if status != 200 or finish != "abort":
            problems.append(f"{tag}-{i} ({protocol}) without resume: {status}, {len(ids)} tokens, {finish}")


def _failed_worker(fleet: Fleet, version: str, problems: list[str]) -> None:
    url = fleet.fe.url
    post(fleet.sims[3].url, {"weight_updates": 1}, "/sim/faults")
    r = post(url, {**TENSORS, "group_name": "slime", "weight_version": version}, "/update_weights_from_distributed")
    results = r.json() if r.status_code == 502 else []
    if [(x["worker"], x["status"]) for x in results if x["status"] != 200] != [("w3", 400)]:
        problems.append(f"a failed update: {r.status_code} {r.text}")
    w3 = httpx.get(url + "/stats", timeout=10).json()["workers"]["w3"]
    if w3["in_rotation"] or not w3["fence"]:
        problems.append(f"w3 after its failed update: {w3}")
    # Every process: the fence (siblings are told; another replica reads
    # the fleet's new version from the engines, so w3, behind, leaves its
    # rotation too), within the reading interval.
    try:
        wait_until(lambda: all(not s["workers"]["w3"]["in_rotation"] for s in fleet.every_stats()), timeout=15)
    except AssertionError:
        problems.append(f"w3 still in a rotation: {[s['workers']['w3'] for s in fleet.every_stats()]}")
    if fleet.processes > 1:
        fenced = [bool(s["workers"]["w3"]["fence"]) for s in fleet.every_stats()[:fleet.processes]]
        if not all(fenced):
            problems.append(f"w3 fenced on the process that took the call only: {fenced}")
    before = stats(fleet.sims[3])["received"]
    for i in range(8):
        path, body = _request("sglang", i, f"after-{version}")
        body["stream"], body["sampling_params"]["max_new_tokens"] = False, 2
        # A sibling told of the fence later than the 1 s its teller waits (a
        # loaded machine) may answer 503 until it applied it: bounded.
        deadline = time.monotonic() + 15
        while (r := post(fleet.fes[i % len(fleet.fes)].url, body, path)).status_code == 503 \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        if r.status_code != 200:
            problems.append(f"a request after the update: {r.status_code} {r.text}")
        elif (got := r.json()["meta_info"]["weight_version"]) != version:
            problems.append(f"a request after the update ran on weight version {got}")
    if stats(fleet.sims[3])["received"] != before:
        problems.append("the fenced worker got requests")


def _min_version(fleet: Fleet, version: str, problems: list[str]) -> None:
    """A request asking for ``version`` at least runs only on it, on every
    process (a 503 from a process not at that version yet is allowed,
    until it is: bounded)."""
    for n, fe in enumerate(fleet.fes):
        for i in range(2 * fleet.processes):
            path, body = _request("sglang", i, f"min-{version}-{n}")
            body["stream"], body["sampling_params"]["max_new_tokens"] = False, 2
            deadline = time.monotonic() + 15
            while True:
                with httpx.Client(timeout=30) as client:  # a connection of its own: any process may take it
                    r = client.post(fe.url + path, json=body, headers={MIN_VERSION: version})
                if r.status_code != 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            got = r.json()["meta_info"]["weight_version"] if r.status_code == 200 else None
            if got != version:
                problems.append(f"a request asking for {version} at least: {r.status_code}, ran on {got}")


def run(tmp: str, worker_class: str, streams: int, processes: int = 1,
        replicas: int = 1) -> tuple[list[str], dict[str, Any]]:
    """The whole loop, through ``replicas`` frontends of ``processes``
    processes each; what went wrong, and figures (seconds per phase)."""
    problems: list[str] = []
    figures: dict[str, Any] = {}
    fleet = Fleet(tmp, worker_class, processes, replicas)
    try:
        _init_groups(fleet, problems)
        for phase, resume, old, new in (("resumed", True, "default", "1"), ("aborted", False, "1", "2")):
            t0 = time.monotonic()
            received = _received(fleet)
            threads, out = _rollouts(fleet, streams, phase, resume)
            wait_until(lambda: _received(fleet) >= received + streams, timeout=30)
            wait_until(lambda: _tokens_out(fleet, streams), timeout=30)
            _step(fleet, new, problems)
            for t in threads:
                t.join(60)
            if resume:
                _resumed_exactly(fleet, out, phase, old, new, problems)
                _min_version(fleet, new, problems)
            else:
                _ended_with_abort(out, phase, problems)
            figures[f"{phase}_s"] = round(time.monotonic() - t0, 2)
        _failed_worker(fleet, "3", problems)
        every = fleet.every_stats()
        figures["pauses"] = {k: sum(s["pauses"][k] for s in every) for k in ("held", "resumed", "expired")}
        if figures["pauses"]["resumed"] < streams // 2:
            problems.append(f"only {figures['pauses']['resumed']} of {streams} streams were held and resumed")
    finally:
        fleet.stop()
    return problems, figures
