"""P/D fleets under real load: the SGLang legs' race.

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

from support import PROMPT, post, sse, stats, start_sim, Traced, wait_until

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
