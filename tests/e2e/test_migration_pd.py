"""Migration of prefill/decode (P/D) requests.

A decode leg that dies mid-stream migrates: with no aggregated worker
(``--disaggregation always``) to a new pair, both of whose legs carry the
prompt plus the output sent so far; the client's answer is the
uninterrupted one. A prefill leg that dies before the handoff is a failover
to another pair, not a migration.
"""

from __future__ import annotations


import httpx
import orjson
import pytest

from support import DECODE, PREFILL, PROMPT, prefill_spec, sse, start_frontend, start_sim, wait_until, without_timing, trace_records

pytestmark = pytest.mark.e2e


class PDFleet:
    """``prefills`` x ``decodes`` simulators of ``protocol`` behind a traced
    frontend serving pairs only."""

    def __init__(self, protocol: str, tmp, prefills: int, decodes: int) -> None:
        self.protocol = protocol
        self.sims: dict[str, list] = {"prefill": [], "decode": []}
        self.fe = None
        try:
            for role, n in (("prefill", prefills), ("decode", decodes)):
                for _ in range(n):
                    if protocol == "sglang":
                        extra = PREFILL if role == "prefill" else DECODE
                    else:
                        extra = ["--kv-role", "producer" if role == "prefill" else "consumer"]
                    self.sims[role].append(start_sim(protocol, extra=extra))
            self.base = str(tmp / "trace")
            args = ["--trace-file", self.base + ".jsonl", "--disaggregation", "always"]
            for s in self.sims["prefill"]:
                args += ["--prefill", prefill_spec(s) if protocol == "sglang" else f"vllm={s.url}"]
            for s in self.sims["decode"]:
                args += ["--decode", f"{protocol}={s.url}"]
            self.fe = start_frontend([], extra=args)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.fe is not None:
            self.fe.stop()
        for s in self.sims["prefill"] + self.sims["decode"]:
            s.stop()

    def body(self, rid: str) -> tuple[str, dict, dict]:
        if self.protocol == "sglang":
            return "/generate", {"input_ids": PROMPT, "stream": True, "rid": rid, "return_logprob": True,
                                 "top_logprobs_num": 2, "return_routed_experts": True,
                                 "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}, {}
        return "/inference/v1/generate", {
            "token_ids": PROMPT, "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 8, "ignore_eos": True, "logprobs": 2}}, {"x-request-id": rid}

    def run(self, rid: str) -> list:
        path, body, headers = self.body(rid)
        status, events = sse(self.fe.url, body, path, headers=headers)
        assert status == 200
        values = [without_timing(orjson.loads(e)) if e != b"[DONE]" else e for e in events]
        for v in values[:-1]:  # the two runs' ids
            if self.protocol == "sglang":
                v["meta_info"]["id"] = "rid"
            else:
                v["request_id"] = "rid"
        return values

    def record(self, rid: str) -> dict:
        return wait_until(lambda: next((r for r in trace_records(self.base + ".*.jsonl")
                                        if r.get("public_id") == rid), None))

    def heal(self) -> None:
        for s in self.sims["prefill"] + self.sims["decode"]:
            httpx.delete(s.url + "/sim/faults", timeout=5).raise_for_status()
        total = len(self.sims["prefill"]) + len(self.sims["decode"])
        wait_until(lambda: httpx.get(self.fe.url + "/health", timeout=5).json()["healthy_workers"] == total)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_decode_leg_dying_mid_stream_migrates_to_a_new_pair(protocol, tmp_path):
    fleet = PDFleet(protocol, tmp_path, 1, 2)
    try:
        reference = fleet.run("ref")
        for s in fleet.sims["decode"]:
            httpx.post(s.url + "/sim/faults", json={"after_tokens": 3, "input_len": len(PROMPT)},
                       timeout=5).raise_for_status()
        try:
            got = fleet.run("cut")
            rec = fleet.record("cut")
        finally:
            fleet.heal()
    finally:
        fleet.stop()
    if protocol == "sglang":
        assert "routed_experts" in reference[-2]["meta_info"]
    assert got == reference
    assert (rec["status"], rec["output_tokens"], rec["migrations"]) == ("ok", 8, 1)
    assert [(a["role"], a["outcome"], a.get("tokens"), a.get("backoff_ms")) for a in rec["attempts"]] == [
        ("prefill", "finished", None, None), ("decode", "worker_lost", 3, None),
        ("prefill", "finished", None, 50), ("decode", "finished", 5, 50)]
    assert rec["attempts"][1]["worker_id"] != rec["attempts"][3]["worker_id"]


def test_prefill_leg_dying_before_the_handoff_is_a_failover(tmp_path):
    """Two prefill workers, one armed to drop its next request before its
    first token: of two requests (the router alternates the prefill
    workers), the one that met it ran on the other pair from scratch, with
    no migration counted, and both answers are the uninterrupted one."""
    fleet = PDFleet("sglang", tmp_path, 2, 1)
    try:
        reference = fleet.run("ref")
        httpx.post(fleet.sims["prefill"][0].url + "/sim/faults", json={"after_tokens": 0},
                   timeout=5).raise_for_status()
        try:
            answers = [fleet.run(f"p{i}") for i in range(2)]
            recs = [fleet.record(f"p{i}") for i in range(2)]
        finally:
            fleet.heal()
    finally:
        fleet.stop()
    assert answers == [reference, reference]
    failed = [r for r in recs if len(r["attempts"]) == 4]
    assert len(failed) == 1
    rec = failed[0]
    assert "migrations" not in rec and rec["status"] == "ok" and rec["output_tokens"] == 8
    assert [(a["role"], a["outcome"]) for a in rec["attempts"]] == [
        ("prefill", "worker_lost"), ("decode", "aborted"), ("prefill", "finished"), ("decode", "finished")]
