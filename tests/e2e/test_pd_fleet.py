"""P/D fleets under real load: batches and ``n`` > 1 on pairs, and the
SGLang legs' race.

A fleet of prefill and decode workers only serves an SGLang batch or
``n`` > 1 on a pair (both legs carry every entry, a bootstrap room each),
and the answer is the aggregated engine's, value for value (ids aside: the
frontend mints what the engine would), unary and SSE. vLLM's ``n`` > 1 cannot
run on a pair: the client gets vLLM's 400 shape saying why.

SGLang's prefill and decode legs run concurrently, so a prefill may fail
after its decode leg already streamed tokens. The rule: the client gets no
decode event before the prefill leg answered successfully; a prefill that
fails, before or after the decode took its KV, fails the request with the
prefill's error and its decode leg is aborted, never ``ok``. The prefill
simulator's fault hook (``POST /sim/faults`` ``prefill_abort``) forces each
ordering. (vLLM's legs run one after the other: its decode leg starts only
once the prefill answered.)
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from support import PROMPT, post, same, sse, stats, start_sim, Traced, wait_until, without_timing

#: Every test here starts simulators and frontends.
pytestmark = pytest.mark.e2e

PREFILL = ["--disaggregation-mode", "prefill", "--bootstrap-port", "0"]
DECODE = ["--disaggregation-mode", "decode"]
#: Four tokens, 0.1 s apart: the decode leg streams them all before the
#: prefill's late failure (0.8 s after the KV went over).
BODY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
BEFORE = "simulated prefill failure before the KV hand-over (POST /sim/faults)"
AFTER = "simulated prefill failure after the KV hand-over (POST /sim/faults)"


def prefill_spec(sim) -> str:
    port = httpx.get(sim.url + "/get_server_info", timeout=5).json()["disaggregation_bootstrap_port"]
    return f"sglang={sim.url}?bootstrap_port={port}"


@pytest.fixture(scope="module")
def pair():
    procs = (start_sim(extra=PREFILL), start_sim(itl_ms=100, extra=DECODE))
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def aggregated():
    proc = start_sim()
    yield proc
    proc.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def front(request, pair, tmp_path_factory):
    p, d = pair
    fe = Traced(tmp_path_factory, ["--disaggregation", "always", "--prefill", prefill_spec(p),
                                   "--decode", f"sglang={d.url}"], request.param)
    yield fe
    fe.stop()


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "unary"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_failed_prefill_fails_the_request_whatever_the_decode_sent(front, pair, when, stream):
    """Before: the prefill aborts instead of handing its KV over (the
    decode waits for it). After: it aborts 0.8 s after the decode took the
    KV, when the decode has computed all its 4 tokens. Either way the client
    gets the prefill's 500 and no token, the record says ``engine_error``
    and the decode leg is aborted."""
    p, d = pair
    httpx.post(p.url + "/sim/faults", json={"prefill_abort": when, "delay_ms": 800}, timeout=5).raise_for_status()
    body = {**BODY, "stream": stream}
    message = BEFORE if when == "before" else AFTER
    if stream:
        status, events = sse(front.url, body)
        assert (status, [orjson.loads(e) for e in events]) == (500, [])
    else:
        r = post(front.url, body)
        status = r.status_code
        assert (status, r.json()["message"]) == (500, message)
    (rec,) = front.take()
    assert (rec["status"], rec["http_status"], rec["output_tokens"]) == ("engine_error", 500, 0)
    assert message in rec["error"]["message"]  # a unary prefill's error page is kept whole
    assert [(a["role"], a["outcome"]) for a in rec["attempts"]] == [("prefill", "error"), ("decode", "aborted")]
    wait_until(lambda: stats(d)["running"] == 0 and stats(p)["running"] == 0)


#: Batches as SGLang takes them: a list of prompts (each with its own
#: sampling parameters), ``n`` 2 of one prompt, and a list with ``n`` 2,
#: prompt logprobs and routed experts (joined per entry from the legs).
BATCHES = {
    "list": {"input_ids": [PROMPT, [5, 9, 77], [42]], "rid": ["a", "b", "c"],
             "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 2}, {"max_new_tokens": 4}]},
    "n2": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "n": 2}},
    "list_n2_joined": {"input_ids": [PROMPT, [5, 9, 77, 300, 12]], "sampling_params": {"max_new_tokens": 3, "n": 2},
                       "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                       "return_routed_experts": True, "routed_experts_start_len": 1},
}


def _entries(events: list[bytes]) -> dict[int, list]:
    """A batch stream's chunks by entry index, ids and timing left out."""
    by: dict[int, list] = {}
    for e in events:
        if e != b"[DONE]":
            chunk = without_timing(orjson.loads(e))
            chunk["meta_info"].pop("id")
            by.setdefault(chunk["index"], []).append(chunk)
    return by


