"""Legs given up under load: a stream silent past the inter-token deadline
moves to another worker and its stalled leg is aborted at once, not when
the request ends; concurrent migrations are bounded fleet-wide.

The simulators' fault hook (``POST /sim/faults``, ``"stall": true``) makes
a leg fall silent after a number of tokens with its worker healthy, as an
engine stuck on one request does; it generates again only once aborted.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from support import PROMPT, RawClient, start_frontend, start_sim, stats, trace_records, wait_until

GEN = {"sglang": "/generate", "vllm": "/inference/v1/generate"}


def _stream(protocol: str, budget: int) -> dict:
    if protocol == "sglang":
        return {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": budget, "ignore_eos": True}}
    return {"token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": budget, "ignore_eos": True}}


def _output_ids(protocol: str, events: list[bytes]) -> list[int]:
    """A stream's output ids (SGLang's are cumulative, vLLM's per chunk)."""
    objs = [orjson.loads(e) for e in events if e != b"[DONE]"]
    if protocol == "sglang":
        return objs[-1]["output_ids"]
    return [t for o in objs for c in o["choices"] for t in c["token_ids"]]


def _stall(sims, after_tokens: int, count: int = 1) -> None:
    for s in sims:
        httpx.post(s.url + "/sim/faults", json={"after_tokens": after_tokens, "input_len": len(PROMPT),
                                                "stall": True, "count": count}, timeout=5).raise_for_status()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_stalled_leg_is_aborted_when_the_stream_moves_on(protocol, worker_class, tmp_path):
    """Two tokens, then silence past ``--inter-token-timeout``: the stream
    continues on the other worker from those tokens, and the stalled leg's
    engine has its abort before the continuation's first token reached the
    client (the continuation still has 0.75 s to run)."""
    sims = [start_sim(protocol, itl_ms=150) for _ in range(2)]
    fe = None
    try:
        _stall(sims, 2)
        fe = start_frontend([f"{protocol}={s.url}" for s in sims], worker_class=worker_class,
                            extra=["--inter-token-timeout", "0.5", "--trace-file", str(tmp_path / "t.jsonl")])
        client = RawClient(fe.url)
        client.send(orjson.dumps(_stream(protocol, 8)), path=GEN[protocol])
        events = client.events(3)
        (stalled,) = [s for s in sims if stats(s)["faults_fired"]]
        at_resume = stats(stalled)
        events += client.events(100)
        client.close()
        rec = wait_until(lambda: (r := trace_records(str(tmp_path / "t") + ".*.jsonl")) and r[-1])
    finally:
        if fe is not None:
            fe.stop()
        for s in sims:
            s.stop()
    assert (at_resume["running"], len(at_resume["abort_named_ids"])) == (0, 1)
    assert len(_output_ids(protocol, events)) == 8
    assert (rec["status"], rec["output_tokens"], rec["migrations"]) == ("ok", 8, 1)
    assert [(a["role"], a["outcome"], a.get("tokens"), a.get("abort_acked")) for a in rec["attempts"]] == [
        ("aggregated", "timeout", 2, True), ("resumed", "finished", 6, None)]