def _unary(answer: list) -> list:
    out = without_timing(answer)
    for entry in out:
        entry["meta_info"].pop("id")
    return out


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "unary"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_a_batch_on_a_pair_is_the_aggregated_answer(front, pair, aggregated, name, stream):
    """Each entry's answer (tokens, text, logprobs, expert rows, usage,
    finish) equals the aggregated engine's; one record per entry, each
    with the pair's prefill and decode legs."""
    body = {**BATCHES[name], "stream": stream}
    entries = 3 if name == "list" else 2 if name == "n2" else 4
    if stream:
        status, got = sse(front.url, body)
        want = sse(aggregated.url, body)[1]
        assert status == 200 and got[-1] == b"[DONE]"
        same(_entries(got), _entries(want))
    else:
        r = post(front.url, body)
        assert r.status_code == 200
        same(_unary(r.json()), _unary(post(aggregated.url, body).json()))
    recs = front.take(entries)
    assert sorted(r["batch_index"] for r in recs) == list(range(entries))
    assert {(r["status"], tuple((a["role"], a["outcome"]) for a in r["attempts"])) for r in recs} == {
        ("ok", (("prefill", "finished"), ("decode", "finished")))}
    p, d = pair
    wait_until(lambda: stats(d)["running"] == 0 and stats(p)["running"] == 0 and stats(p)["rooms_waiting"] == 0)


def test_bootstrap_rooms_per_entry_as_sglang_expands_them(pair):
    """The simulator's prefill server takes a room per entry as SGLang
    does: a scalar room becomes room + i, a list is one per prompt, and
    with n > 1 a list gives every sample its prompt's room, which the
    prefill refuses as already in use."""
    p, _ = pair
    base = {"input_ids": [PROMPT, [5, 9]], "sampling_params": {"max_new_tokens": 1}}
    r = post(p.url, {**base, "bootstrap_room": [7, 7]})
    assert (r.status_code, r.json()) == (400, {"error": {"message": "bootstrap_room 7 is already in use."}})
    r = post(p.url, {**base, "sampling_params": {"max_new_tokens": 1, "n": 2}, "bootstrap_room": [8, 9]})
    assert (r.status_code, r.json()) == (400, {"error": {"message": "bootstrap_room 8 is already in use."}})
    r = post(p.url, {**base, "bootstrap_room": [3]})
    assert (r.status_code, r.json()) == (400, {"error": {"message": "bootstrap_room has 1 values for a batch of 2."}})
    wait_until(lambda: stats(p)["running"] == 0)


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_vllm_n_above_1_on_a_pair_is_a_400_saying_why(worker_class, tmp_path_factory):
    """A fleet of vLLM producers and consumers only: ``n`` 2 cannot run on
    a pair (each choice would read the one prefill's KV); vLLM's error
    shape with status 400, never a 503 that reads as an outage."""
    producer = start_sim("vllm", extra=["--kv-role", "producer"])
    consumer = start_sim("vllm", extra=["--kv-role", "consumer"])
    fe = Traced(tmp_path_factory, ["--prefill", f"vllm={producer.url}", "--decode", f"vllm={consumer.url}"],
                worker_class)
    try:
        for stream in (False, True):
            r = post(fe.url, {"token_ids": PROMPT, "stream": stream, "sampling_params": {"max_tokens": 3, "n": 2}},
                     path="/inference/v1/generate")
            assert r.status_code == 400
            assert r.json()["error"]["message"].startswith("n > 1 cannot run on a vLLM prefill/decode pair")
            assert r.json()["error"]["code"] == 400
        recs = fe.take(2)  # refused as a whole before any item ran: one record each
        assert [(r["status"], r["http_status"], r["item_count"], r["stream"]) for r in recs] == [
            ("rejected", 400, 2, False), ("rejected", 400, 2, True)]
        assert stats(producer)["received"] == stats(consumer)["received"] == 0
    finally:
        fe.stop()
        producer.stop()
        consumer.stop()
